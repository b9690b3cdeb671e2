"""Async scheduling (step N + 1 scheduled and launched before N is read back) changes
nothing a client sees: greedy and seeded outputs equal the synchronous engine's over the
oracle prompts (batched, chunked, preempting, with prefix hits) and over a mixed workload
of stops, max_tokens, min_tokens, penalties, grammars, logprobs, n > 1 and cancellation
mid-stream; the device block tables stay exact after every step. Grammar and penalised
rows keep the overlap (their step in flight is read back inside the next launch, after
its forward pass); speculative decoding composes with it (steps with drafts run in
turn, the others overlap)."""

from __future__ import annotations

import random
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from backend.constraint import Constraint
from backend.engine import speculative
from backend.engine.batch import PLACEHOLDER
from backend.engine.engine import Engine
from backend.outputs import RequestOutput
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from tests.engine.engine_support import check_blocks, make_engine, text_of, tokens_of
from tests.engine.test_block_tables import _check_tables
from tests.engine.test_engine_oracle import BASE, GREEDY, TIGHT_BLOCKS, oracle_prompts

Outputs = dict[str, list[RequestOutput]]
DIGITS = Constraint("regex", "[0-9]{1,40}")


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


def _count_overlaps(engine: Engine, launches: list[Any] | None = None) -> list[int]:
    """Counts launches given a step still in flight (a list, to read after the run);
    `launches` gets (batch, previous is not None, land is not None) of each."""
    count = [0]
    launch = engine.runner.launch

    def spy(batch: Any, previous: Any = None, land: Any = None) -> Any:
        count[0] += previous is not None
        if launches is not None:
            launches.append((batch, previous is not None, land is not None))
        return launch(batch, previous, land)

    engine.runner.launch = spy  # type: ignore[method-assign,assignment]
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
        kind = i % 7
        most = rng.randrange(1, 30)
        params = SamplingParams(
            max_tokens=most,
            temperature=0 if kind < 3 else 0.8,
            seed=None if kind < 3 else 100 + i,
            ignore_eos=kind == 0,
            stop=[stop_text] if kind == 1 else [],
            stop_token_ids=[rng.randrange(2, vocab) for _ in range(20)] if kind == 2 else [],
            min_tokens=min(3, most) if kind == 3 else 0,
            repetition_penalty=1.3 if kind == 4 else 1.0,
            frequency_penalty=0.5 if kind == 4 and i % 2 else 0.0,
            logprobs=2 if kind == 5 else None,
            n=2 if i == 5 else 1,
            constraint=DIGITS if kind == 6 else None,
        )
        prompt = shared + own if i % 2 else own
        engine.add_request(EngineRequest(prompt, params, f"m{i}"))
    # Ends at max_model_len (256): no step may run past it.
    edge = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine.add_request(EngineRequest([rng.randrange(2, vocab) for _ in range(250)], edge, "edge"))


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Equal summaries, logprobs to 1e-3: the two engines' steps may batch rows
    differently, and float32 sums of another batch shape round differently (a logprob
    of -4.5933 against -4.5934 on one machine; the tokens are equal)."""
    assert a.keys() == b.keys()
    for key in a:
        *exact_a, lps_a = a[key]
        *exact_b, lps_b = b[key]
        assert exact_a == exact_b, key
        assert [t for t, _ in lps_a] == [t for t, _ in lps_b], key
        assert [lp for _, lp in lps_a] == pytest.approx([lp for _, lp in lps_b], abs=1e-3), key


def _summary(outputs: Outputs) -> dict[str, Any]:
    summary = {}
    for rid, outs in outputs.items():
        for index in sorted({o.index for o in outs}):
            mine = [o for o in outs if o.index == index]
            lps = [(lp.token_id, lp.logprob) for o in mine for lp in o.logprobs or []]
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
    _assert_same(*summaries)
    reasons = {s[2] for s in summaries[0].values()}
    assert {"stop", "length"} <= reasons
    grammar_rows = [f"m{i}/0" for i in range(24) if i % 7 == 6]
    digits = [summaries[0][key][1] for key in grammar_rows]
    assert digits and all(re.fullmatch("[0-9]*", text) for text in digits)
    assert overlaps[0] > 20
    if blocks == 24:
        assert overlapped.stats().num_preemptions > 0
    for engine in (sync, overlapped):  # everything freed
        assert engine.block_manager.num_used_blocks == 0


def test_cancellation_mid_stream(llama_dir: Path) -> None:
    """An abort lands between steps: the stream ends with "abort", its tokens are a
    prefix of the uncancelled run's, and the others are untouched. c1 is penalised and
    c3 constrained (their steps read the one in flight back inside the launch)."""
    sync, overlapped = _pair(llama_dir, block_size=16, num_kv_blocks=512, max_model_len=256)
    vocab = sync.model_config.vocab_size
    rng = random.Random(5)
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randrange(3, 40))] for _ in range(8)]
    long = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    params = {
        "c1": replace(long, repetition_penalty=1.4),
        "c3": SamplingParams(max_tokens=30, temperature=0, constraint=DIGITS),
    }
    full = {}
    for engine, abort_at in ((sync, None), (overlapped, {"c1": 4, "c6": 9})):
        for i, p in enumerate(prompts):
            engine.add_request(EngineRequest(p, params.get(f"c{i}", long), f"c{i}"))
        full[engine.async_scheduling] = _run(engine, abort_at)
    for rid, outs in full[True].items():
        tokens, reference = tokens_of(outs), tokens_of(full[False][rid])
        if rid in ("c1", "c6"):
            assert outs[-1].finish_reason == "abort"
            assert tokens == reference[: len(tokens)] and len(tokens) < 30
        else:
            assert tokens == reference
            assert outs[-1].finish_reason == full[False][rid][-1].finish_reason
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


def test_a_grammar_row_keeps_the_overlap_for_the_whole_batch(llama_dir: Path) -> None:
    """Greedy rows beside one grammar row and one penalised row: every decode step is
    launched while the one before is still in flight, the constrained and penalised
    rows included (their tokens are read back inside the launch, before their masks and
    penalties are staged), and the tokens equal the synchronous engine's."""
    sync, overlapped = _pair(llama_dir, block_size=16, num_kv_blocks=512, max_model_len=256)
    launches: list[Any] = []
    _count_overlaps(overlapped, launches)
    inputs = _spy_inputs(overlapped.runner.model)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    special = {
        "grammar": SamplingParams(max_tokens=16, temperature=0, constraint=DIGITS),
        "penalty": SamplingParams(max_tokens=16, temperature=0, repetition_penalty=1.5),
    }
    results = []
    for engine in (sync, overlapped):
        for i in range(4):
            engine.add_request(EngineRequest(f"plain {i} fox", greedy, f"g{i}"))
        for name, params in special.items():
            engine.add_request(EngineRequest(f"{name} row", params, name))
        results.append(_summary(_run(engine)))
    _assert_same(*results)
    assert re.fullmatch("[0-9]+", results[1]["grammar/0"][1])
    decode_steps = [
        (previous, land)
        for batch, previous, land in launches
        if all(len(r.token_ids) == 1 for r in batch.requests)
        and {"grammar", "penalty"} <= {r.request_id for r in batch.requests}
    ]
    assert len(decode_steps) >= 10
    # In flight behind the step before, read back inside the launch: no step waited.
    assert all(previous and land for previous, land in decode_steps)
    placeholders = [
        r
        for batch, _, _ in launches
        for r in batch.requests
        if r.request_id == "grammar" and r.token_ids[-1] == PLACEHOLDER
    ]
    assert len(placeholders) >= 10  # its input came from the device, not the host
    assert PLACEHOLDER not in inputs  # and was in place before the forward pass


def _ngram_reference(
    engine: Engine, prompts: list[list[int]], params: SamplingParams = GREEDY
) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(prompt, params, str(i)))
    return {rid: tokens_of(outs) for rid, outs in _run(engine).items()}


@pytest.mark.parametrize("drafts", ["accepted", "some_rejected", "none"])
def test_speculation_composes_with_async_scheduling(
    llama_dir: Path, drafts: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """N-gram speculation under async scheduling: the greedy tokens of the engine
    without either. Steps with drafts run in turn (none of them launched beside a step
    in flight); when no row drafts, steps overlap."""
    from tests.engine.test_speculative import echo_proposer

    config = {"block_size": 16, "num_kv_blocks": 512, "max_model_len": 1024}
    prompts = oracle_prompts(320)[:8]
    expected = _ngram_reference(make_engine(llama_dir, **config), prompts)
    if drafts == "none":
        monkeypatch.setattr(speculative, "ngram_drafts", lambda *_: [])
    else:
        wrong_every = 3 if drafts == "some_rejected" else 0
        monkeypatch.setattr(speculative, "ngram_drafts", echo_proposer(expected, wrong_every))
    engine = make_engine(llama_dir, **config, speculative_method="ngram", async_scheduling="on")
    engine.scheduler.weigh_drafts = False  # every draft proposed runs
    assert engine.async_scheduling and "async_scheduling=on" in engine.describe()
    launches: list[Any] = []
    overlaps = _count_overlaps(engine, launches)
    assert _ngram_reference(engine, prompts) == expected
    stats = engine.stats()
    assert not any(previous for batch, previous, _ in launches if _has_drafts(batch))
    if drafts == "none":  # as many overlaps as without speculation
        plain = make_engine(llama_dir, **config, async_scheduling="on")
        plain_overlaps = _count_overlaps(plain)
        _ngram_reference(plain, prompts)
        assert stats.spec_decode_num_drafts == 0
        assert overlaps[0] == plain_overlaps[0] > 5
    else:
        assert stats.spec_decode_num_accepted_tokens > 0
        assert engine.num_steps < len(prompts) * GREEDY.max_tokens


def _has_drafts(batch: Any) -> bool:
    return any(r.num_drafts for r in batch.requests)


def test_draft_model_composes_with_async_scheduling(llama_dir: Path, tmp_path: Path) -> None:
    """A draft model whose drafts are rarely accepted (unrelated weights): drafting
    pauses, the steps between overlap (the draft runs none of their rows), and a probe
    catches the draft up on their tokens once they are read back. The tokens equal the
    engine's without either."""
    from tests.engine.engine_support import build_checkpoint

    draft = build_checkpoint(tmp_path / "draft", "llama", num_hidden_layers=1, hidden_size=32)
    config = {"block_size": 16, "num_kv_blocks": 512, "max_model_len": 1024}
    prompts = oracle_prompts(320)[:6]
    # Long enough for drafting to pause (7 rejected verifications) and the steps to overlap.
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = _ngram_reference(make_engine(llama_dir, **config), prompts, params)
    engine = make_engine(
        llama_dir,
        **config,
        speculative_method="draft",
        speculative_model=str(draft),
        async_scheduling="on",
    )
    engine.scheduler.weigh_drafts = False
    overlaps = _count_overlaps(engine)
    assert engine.runner.drafter is not None
    draft_inputs = _spy_inputs(engine.runner.drafter.model)
    assert _ngram_reference(engine, prompts, params) == expected
    assert engine.stats().spec_decode_num_drafts > 0
    assert overlaps[0] > 10
    # It catches up on the overlapped steps' tokens as read back: none is a PLACEHOLDER.
    assert len(draft_inputs) > 20 and PLACEHOLDER not in draft_inputs


def _spy_inputs(model: Any) -> set[int]:
    """The input ids `model` is called with, collected (a set, to read after the run)."""
    seen: set[int] = set()
    forward = model.forward

    def spy(input_ids: Any, *args: Any) -> Any:
        seen.update(input_ids.tolist())
        return forward(input_ids, *args)

    model.forward = spy
    return seen
