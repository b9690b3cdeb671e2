"""Engine behaviour on a tiny random Llama: sampling, stops, limits, aborts, batching."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.engine.engine import Engine
from backend.errors import PromptTooLongError
from backend.outputs import RequestOutput, coalesced
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from tests.engine.engine_support import (
    check_blocks,
    make_engine,
    run_to_completion,
    text_of,
    tokens_of,
)

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPT = "The quick brown fox"


def generate(
    engine: Engine, prompt: str | list[int], params: SamplingParams
) -> list[RequestOutput]:
    engine.add_request(EngineRequest(prompt, params, "solo"))
    return run_to_completion(engine)["solo"]


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_k=40, top_p=0.9, seed=1234)
    alone = tokens_of(generate(engine, PROMPT, seeded))

    engine.add_request(EngineRequest("Paged attention", GREEDY, "other-greedy"))
    engine.add_request(EngineRequest(PROMPT, seeded, "seeded"))
    engine.add_request(
        EngineRequest("héllo", SamplingParams(max_tokens=20, seed=7), "other-seeded")
    )
    engine.add_request(EngineRequest("def main", SamplingParams(max_tokens=20), "other-random"))
    batched = run_to_completion(engine)
    assert tokens_of(batched["seeded"]) == alone
    assert tokens_of(generate(engine, PROMPT, SamplingParams(max_tokens=16, seed=99))) != alone


def test_outputs_are_deltas_with_cumulative_counts(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    outs = generate(engine, PROMPT, GREEDY)
    assert [len(o.token_ids) for o in outs] == [1] * 24
    assert [o.completion_tokens for o in outs] == list(range(1, 25))
    assert [o.finished for o in outs] == [False] * 23 + [True]
    assert outs[-1].finish_reason == "length"
    assert outs[0].prompt_tokens == len(engine.tokenizer.encode(PROMPT))
    assert text_of(outs) == engine.tokenizer.decode(tokens_of(outs))
    first = outs[0]
    assert first.first_scheduled_time is not None and first.first_token_time is not None
    assert first.arrival_time <= first.first_scheduled_time <= first.first_token_time


def flat(outs: list[RequestOutput], field: str) -> list[object]:
    return [item for out in outs for item in getattr(out, field) or []]


def test_coalesced_deltas_read_as_the_deltas_one_by_one(llama_dir: Path) -> None:
    """What the asyncio front hands on for held batch outputs: each completion's deltas
    as one, with the same tokens, text, times, logprobs and final state."""
    engine = make_engine(llama_dir)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, n=2, logprobs=1)
    outs = generate(engine, PROMPT, params)
    merged = coalesced(outs)
    assert len(merged) < len(outs)
    for index in (0, 1):
        mine = [o for o in outs if o.index == index]
        one = [o for o in merged if o.index == index]
        assert tokens_of(one) == tokens_of(mine) and text_of(one) == text_of(mine)
        for field in ("token_times", "logprobs"):
            assert flat(one, field) == flat(mine, field)
        assert one[-1].finished and one[-1].completion_tokens == 6
        assert one[0].first_token_time == mine[0].first_token_time
    assert len(merged) == 2
    # A rejection ends the request: outputs with one are handed on as they are.
    failed = [*outs[:2], RequestOutput("x", "", [], True, "rejected", 0, 0, error="overloaded")]
    assert coalesced(failed) == failed


def test_stop_string_is_cut_from_the_text(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    full = text_of(generate(engine, PROMPT, GREEDY))
    stop = full[6:9]
    assert stop.strip(), f"degenerate greedy text {full!r}"
    outs = generate(engine, PROMPT, SamplingParams(max_tokens=24, temperature=0, stop=[stop]))
    assert text_of(outs) == full[: full.index(stop)]
    assert outs[-1].finish_reason == "stop"
    assert len(tokens_of(outs)) < 24


def test_stop_token_ends_the_request_without_its_text(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    tokens = tokens_of(generate(engine, PROMPT, GREEDY))
    stop_id = tokens[4]
    first = tokens.index(stop_id)
    params = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_id])
    outs = generate(engine, PROMPT, params)
    assert tokens_of(outs) == tokens[: first + 1]
    assert text_of(outs) == engine.tokenizer.decode(tokens[:first])
    assert outs[-1].finish_reason == "stop"


def test_eos_stops_unless_ignored(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    tokens = tokens_of(generate(engine, PROMPT, GREEDY))
    eos = tokens[3]  # pretend the model's EOS is a token it is about to produce
    engine.tokenizer.eos_token_ids = frozenset({eos})
    outs = generate(engine, PROMPT, SamplingParams(max_tokens=24, temperature=0))
    assert tokens_of(outs) == tokens[: tokens.index(eos) + 1]
    assert outs[-1].finish_reason == "stop"
    assert tokens_of(generate(engine, PROMPT, GREEDY)) == tokens  # ignore_eos=True


def test_length_is_capped_by_max_model_len(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, max_model_len=20, max_num_batched_tokens=64)
    prompt = list(range(2, 17))  # 15 tokens
    outs = generate(engine, prompt, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    assert len(tokens_of(outs)) == 5
    assert outs[-1].finish_reason == "length"


def test_invalid_requests_raise_in_the_caller(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, max_model_len=20, max_num_batched_tokens=64)
    with pytest.raises(PromptTooLongError) as err:
        engine.add_request(EngineRequest(list(range(2, 22)), GREEDY, "long"))
    assert err.value.prompt_tokens == 20 and err.value.max_model_len == 20
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(EngineRequest([], GREEDY, "empty"))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request(EngineRequest([10**6], GREEDY, "oov"))
    with pytest.raises(ValueError, match="NUL"):
        engine.add_request(EngineRequest(PROMPT, GREEDY, "a\0b"))
    engine.add_request(EngineRequest(PROMPT, GREEDY, "dup"))
    with pytest.raises(ValueError, match="already"):
        engine.add_request(EngineRequest(PROMPT, GREEDY, "dup"))
    run_to_completion(engine)
    engine.add_request(EngineRequest(PROMPT, GREEDY, "dup"))  # a finished id may be used again


def test_abort_frees_blocks_and_repeats_are_harmless(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    for i in range(3):
        engine.add_request(EngineRequest(PROMPT, GREEDY, f"r{i}"))
    engine.step()
    engine.step()
    used = engine.block_manager.num_used_blocks
    engine.abort("r1")
    engine.abort("r1")
    engine.abort("never-existed")
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "r1"]
    assert len(aborted) == 1 and aborted[0].finish_reason == "abort" and aborted[0].finished
    assert aborted[0].token_ids == [] and aborted[0].text == ""
    assert engine.block_manager.num_used_blocks < used
    check_blocks(engine)
    engine.abort("r1")  # already finished
    results = run_to_completion(engine)
    assert "r1" not in results and {"r0", "r2"} <= results.keys()
    engine.abort("r0")  # finished normally: a no-op, and not inherited by a reused id
    engine.add_request(EngineRequest(PROMPT, GREEDY, "r0"))
    again = run_to_completion(engine)["r0"]
    assert again[-1].finish_reason == "length" and len(tokens_of(again)) == 24
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not engine.has_work()


def test_abort_during_the_forward_pass_wins_over_its_tokens(llama_dir: Path) -> None:
    """The race of vLLM #29987: an abort that lands while the final step runs must end
    the request as "abort", not as a normal completion."""
    engine = make_engine(llama_dir)
    run = engine.runner.execute

    def run_then_abort(batch):  # type: ignore[no-untyped-def]
        result = run(batch)
        engine.abort("last")
        return result

    engine.runner.execute = run_then_abort  # type: ignore[method-assign]
    engine.add_request(EngineRequest(PROMPT, SamplingParams(max_tokens=1, temperature=0), "last"))
    outs = engine.step()
    assert [(o.request_id, o.finish_reason, o.token_ids) for o in outs] == [("last", "abort", [])]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_abort_of_a_request_still_in_the_inbox(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    engine.add_request(EngineRequest(PROMPT, GREEDY, "queued"))
    engine.abort("queued")
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("queued", "abort")]
    assert not engine.has_work()


def test_max_num_seqs_and_continuous_batching(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, max_num_seqs=2)
    for i in range(4):
        engine.add_request(
            EngineRequest(PROMPT, SamplingParams(max_tokens=3 + i, temperature=0), f"r{i}")
        )
    finished_at: dict[str, int] = {}
    step = 0
    while engine.has_work():
        outs = engine.step()
        step += 1
        assert engine.stats().num_running <= 2
        check_blocks(engine)
        finished_at.update({o.request_id: step for o in outs if o.finished})
    # r2 starts as soon as r0 leaves, not when the whole first batch is done.
    assert finished_at["r0"] < finished_at["r1"] < finished_at["r2"] < finished_at["r3"]
    assert finished_at["r2"] == finished_at["r0"] + 5
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0)
    assert stats.num_steps == step


def test_a_small_kv_pool_preempts_and_recomputes(llama_dir: Path) -> None:
    # 24 blocks of 4 tokens; each request grows to 5 + 40 tokens = 12 blocks.
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [[5 + i, 6, 7, 8, 9] for i in range(3)]
    roomy = make_engine(llama_dir)
    expected = []
    for p in prompts:
        expected.append(tokens_of(generate(roomy, p, params)))
    engine = make_engine(llama_dir, num_kv_blocks=24, max_model_len=96)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(p, params, f"r{i}"))
    results = run_to_completion(engine)  # checks the block books after every step
    assert [tokens_of(results[f"r{i}"]) for i in range(3)] == expected
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.kv_blocks_used == 0
