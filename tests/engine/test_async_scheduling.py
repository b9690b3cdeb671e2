"""Async scheduling (step N + 1 scheduled and launched before N is read back) changes
nothing a client sees: greedy and seeded outputs equal the synchronous engine's over the
oracle prompts (batched, chunked, preempting, with prefix hits) and over a mixed workload
of stops, max_tokens, min_tokens, penalties (synchronous fallback), logprobs, n > 1 and
cancellation mid-stream; the device block tables stay exact after every step."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from backend.engine.engine import Engine
from backend.outputs import RequestOutput
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from tests.engine.engine_support import check_blocks, make_engine, text_of, tokens_of
from tests.engine.test_block_tables import _check_tables
from tests.engine.test_engine_oracle import BASE, GREEDY, TIGHT_BLOCKS, oracle_prompts

Outputs = dict[str, list[RequestOutput]]


def _run(engine: Engine, abort_at: dict[str, int] | None = None) -> Outputs:
    """Steps until idle; `abort_at`: request id -> abort once it has streamed that many
    tokens. Checks block books and device tables after every step."""
    outputs: Outputs = {}
    aborted: set[str] = set()
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        for rid, count in (abort_at or {}).items():
            if rid not in aborted and len(tokens_of(outputs.get(rid, []))) >= count:
                engine.abort(rid)
                aborted.add(rid)
        check_blocks(engine)
        _check_tables(engine)
    return outputs


def _pair(path: Path, **config: Any) -> tuple[Engine, Engine]:
    sync = make_engine(path, **config, async_scheduling="off")
    overlapped = make_engine(path, **config, async_scheduling="on")
    assert not sync.async_scheduling and overlapped.async_scheduling
    return sync, overlapped


def _count_overlaps(engine: Engine) -> list[int]:
    """Counts launches given a step still in flight (a list, to read after the run)."""
    count = [0]
    launch = engine.runner.launch

    def spy(batch: Any, previous: Any = None) -> Any:
        count[0] += previous is not None
        return launch(batch, previous)

    engine.runner.launch = spy  # type: ignore[method-assign]
    return count


def test_auto_is_off_on_the_cpu(llama_dir: Path) -> None:
    assert not make_engine(llama_dir).async_scheduling
    with pytest.raises(ValueError, match="async_scheduling"):
        make_engine(llama_dir, async_scheduling="sometimes")


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"max_num_batched_tokens": 64},  # chunked prefill
        {"num_kv_blocks": TIGHT_BLOCKS, "max_model_len": 640},  # preemption
    ],
    ids=["batched", "chunked", "preempting"],
)
def test_oracle_prompts_equal_sync(llama_dir: Path, config: dict[str, Any]) -> None:
    sync, overlapped = _pair(llama_dir, **{**BASE, **config})
    overlaps = _count_overlaps(overlapped)
    prompts = oracle_prompts(sync.model_config.vocab_size)
    results = []
    for engine in (sync, overlapped):
        for i, p in enumerate(prompts):
            engine.add_request(EngineRequest(p, GREEDY, f"b{i}"))
        outputs = _run(engine)
        results.append([tokens_of(outputs[f"b{i}"]) for i in range(len(prompts))])
    assert results[0] == results[1]
    assert overlaps[0] > 10
    hits = overlapped.stats().prefix_cache_hits
    if "num_kv_blocks" in config:
        # A request finishing on the step in flight frees its blocks a step later than
        # a synchronous engine: a tight pool schedules a little differently.
        assert overlapped.stats().num_preemptions > 0 and hits > 0
    else:
        assert hits == sync.stats().prefix_cache_hits > 0


def _mixed(engine: Engine, vocab: int) -> None:
    rng = random.Random(11)
    shared = [rng.randrange(2, vocab) for _ in range(48)]
    stop_text = engine.tokenizer.decode([rng.randrange(40, vocab)])
    for i in range(24):
        own = [rng.randrange(2, vocab) for _ in range(rng.randrange(2, 70))]
        kind = i % 6
        # Penalised rows step synchronously: short, so the rest overlap for a while.
        most = rng.randrange(1, 6 if kind == 4 else 30)
        params = SamplingParams(
            max_tokens=most,
            temperature=0 if kind < 3 else 0.8,
            seed=None if kind < 3 else 100 + i,
            ignore_eos=kind == 0,
            stop=[stop_text] if kind == 1 else [],
            stop_token_ids=[rng.randrange(2, vocab) for _ in range(20)] if kind == 2 else [],
            min_tokens=min(3, most) if kind == 3 else 0,
            repetition_penalty=1.3 if kind == 4 else 1.0,  # synchronous steps
            logprobs=2 if kind == 5 else None,
            n=2 if i == 5 else 1,
        )
        prompt = shared + own if i % 2 else own
        engine.add_request(EngineRequest(prompt, params, f"m{i}"))
    # Ends at max_model_len (256): no step may run past it.
    edge = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine.add_request(EngineRequest([rng.randrange(2, vocab) for _ in range(250)], edge, "edge"))


def _summary(outputs: Outputs) -> dict[str, Any]:
    summary = {}
    for rid, outs in outputs.items():
        for index in sorted({o.index for o in outs}):
            mine = [o for o in outs if o.index == index]
            lps = [(lp.token_id, round(lp.logprob, 4)) for o in mine for lp in o.logprobs or []]
            summary[f"{rid}/{index}"] = (
                tokens_of(mine),
                text_of(mine),
                mine[-1].finish_reason,
                mine[-1].completion_tokens,
                lps,
            )
    return summary


@pytest.mark.parametrize("blocks", [512, 24], ids=["roomy", "tight"])
def test_mixed_workload_equals_sync(llama_dir: Path, blocks: int) -> None:
    config = {"block_size": 16, "num_kv_blocks": blocks, "max_model_len": 256}
    sync, overlapped = _pair(llama_dir, **config)
    overlaps = _count_overlaps(overlapped)
    vocab = sync.model_config.vocab_size
    summaries = []
    for engine in (sync, overlapped):
        _mixed(engine, vocab)
        summaries.append(_summary(_run(engine)))
    assert summaries[0] == summaries[1]
    reasons = {s[2] for s in summaries[0].values()}
    assert {"stop", "length"} <= reasons
    assert overlaps[0] > 5
    if blocks == 24:
        assert overlapped.stats().num_preemptions > 0
    for engine in (sync, overlapped):  # everything freed
        assert engine.block_manager.num_used_blocks == 0


def test_cancellation_mid_stream(llama_dir: Path) -> None:
    """An abort lands between steps: the stream ends with "abort", its tokens are a
    prefix of the uncancelled run's, and the others are untouched."""
    sync, overlapped = _pair(llama_dir, block_size=16, num_kv_blocks=512, max_model_len=256)
    vocab = sync.model_config.vocab_size
    rng = random.Random(5)
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randrange(3, 40))] for _ in range(8)]
    long = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    full = {}
    for engine, abort_at in ((sync, None), (overlapped, {"c1": 4, "c6": 9})):
        for i, p in enumerate(prompts):
            engine.add_request(EngineRequest(p, long, f"c{i}"))
        full[engine.async_scheduling] = _run(engine, abort_at)
    for rid, outs in full[True].items():
        tokens, reference = tokens_of(outs), tokens_of(full[False][rid])
        if rid in ("c1", "c6"):
            assert outs[-1].finish_reason == "abort"
            assert tokens == reference[: len(tokens)] and len(tokens) < 30
        else:
            assert tokens == reference and outs[-1].finish_reason == "length"
    assert overlapped.block_manager.num_used_blocks == 0


def test_a_failed_launch_fails_only_its_request(llama_dir: Path) -> None:
    """A bad seed arriving while steps overlap: its launch fails, the step in flight is
    read back, the others rerun synchronously from their real tokens and go on."""
    from tests.engine.test_engine_faults import unvalidated_seed

    sync, overlapped = _pair(llama_dir, block_size=16, num_kv_blocks=512, max_model_len=256)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    results = []
    for engine in (sync, overlapped):
        for i in range(3):
            engine.add_request(EngineRequest(f"good {i} quick brown fox", greedy, f"g{i}"))
        outputs: Outputs = {}
        for step in range(100):
            if step == 4:
                engine.add_request(EngineRequest("poison", unvalidated_seed(2**64), "p"))
            for out in engine.step():
                outputs.setdefault(out.request_id, []).append(out)
            check_blocks(engine)
            if not engine.has_work():
                break
        assert outputs["p"][-1].error == "request_failed"
        results.append({f"g{i}": tokens_of(outputs[f"g{i}"]) for i in range(3)})
    assert results[0] == results[1]
    assert all(len(tokens) == 12 for tokens in results[1].values())
