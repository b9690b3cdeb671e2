"""The engine on CUDA (skipped without a GPU): transformers' greedy tokens, one wait per
step, CUDA-graph decode equal to eager (the draft model's draft steps too), and the KV
budget from the device's memory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from backend.engine import model_runner
from backend.engine.engine import Engine
from backend.layers import staging
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from tests.engine.engine_support import build_checkpoint, make_engine, run_to_completion, tokens_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
PROMPTS = [[5, 9, 31, 7], list(range(40, 97)), [3] * 130]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("cuda") / "llama")


def cuda_engine(path: Path, **knobs: Any) -> Engine:
    return make_engine(path, device="cuda", dtype="float32", num_kv_blocks=256, **knobs)


def run(engine: Engine, params: list[SamplingParams]) -> dict[str, list[int]]:
    for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
        engine.add_request(EngineRequest(prompt, p, f"r{i}"))
    return {k: tokens_of(v) for k, v in run_to_completion(engine).items()}


def test_greedy_tokens_match_transformers_on_cuda(checkpoint: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf: Any = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    hf = hf.to("cuda").eval()
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    got = run(cuda_engine(checkpoint), [greedy] * 3)
    for i, prompt in enumerate(PROMPTS):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([prompt]).cuda(), max_new_tokens=12, do_sample=False)
        assert got[f"r{i}"] == out[0, len(prompt) :].tolist()


@pytest.fixture
def no_hidden_waits(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Any synchronising CUDA call raises, except in the runner's one read-back."""
    reads: list[int] = []
    real = staging.to_host

    def read_back(*tensors: torch.Tensor) -> list[torch.Tensor]:
        reads.append(len(tensors))
        torch.cuda.set_sync_debug_mode(0)
        try:
            return real(*tensors)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(model_runner, "to_host", read_back)
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield reads
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_a_step_waits_once_whatever_the_sampling(
    checkpoint: Path, no_hidden_waits: list[int]
) -> None:
    torch.cuda.set_sync_debug_mode(0)
    engine = cuda_engine(checkpoint)  # loading and capture may wait; steps may not
    torch.cuda.set_sync_debug_mode("error")
    params = [
        SamplingParams(max_tokens=6, temperature=0.7, top_p=0.9, top_k=20, seed=1, logprobs=2),
        SamplingParams(max_tokens=6, repetition_penalty=1.2, presence_penalty=0.5, min_tokens=3),
        SamplingParams(max_tokens=6, temperature=0, frequency_penalty=0.3),
    ]
    outputs = run(engine, params)
    assert all(len(t) == 6 for t in outputs.values())
    assert len(no_hidden_waits) == engine.num_steps  # one read-back per step


def test_graph_decode_equals_eager(checkpoint: Path) -> None:
    graphed = cuda_engine(checkpoint, max_num_seqs=8)
    if graphed.runner.graphs is None:
        pytest.skip(f"{graphed.runner.attention_name} cannot be captured in a CUDA graph")
    eager = cuda_engine(checkpoint, max_num_seqs=8, enforce_eager=True)
    assert eager.runner.graphs is None
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (9, 3, 14)]
    assert run(graphed, params) == run(eager, params)
    assert graphed.runner.graph_replays > 0


def test_draft_model_graphs_equal_eager(checkpoint: Path) -> None:
    """The draft model's decode steps replay its own CUDA graphs; greedy tokens equal
    the eager engine's and every draft of the target as its own draft is accepted."""
    spec = {"speculative_method": "draft", "speculative_model": str(checkpoint)}
    graphed = cuda_engine(checkpoint, max_num_seqs=8, **spec)
    if graphed.runner.graphs is None:
        pytest.skip(f"{graphed.runner.attention_name} cannot be captured in a CUDA graph")
    eager = cuda_engine(checkpoint, max_num_seqs=8, enforce_eager=True, **spec)
    for engine in (graphed, eager):
        engine.scheduler.weigh_drafts = False
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (9, 3, 14)]
    assert run(graphed, params) == run(eager, params)
    assert graphed.runner.draft_graph_replays > 0 and eager.runner.draft_graph_replays == 0
    assert graphed.stats().spec_decode_acceptance_rate == 1.0


def test_kv_budget_comes_from_the_device_memory(checkpoint: Path) -> None:
    engine = make_engine(checkpoint, device="cuda", num_kv_blocks=None, gpu_memory_utilization=0.3)
    runner = engine.runner
    total = torch.cuda.mem_get_info()[1]
    kv_bytes = runner.kv_cache.numel() * runner.kv_cache.element_size()
    assert 0 < kv_bytes <= 0.3 * total
    assert "device=cuda" in engine.describe()
