"""The Triton kernels compiled for a real GPU (bfloat16 and float32), and the engine on
them against transformers' greedy tokens. Skipped without CUDA, and when the interpreter
suite (tests/kernels) has already set TRITON_INTERPRET=1 in this process: kernels are
compiled or interpreted once per process, so run `pytest tests/gpu` on its own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from backend.requests import EngineRequest
from tests.kernels.kernel_support import DECODE, MIXED, Batch, make_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1",
        reason="TRITON_INTERPRET=1 in this process: run pytest tests/gpu on its own",
    ),
]

HEADS = [(4, 4), (8, 2), (8, 1), (32, 8)]
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (1.5e-2, 1e-2)}


def _on_gpu(batch: Batch) -> Batch:
    cuda = torch.device("cuda")
    return Batch(
        batch.q.to(cuda),
        batch.k_cache.to(cuda),
        batch.v_cache.to(cuda),
        batch.block_tables.to(cuda),
        batch.seq_lens,
        batch.query_start_loc,
    )


def _check(batch: Batch, num_segments: int) -> None:
    from backend.kernels.paged_attention import paged_attention, paged_attention_reference

    seq_lens, starts = (t.cuda() for t in batch.tensors())
    scale = batch.q.shape[-1] ** -0.5
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables)
    out, lse = paged_attention(*args, seq_lens, starts, scale, batch.max_query_len, num_segments)
    ref, ref_lse = paged_attention_reference(*args, batch.seq_lens, batch.query_start_loc, scale)
    atol, rtol = TOLERANCE[batch.q.dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("heads", "kv_heads"), HEADS)
def test_paged_attention_on_the_gpu(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    for block_size in (16, 32):
        _check(_on_gpu(make_batch(MIXED, heads, kv_heads, head_dim, block_size, dtype)), 1)
        decode = _on_gpu(make_batch(DECODE, heads, kv_heads, head_dim, block_size, dtype))
        _check(decode, 1)
        _check(decode, 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_write_kv_and_fused_norms_on_the_gpu(dtype: torch.dtype) -> None:
    from backend.kernels.kv_cache import write_kv, write_kv_reference
    from backend.kernels.norm import (
        rms_norm,
        rms_norm_reference,
        silu_and_mul,
        silu_and_mul_reference,
    )

    k, v = torch.randn(2, 40, 8, 128, device="cuda").to(dtype)
    slots = torch.randperm(64 * 16, device="cuda")[:40]
    slots[::7] = -1
    cache = torch.randn(2, 64, 16, 8, 128, device="cuda").to(dtype)
    expected = cache.clone()
    write_kv(k, v, cache[0], cache[1], slots)
    write_kv_reference(k, v, expected[0], expected[1], slots)
    assert torch.equal(cache, expected)
    x, residual = torch.randn(2, 33, 2048, device="cuda").to(dtype)
    weight = torch.randn(2048, device="cuda").to(dtype)
    got_res, ref_res = residual.clone(), residual.clone()
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (1.5e-2, 1.5e-2)
    out = rms_norm(x, weight, 1e-5, got_res)
    torch.testing.assert_close(
        out, rms_norm_reference(x, weight, 1e-5, ref_res), atol=atol, rtol=rtol
    )
    torch.testing.assert_close(got_res, ref_res, atol=atol, rtol=rtol)
    gate_up = torch.randn(33, 2 * 5632, device="cuda").to(dtype)
    torch.testing.assert_close(
        silu_and_mul(gate_up), silu_and_mul_reference(gate_up), atol=atol, rtol=rtol
    )


def test_engine_on_the_gpu_gives_transformers_greedy_tokens(tmp_path: Path) -> None:
    from backend.sampling import SamplingParams
    from tests.engine.engine_support import (
        build_checkpoint,
        make_engine,
        run_to_completion,
        tokens_of,
    )
    from tests.engine.test_engine_oracle import LENGTHS, NEW_TOKENS, hf_greedy, oracle_prompts

    llama = build_checkpoint(tmp_path / "llama", "llama")
    engine = make_engine(
        llama,
        block_size=16,
        num_kv_blocks=512,
        max_model_len=1024,
        max_num_batched_tokens=256,
        device="cuda",
        dtype="float32",
        attention_backend="triton",
    )
    assert type(engine.runner.attention).__name__ == "TritonPagedAttention"
    prompts = oracle_prompts(engine.model_config.vocab_size)[: len(LENGTHS)]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(prompt, greedy, f"r{i}"))
    outputs = run_to_completion(engine)
    assert [tokens_of(outputs[f"r{i}"]) for i in range(len(prompts))] == hf_greedy(llama, prompts)
