"""A KV cache in int8 or fp8 (`--kv-cache-dtype`, issue 34 item 2): the quantizer and its
layout, logits within a stated tolerance of the unquantized cache on the oracle prompts,
greedy agreement, prefix caching / chunking / preemption and the draft model unchanged in
effect, the blocks a budget buys, the start-up line and the capacity figures."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.attention_metadata import AttentionMetadata
from backend.builtin import BUILTIN_MODEL_DIR
from backend.capacity.check import check_config, facts
from backend.config import EngineConfig
from backend.engine.engine import Engine
from backend.engine.model_runner import kv_bytes_per_block
from backend.layers import kv_quant
from backend.layers.quant import FP8, QuantizationError
from backend.models.config import load_model_config
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from tests.engine.engine_support import make_engine, run_to_completion, tokens_of
from tests.engine.test_engine_oracle import BASE, TIGHT_BLOCKS, oracle_prompts, run_batched
from tests.engine.test_quantization import PYTHON_PROMPTS, _common_prefix
from tests.engine.test_speculative import spec_engine

# The last position's logits, relative to their largest magnitude, against a float32
# cache, over the 20 oracle prompts. int8 keeps each value within half a step (1/254 of
# its row's peak), fp8 e4m3 within 1/16 of the value itself (3 mantissa bits). Measured
# on the random test checkpoints (no dominant logit: the ratio is pessimistic): int8
# 0.025 (llama, qwen2), fp8 0.15.
LOGIT_TOLERANCE = {"int8": 0.04, "fp8": 0.25}
# Of the float32 cache's greedy tokens on the built-in model, each prompt up to its first
# divergence. Measured: int8 240/240, fp8 203/240 (bfloat16 weights alone keep 211).
GREEDY_AGREEMENT_FLOOR = {"int8": 0.95, "fp8": 0.8}


def test_quantize_keeps_each_value_within_half_a_step() -> None:
    x = torch.randn(7, 3, 64) * torch.logspace(-3, 2, 7)[:, None, None]  # rows of all sizes
    x[2, 1] = 0  # a zero row keeps a finite scale and zero values
    values, scales = kv_quant.quantize(x, torch.int8)
    assert values.dtype == torch.int8 and scales.shape == (7, 3)
    assert torch.isfinite(scales).all() and values[2, 1].eq(0).all()
    back = values.float() * scales[..., None]
    assert ((back - x).abs() <= scales[..., None] / 2 + 1e-7).all()
    f8, s8 = kv_quant.quantize(x, FP8)
    assert f8.dtype == FP8
    back = f8.float() * s8[..., None]
    assert ((back - x).abs() <= x.abs() / 16 + s8[..., None] * 2**-9).all()  # e4m3: 3 bits


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_a_written_row_reads_back_through_the_layout(name: str) -> None:
    """Values and their float32 scale share the cache row: head_dim + 4 bytes."""
    cfg = load_model_config(BUILTIN_MODEL_DIR)
    dtype = kv_quant.cache_dtype(name, torch.float32)
    cache = kv_quant.allocate(cfg, 6, 4, dtype, torch.device("cpu"))
    assert cache.shape[-1] == cfg.head_dim + 4 and cache.element_size() == 1
    k = torch.randn(5, cfg.num_kv_heads, cfg.head_dim)
    slots = torch.tensor([3, 0, 22, 9, 17])
    kv_quant.write(k, cache[1, 0], slots)
    back = kv_quant.dequantize(cache[1, 0], torch.float32).flatten(0, 1)[slots]
    step = k.abs().amax(-1, keepdim=True) / (127 if name == "int8" else 16)
    assert ((back - k).abs() <= step).all()
    untouched = torch.ones(cache.shape[2] * cache.shape[3], dtype=torch.bool)
    untouched[slots] = False
    assert cache[1, 0].flatten(0, 1)[untouched].view(torch.uint8).eq(0).all()


def last_logits(engine: Engine, prompt: list[int], dtype: torch.dtype) -> torch.Tensor:
    """One prefill of `prompt` through the engine's model over a fresh cache of `dtype`:
    the last position's logits (attention reads every key back from that cache)."""
    runner, bs = engine.runner, engine.config.block_size
    blocks = -(-len(prompt) // bs)
    cache = kv_quant.allocate(engine.model_config, blocks, bs, dtype, runner.device)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(len(prompt)),
        block_tables=torch.arange(blocks)[None],
        seq_lens=[len(prompt)],
        query_start_loc=[0, len(prompt)],
        block_size=bs,
    )
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(prompt), torch.arange(len(prompt)), cache, meta)
        return runner.model.logits(hidden[-1:])[0].float()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_logits_stay_within_tolerance_of_the_float32_cache(
    kind: str, name: str, checkpoints: dict[str, Path]
) -> None:
    engine = make_engine(checkpoints[kind], **BASE)
    prompts = oracle_prompts(engine.model_config.vocab_size)
    quantized = kv_quant.cache_dtype(name, torch.float32)
    errors = []
    for p in prompts:
        exact = last_logits(engine, p, torch.float32)
        approx = last_logits(engine, p, quantized)
        errors.append(float((approx - exact).abs().max() / exact.abs().max()))
    print(f"{kind} {name} KV: logits' largest relative error {max(errors):.4f}")
    assert max(errors) < LOGIT_TOLERANCE[name]
    assert max(errors) > 0  # the cache really was quantized


def greedy_tokens(kv_cache_dtype: str) -> list[list[int]]:
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    config = EngineConfig(device="cpu", dtype="float32", kv_cache_dtype=kv_cache_dtype)
    engine = Engine(BUILTIN_MODEL_DIR, config)
    for i, prompt in enumerate(PYTHON_PROMPTS):
        engine.add_request(EngineRequest(prompt, params, f"p{i}"))
    outputs = run_to_completion(engine)
    return [tokens_of(outputs[f"p{i}"]) for i in range(len(PYTHON_PROMPTS))]


def test_greedy_agreement_on_the_trained_model() -> None:
    """The built-in (trained) model's greedy tokens with an int8 and an fp8 cache against
    a float32 one, each prompt up to its first divergence."""
    want = greedy_tokens("auto")
    total = sum(len(t) for t in want)
    for name in ("int8", "fp8"):
        got = greedy_tokens(name)
        agreed = sum(_common_prefix(g, w) for g, w in zip(got, want, strict=True))
        print(f"{name} KV greedy agreement on the built-in model: {agreed}/{total}")
        assert agreed / total >= GREEDY_AGREEMENT_FLOOR[name]


@pytest.mark.parametrize("caching", [False, True], ids=["nocache", "cache"])
def test_prefix_cache_chunks_and_preemption_change_nothing(
    caching: bool, checkpoints: dict[str, Path]
) -> None:
    """A token's scale is its own (per token and head), so a cached prefix, a chunk and a
    preempted request's recompute store the same bytes: the batched, chunked, preempting
    run gives each prompt's tokens alone."""
    path = checkpoints["llama"]
    prompts = oracle_prompts(make_engine(path, **BASE).model_config.vocab_size)
    alone = make_engine(path, **BASE, kv_cache_dtype="int8", enable_prefix_caching=False)
    expected = [run_batched(alone, [p])[0] for p in prompts]
    config = {**BASE, "num_kv_blocks": TIGHT_BLOCKS, "max_model_len": 640}
    config |= {"max_num_batched_tokens": 64, "enable_prefix_caching": caching}
    engine = make_engine(path, **config, kv_cache_dtype="int8")
    assert run_batched(engine, prompts) == expected
    assert engine.stats().num_preemptions > 0
    if caching:
        assert engine.stats().prefix_cache_hits > 0


def test_the_budget_buys_twice_the_blocks_less_the_scales() -> None:
    """Same kv_cache_bytes: bf16 holds budget // (block x 2 x L x kv_heads x D x 2), int8
    budget // (block x 2 x L x kv_heads x (D + 4)): 2 D / (D + 4) times as many blocks,
    1.78x at the built-in model's head_dim 32 (1.94x at 128)."""
    cfg = load_model_config(BUILTIN_MODEL_DIR)
    budget = 64 * 2**20
    blocks: dict[str, int] = {}
    for name in ("auto", "int8", "fp8"):
        config = EngineConfig(
            device="cpu", dtype="bfloat16", kv_cache_dtype=name, kv_cache_bytes=budget
        )
        engine = Engine(BUILTIN_MODEL_DIR, config)
        dtype = engine.runner.kv_cache.dtype
        blocks[name] = engine.runner.num_blocks
        assert blocks[name] == budget // kv_bytes_per_block(cfg, 16, dtype)
        line = engine.describe()
        per_token = 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim + 4)
        if name != "auto":
            assert f"kv_cache_dtype={str(dtype).removeprefix('torch.')}" in line
            assert f"kv_bytes_per_token={per_token}" in line
            assert engine.runner.kv_cache.numel() == engine.runner.num_blocks * 16 * per_token
    ratio = blocks["int8"] / blocks["auto"]
    print(f"int8 KV blocks / bf16 KV blocks at the same budget: {ratio:.3f}")
    assert blocks["int8"] == blocks["fp8"]
    assert ratio == pytest.approx(2 * cfg.head_dim / (cfg.head_dim + 4), rel=0.01)


def test_fp8_is_refused_on_a_gpu_without_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "A100")
    with pytest.raises(QuantizationError, match=r"fp8 needs compute capability 8\.9"):
        kv_quant.check_kv_cache_dtype("fp8", torch.device("cuda"))
    kv_quant.check_kv_cache_dtype("int8", torch.device("cuda"))  # int8 runs anywhere
    kv_quant.check_kv_cache_dtype("fp8", torch.device("cpu"))  # the torch path converts
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int4")


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_capacity_check_and_the_planner_count_the_engine_bytes(name: str) -> None:
    """`tollgate capacity check --kv-cache-dtype int8`: the planner's block (scales
    included) is the engine's, and so is the number of blocks the budget buys."""
    engine = Engine(BUILTIN_MODEL_DIR, check_config("cpu", kv_cache_dtype=name))
    f = facts(engine)
    assert f.kv_dtype == name
    assert f.bytes_per_block == f.planner_bytes_per_block
    assert f.num_blocks == f.planner_num_blocks


def test_the_draft_model_shares_the_quantized_layout(llama_dir: Path) -> None:
    """Speculative decoding with a draft model over an int8 cache: the draft's pool is
    int8 too (the budget counts both), and greedy tokens equal the int8 engine's alone."""
    prompts = oracle_prompts(make_engine(llama_dir, **BASE).model_config.vocab_size)[:6]
    plain = make_engine(llama_dir, **BASE, kv_cache_dtype="int8")
    expected = run_batched(plain, prompts)
    spec = spec_engine(
        llama_dir,
        **BASE,
        kv_cache_dtype="int8",
        speculative_method="draft",
        speculative_model=str(llama_dir),
    )
    drafter = spec.runner.drafter
    assert drafter is not None and drafter.kv_cache is not None
    assert drafter.kv_cache.dtype == torch.int8
    assert run_batched(spec, prompts) == expected
    assert spec.stats().spec_decode_num_drafts > 0


def test_the_step_tokens_gauge_counts_the_decoding_sequences(llama_dir: Path) -> None:
    """bench/kv_quant.py reads the most sequences decoding at once from this gauge (the
    running gauge also counts a prompt started with a step's leftover budget)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from backend.telemetry import EngineStatsCollector

    engine = make_engine(llama_dir)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for i in range(3):
        engine.add_request(EngineRequest([5 + i, 6, 7, 8], params, f"r{i}"))
    engine.step()  # the three prompts
    engine.step()  # their first decode
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(engine.stats))
    text = generate_latest(registry).decode()
    assert 'tollgate_engine_step_tokens{kind="decode"} 3.0' in text
    assert 'tollgate_engine_step_tokens{kind="prefill"} 0.0' in text
