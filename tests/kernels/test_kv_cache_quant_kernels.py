"""The Triton KV-write and paged-attention kernels over a one-byte cache (int8, fp8 e4m3:
backend/layers/kv_quant.py's layout, values then a float32 scale per token and KV head),
under the interpreter, against the torch references: the write quantizes as the torch
path does, the read equals the reference over the dequantized cache (the same numbers,
float32 tolerance) and the unquantized cache within the quantization's tolerance."""

from __future__ import annotations

import random

import pytest
import torch

from backend.attention_metadata import AttentionMetadata
from backend.kernels.kv_cache import write_kv, write_kv_reference
from backend.kernels.paged_attention import paged_attention, paged_attention_reference
from backend.kernels.triton_attention import TritonPagedAttention
from backend.layers import kv_quant
from backend.layers.attention import TorchPagedAttention
from backend.layers.quant import FP8
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from tests.engine.engine_support import build_checkpoint, make_engine, run_to_completion, tokens_of
from tests.kernels.kernel_support import DECODE, MIXED, Batch, make_batch

pytestmark = pytest.mark.interpreter

DTYPES = {"int8": torch.int8, "fp8": FP8}
# Attention output against the unquantized cache (unit-variance K/V): int8's half step is
# ~1/100 of a row's peak, fp8's 1/16 of a value.
QUANT_TOLERANCE = {"int8": 0.03, "fp8": 0.15}


def quantized(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D] float -> [..., D + 4] in `dtype`, kv_quant's layout."""
    out = torch.zeros(*cache.shape[:-1], cache.shape[-1] + kv_quant.SCALE_BYTES, dtype=dtype)
    values, scales = kv_quant.split(out)
    q, s = kv_quant.quantize(cache, dtype)
    values.view(torch.uint8).copy_(q.view(torch.uint8))
    scales.copy_(s)
    return out


Pair = tuple[torch.Tensor, torch.Tensor]


def attend(
    batch: Batch, k_cache: torch.Tensor, v_cache: torch.Tensor, segments: int
) -> tuple[Pair, Pair]:
    seq_lens, starts = batch.tensors()
    scale = batch.q.shape[-1] ** -0.5
    got = paged_attention(
        batch.q, k_cache, v_cache, batch.block_tables, seq_lens, starts, scale,
        batch.max_query_len, segments,
    )  # fmt: skip
    ref = paged_attention_reference(
        batch.q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
        scale,
    )  # fmt: skip
    return got, ref


@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize(("seqs", "segments"), [(MIXED, 1), (DECODE, 1), (DECODE, 8)])
def test_the_kernel_reads_a_quantized_cache_as_the_reference(
    name: str, seqs: list[tuple[int, int]], segments: int
) -> None:
    batch = make_batch(seqs, 8, 2, 64, 16, seed=7)
    k_q, v_q = quantized(batch.k_cache, DTYPES[name]), quantized(batch.v_cache, DTYPES[name])
    (out, lse), (ref_out, ref_lse) = attend(batch, k_q, v_q, segments)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    _, (exact, _) = attend(batch, batch.k_cache, batch.v_cache, 1)
    error = float((out - exact).abs().max())
    print(f"{name} KV: attention output's largest error {error:.4f} (unit-variance K/V)")
    assert 0 < error < QUANT_TOLERANCE[name]


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_bfloat16_queries_over_a_quantized_cache(name: str) -> None:
    batch = make_batch(MIXED, 8, 2, 64, 16, dtype=torch.bfloat16, seed=3)
    k_q, v_q = quantized(batch.k_cache, DTYPES[name]), quantized(batch.v_cache, DTYPES[name])
    (out, _), (ref_out, _) = attend(batch, k_q, v_q, 1)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref_out, atol=1.5e-2, rtol=1e-2)


@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize(("kv_heads", "head_dim"), [(2, 64), (3, 80)])  # padded lanes too
def test_write_kv_quantizes_as_the_torch_path_and_skips_padding(
    name: str, kv_heads: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 9, kv_heads, head_dim, generator=gen) * 3
    slots = torch.randint(0, 12 * 16, (9,), generator=gen)
    slots[[2, 7]] = -1  # padding: not stored
    cache = torch.zeros(2, 12, 16, kv_heads, head_dim + 4, dtype=DTYPES[name])
    expected = cache.clone()
    write_kv(k, v, cache[0], cache[1], slots)
    write_kv_reference(k, v, expected[0], expected[1], slots)
    got_values, got_scales = kv_quant.split(cache)
    want_values, want_scales = kv_quant.split(expected)
    torch.testing.assert_close(got_scales, want_scales, atol=0, rtol=1e-6)
    got, want = got_values.float(), want_values.float()
    if name == "int8":  # halves round away from zero in the kernel, to even in torch
        assert (got - want).abs().max() <= 1
    else:
        # The interpreter's e4m3 conversion drops a rounding's carry into the next binade
        # (a value rounding up to 2^n comes out 2^(n-1)) and flushes the smallest
        # subnormal (2^-9) to 0; the GPU's does neither, and bench/gpu_check.py compares
        # the two exactly there.
        carried = (want != got) & (got * 2 == want)
        flushed = (got == 0) & (want.abs() == 2**-9)
        quirk = carried | flushed
        assert torch.equal(got[~quirk], want[~quirk])
        assert (want[carried].abs().log2() % 1 == 0).all()
    kept = slots >= 0
    untouched = torch.ones(12 * 16, dtype=torch.bool)
    untouched[slots[kept]] = False
    assert cache[:, :].flatten(1, 2)[:, untouched].view(torch.uint8).eq(0).all()


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_the_triton_backend_equals_the_torch_backend_on_a_quantized_cache(name: str) -> None:
    batch = make_batch(MIXED, 8, 2, 64, 16, seed=5)
    kv_cache = torch.stack(
        [quantized(batch.k_cache, DTYPES[name]), quantized(batch.v_cache, DTYPES[name])]
    )
    meta = AttentionMetadata(
        slot_mapping=torch.full((batch.q.shape[0],), -1),
        block_tables=batch.block_tables,
        seq_lens=batch.seq_lens,
        query_start_loc=batch.query_start_loc,
        block_size=16,
    )
    got = TritonPagedAttention().attend(batch.q, kv_cache, meta, 0.125)
    want = TorchPagedAttention().attend(batch.q, kv_cache, meta, 0.125)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_engine_on_triton_with_an_int8_cache_gives_the_torch_path_tokens(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Prefills in chunks of 16, decode rows and a prefix-cache hit over an int8 cache:
    the Triton kernels and the torch path store and read the same numbers."""
    path = build_checkpoint(tmp_path_factory.mktemp("kvq") / "llama", "llama")
    rng = random.Random(5)
    shared = [rng.randrange(2, 300) for _ in range(16)]
    prompts = [[rng.randrange(2, 300) for _ in range(n)] for n in (5, 30)]
    prompts.append(shared + [rng.randrange(2, 300) for _ in range(7)])
    prompts.append(shared + [rng.randrange(2, 300) for _ in range(3)])
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        engine = make_engine(
            path, block_size=16, max_num_batched_tokens=16, attention_backend=backend,
            kv_cache_dtype="int8",
        )  # fmt: skip
        outputs = {}
        for i, prompt in enumerate(prompts):  # one at a time: the last hits the cache
            engine.add_request(EngineRequest(prompt, greedy, f"r{i}"))
            outputs.update(run_to_completion(engine))
        tokens[backend] = [tokens_of(outputs[f"r{i}"]) for i in range(len(prompts))]
        assert engine.stats().prefix_cache_hits == 16
    assert tokens["triton"] == tokens["torch"]
