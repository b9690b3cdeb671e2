"""The model runner's set-up: the start-up line, the device and dtype it resolves and the
KV budget it takes on a GPU (from a fake memory reading: there is no GPU here)."""

from __future__ import annotations

import logging
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from backend.attention_metadata import AttentionMetadata
from backend.config import EngineConfig
from backend.engine.cuda_graphs import capture_sizes
from backend.engine.engine import Engine
from backend.engine.model_runner import ModelRunner
from backend.layers.attention import TorchPagedAttention
from backend.layers.staging import Staging
from backend.loader import resolve_dtype
from backend.models.config import load_model_config
from backend.models.llama import LlamaAttention
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from tests.engine.engine_support import make_engine, run_to_completion, tokens_of


def test_start_line_names_device_dtype_kv_and_graphs(
    llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="backend.engine.engine"):
        engine = make_engine(llama_dir, num_kv_blocks=100, max_model_len=96, device="auto")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine:")]
    assert len(lines) == 1
    cfg = load_model_config(llama_dir)
    # K and V, per layer, per block of 4 slots, per KV head and dimension, float32.
    kv_bytes = 2 * cfg.num_layers * 100 * 4 * cfg.num_kv_heads * cfg.head_dim * 4
    for part in (
        "device=cpu",
        "dtype=float32",
        "attention=",
        "kv_blocks=100",
        f"kv_bytes={kv_bytes}",
        f"max_seqs_at_max_model_len={100 // (96 // 4)}",
        "max_model_len=96",
        "cuda_graphs=off",
    ):
        assert part in lines[0], (part, lines[0])
    assert engine.runner.device == torch.device("cpu")  # 'auto' without a GPU
    assert engine.config.max_num_seqs == 32  # None: the CPU's running limit


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "expected"),
    [(True, False, torch.bfloat16), (False, True, torch.bfloat16), (False, False, torch.float32)],
)
def test_auto_dtype_on_the_cpu_is_bfloat16_only_where_the_processor_has_it(
    llama_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    avx512_bf16: bool,
    amx: bool,
    expected: torch.dtype,
) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    cfg = load_model_config(llama_dir)
    assert resolve_dtype("auto", torch.device("cpu"), cfg) == expected
    assert resolve_dtype("float32", torch.device("cpu"), cfg) == torch.float32  # asked: kept
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")  # a torch without the probe
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    assert resolve_dtype("auto", torch.device("cpu"), cfg) == torch.float32


def test_kv_budget_on_a_gpu_is_the_utilization_less_what_is_in_use(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a fake memory reading: the budget is measured after the allocator's cache is
    emptied and a profiling step has run, and that step's peak (2 GiB here) comes off it
    (issue 33: freed load buffers counted as used, and activations had no headroom)."""
    gib = 2**30
    engine = make_engine(llama_dir, kv_cache_bytes=3 * gib)
    runner: ModelRunner = engine.runner
    assert runner._kv_budget(engine.max_model_len) == 3 * gib  # the CPU: the configured bytes
    calls: list[str] = []
    allocated = [10 * gib]

    def mem_get_info(device: torch.device) -> tuple[int, int]:
        calls.append(f"mem_get_info {device}")
        return 30 * gib, 80 * gib  # free, total: 50 GiB in use (weights, context, others)

    def profile(max_model_len: int) -> None:
        calls.append("profile")
        allocated.append(12 * gib)  # the step's peak: 2 GiB over the weights

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device: None)
    monkeypatch.setattr(cuda, "memory_allocated", lambda device: allocated[0])
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device: max(allocated))
    monkeypatch.setattr(runner, "profile_step", profile)
    monkeypatch.setattr(runner, "device", torch.device("cuda:0"))
    monkeypatch.setattr(runner, "config", EngineConfig(gpu_memory_utilization=0.9))
    assert runner._kv_budget(engine.max_model_len) == 72 * gib - 50 * gib - 2 * gib
    assert calls == ["empty_cache", "profile", "empty_cache", "mem_get_info cuda:0"]
    monkeypatch.setattr(runner, "config", EngineConfig(gpu_memory_utilization=0.5))
    assert runner._kv_budget(engine.max_model_len) == 0  # more than half in use already


class TensorMetadataTorch(TorchPagedAttention):
    """The torch reference made graph-capable for a CPU test: metadata from tensors, and
    padded rows' slots (-1) skipped. Records each step's slot mapping."""

    def __init__(self) -> None:
        self.slots: list[list[int]] = []

    def decode_metadata(
        self,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        block_size: int,
    ) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping, block_tables, seq_lens.tolist(), query_start_loc.tolist(), block_size
        )

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        self.slots.append(meta.slot_mapping.tolist())
        keep = meta.slot_mapping >= 0
        kept = replace(meta, slot_mapping=meta.slot_mapping[keep])
        super().write_kv(k[keep], v[keep], kv_cache, kept)


def _with_graphs(engine: Engine) -> TensorMetadataTorch:
    """The decode-graph path on the CPU: the same static buffers and padding, replayed
    eagerly (no CUDA here to capture with)."""
    backend = TensorMetadataTorch()
    runner = engine.runner
    runner.attention = backend
    models = [runner.model] + ([runner.drafter.model] if runner.drafter else [])
    for module in (m for model in models for m in model.modules()):
        if isinstance(module, LlamaAttention):
            module.backend = backend
    runner._capture_graphs()  # the draft model's too, when it has one
    runner.use_cuda_graphs = True
    return backend


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]


def test_decode_graph_path_pads_and_gives_the_eager_tokens(llama_dir: Path) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 300) for _ in range(n)] for n in (5, 9, 17)]
    lengths = (6, 10, 3)  # the batch shrinks 3 -> 2 -> 1 as requests finish
    greedy = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    seeded = [
        SamplingParams(max_tokens=n, temperature=0.8, top_k=20, seed=i)
        for i, n in enumerate(lengths)
    ]

    def run(engine: Engine, params: list[SamplingParams]) -> dict[str, list[int]]:
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(EngineRequest(prompt, p, f"r{i}"))
        return {k: tokens_of(v) for k, v in run_to_completion(engine).items()}

    eager = make_engine(llama_dir, max_num_seqs=5)
    graphed = make_engine(llama_dir, max_num_seqs=5)
    backend = _with_graphs(graphed)
    for params in (greedy, seeded):
        assert run(graphed, params) == run(eager, params)
    assert graphed.runner.graph_replays > 0 and eager.runner.graph_replays == 0
    # Three decode rows run as a batch of 4, the fourth a padded row whose slot is -1.
    assert any(len(s) == 4 and s[3] == -1 and min(s[:3]) >= 0 for s in backend.slots)


def test_draft_steps_replay_the_draft_models_graphs(llama_dir: Path) -> None:
    """Speculative decoding with a draft model: its draft steps (one token a row) go
    through its own decode graphs, three rows padded to four, and the tokens equal the
    eager engine's (the target as its own draft: every draft accepted, so each step
    drafts K tokens through K - 1 replays)."""
    rng = random.Random(4)
    prompts = [[rng.randrange(2, 300) for _ in range(n)] for n in (5, 9, 17)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    spec = {"speculative_method": "draft", "speculative_model": str(llama_dir)}

    def run(engine: Engine) -> dict[str, list[int]]:
        engine.scheduler.weigh_drafts = False  # every draft proposed runs
        for i, prompt in enumerate(prompts):
            engine.add_request(EngineRequest(prompt, params, f"r{i}"))
        return {k: tokens_of(v) for k, v in run_to_completion(engine).items()}

    eager = make_engine(llama_dir, max_num_seqs=5, **spec)
    graphed = make_engine(llama_dir, max_num_seqs=5, **spec)
    backend = _with_graphs(graphed)
    drafter = graphed.runner.drafter
    assert drafter is not None and drafter.graphs is not None
    assert run(graphed) == run(eager)
    assert graphed.runner.draft_graph_replays >= 2 * (params.max_tokens // 5)
    assert eager.runner.draft_graph_replays == 0
    assert graphed.stats().spec_decode_acceptance_rate == 1.0
    assert any(len(s) == 4 and s[3] == -1 and min(s[:3]) >= 0 for s in backend.slots)
    # Switched off, the draft steps run eagerly again.
    graphed.runner.use_cuda_graphs = False
    replays = graphed.runner.draft_graph_replays
    run(graphed)
    assert graphed.runner.draft_graph_replays == replays


def test_staging_uploads_each_dtype_in_one_buffer() -> None:
    stage = Staging(torch.device("cpu"))
    stage.add("ids", [3, 1, 2])
    stage.add("table", [[1, 2], [3, 4]])
    stage.add("temps", [0.5, 1.0], torch.float32)
    got = stage.upload()
    assert got["ids"].tolist() == [3, 1, 2] and got["ids"].dtype == torch.int64
    assert got["table"].tolist() == [[1, 2], [3, 4]]
    assert got["temps"].tolist() == [0.5, 1.0] and got["temps"].dtype == torch.float32
    assert got["ids"].untyped_storage().data_ptr() == got["table"].untyped_storage().data_ptr()
