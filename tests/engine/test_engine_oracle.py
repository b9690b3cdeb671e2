"""The correctness oracle: greedy tokens equal transformers' generate(do_sample=False),
token for token, for 20 prompts of 5 to 600 tokens on two tiny random checkpoints (GQA
Llama; Qwen2 with q/k/v biases and tied embeddings): each prompt alone, all batched,
with the prefix cache on and off, in chunks of at most 64 tokens (3 to 10 chunks for
the long prompts), and with a KV pool small enough to force preemption."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from backend.engine.batch import ModelRunnerOutput, SchedulerOutput
from backend.engine.engine import Engine
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from tests.engine.engine_support import make_engine, run_to_completion, tokens_of

NEW_TOKENS = 12
LENGTHS = (5, 6, 9, 15, 16, 17, 31, 48, 64, 65, 97, 128, 150, 211, 256, 300, 383, 450, 512, 600)
SHARED = 96  # every other prompt starts with the same 96 tokens: prefix-cache hits
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
# One max-length sequence (600 + 12 tokens) fits; the 20 prompts together (~4,000
# tokens) do not, so batched runs must preempt.
TIGHT_BLOCKS = 40  # of 16 tokens: 640
BASE: dict[str, Any] = {"block_size": 16, "num_kv_blocks": 512, "max_model_len": 1024}


def oracle_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1234)
    shared = [rng.randrange(2, vocab) for _ in range(SHARED)]
    prompts = []
    for i, n in enumerate(LENGTHS):
        own = [rng.randrange(2, vocab) for _ in range(n)]
        prompts.append((shared + own)[:n] if i % 2 and n > SHARED else own)
    return prompts


def hf_greedy(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(
                torch.tensor([p]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            refs.append(out[0, len(p) :].tolist())
    return refs


Oracle = dict[str, tuple[list[list[int]], list[list[int]]]]


@pytest.fixture(scope="session")
def oracle(checkpoints: dict[str, Path]) -> Oracle:
    """Per checkpoint: the prompts and transformers' tokens, computed once per session."""
    refs = {}
    for kind in ("llama", "qwen2"):
        cfg = make_engine(checkpoints[kind], **BASE).model_config
        prompts = oracle_prompts(cfg.vocab_size)
        refs[kind] = (prompts, hf_greedy(checkpoints[kind], prompts))
    return refs


def record_chunks(engine: Engine) -> Counter[str]:
    """Counts, per request, the steps that computed part of its prompt."""
    chunks: Counter[str] = Counter()
    execute = engine.runner.execute

    def spy(batch: SchedulerOutput) -> ModelRunnerOutput:
        prompt_lens = {r.request_id: r.num_prompt_tokens for r in engine.scheduler.running}
        chunks.update(
            r.request_id for r in batch.requests if r.start_pos < prompt_lens[r.request_id]
        )
        return execute(batch)

    engine.runner.execute = spy  # type: ignore[method-assign]
    return chunks


def run_batched(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(p, GREEDY, f"b{i}"))
    outputs = run_to_completion(engine)  # checks the block books after every step
    return [tokens_of(outputs[f"b{i}"]) for i in range(len(prompts))]


def run_alone(engine: Engine, prompts: list[list[int]], tag: str) -> list[list[int]]:
    results = []
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(p, GREEDY, f"{tag}{i}"))
        results.append(tokens_of(run_to_completion(engine)[f"{tag}{i}"]))
    return results


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("caching", [False, True], ids=["nocache", "cache"])
def test_each_prompt_alone(
    kind: str, caching: bool, checkpoints: dict[str, Path], oracle: Oracle
) -> None:
    prompts, expected = oracle[kind]
    engine = make_engine(checkpoints[kind], **BASE, enable_prefix_caching=caching)
    assert run_alone(engine, prompts, "first") == expected
    if caching:  # the second pass finds every prompt's full blocks cached
        assert run_alone(engine, prompts, "again") == expected
        stats = engine.stats()
        assert stats.prefix_cache_hits >= sum(len(p) // 16 * 16 - 16 for p in prompts)
    else:
        assert engine.stats().prefix_cache_hits == 0


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("caching", [False, True], ids=["nocache", "cache"])
def test_all_batched(
    kind: str, caching: bool, checkpoints: dict[str, Path], oracle: Oracle
) -> None:
    prompts, expected = oracle[kind]
    engine = make_engine(checkpoints[kind], **BASE, enable_prefix_caching=caching)
    assert run_batched(engine, prompts) == expected
    assert engine.stats().num_preemptions == 0


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_chunked_prefill(kind: str, checkpoints: dict[str, Path], oracle: Oracle) -> None:
    prompts, expected = oracle[kind]
    engine = make_engine(checkpoints[kind], **BASE, max_num_batched_tokens=64)
    chunks = record_chunks(engine)
    assert run_batched(engine, prompts) == expected
    assert max(chunks.values()) >= 8  # the 600-token prompt (96 of them cached), <= 64 a step
    assert sum(n >= 3 for n in chunks.values()) >= 8


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("caching", [False, True], ids=["nocache", "cache"])
def test_preemption(kind: str, caching: bool, checkpoints: dict[str, Path], oracle: Oracle) -> None:
    prompts, expected = oracle[kind]
    config = {**BASE, "num_kv_blocks": TIGHT_BLOCKS, "max_model_len": 640}
    engine = make_engine(checkpoints[kind], **config, enable_prefix_caching=caching)
    assert run_batched(engine, prompts) == expected
    assert engine.stats().num_preemptions > 0


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_short_prompts_and_staggered_arrivals(kind: str, checkpoints: dict[str, Path]) -> None:
    """Requests join while others decode, so prefills and decodes share steps."""
    path = checkpoints[kind]
    engine = make_engine(path)
    prompts = oracle_prompts(engine.model_config.vocab_size)[:8]
    expected = hf_greedy(path, prompts)
    outputs: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(p, GREEDY, f"r{i}"))
        for _ in range(3):
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.token_ids)
    for rid, outs in run_to_completion(engine).items():
        outputs.setdefault(rid, []).extend(tokens_of(outs))
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == expected
