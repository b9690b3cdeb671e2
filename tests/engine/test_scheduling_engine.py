"""The scheduling policy in the real engine on a tiny CPU model, at small scale, observed
through engine stats and output timestamps: priority preemption within one step (without
changing what anyone generates), aging under a stream of urgent work, tenant fairness,
prefill protection, load shedding and deadlines."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from backend.engine.async_engine import AsyncEngine
from backend.engine.engine import Engine
from backend.engine.step_cost import StepCostModel
from backend.errors import DeadlineExceededError, OverloadedError
from backend.outputs import RequestOutput
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from backend.sim.scenarios import CPU_LIKE
from tests.conftest import eventually
from tests.engine.engine_support import check_blocks, make_engine, run_to_completion, tokens_of

LONG = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def step(engine: Engine) -> list[RequestOutput]:
    outputs = engine.step()
    check_blocks(engine)
    return outputs


def skewed_clock(engine: Engine) -> list[float]:
    """Let the test move the scheduler's clock forward (aging) without sleeping. The clock
    stands still otherwise: a slow step on a loaded machine must not age anything."""
    skew, start = [0.0], time.monotonic()
    engine.scheduler.clock = lambda: start + skew[0]
    return skew


def test_high_priority_starts_within_one_step_when_max_num_seqs_is_full(llama_dir: Path) -> None:
    alone = run_to_completion(_low_pair(make_engine(llama_dir, max_num_seqs=2)))
    engine = _low_pair(make_engine(llama_dir, max_num_seqs=2))
    earlier = [o for _ in range(3) for o in step(engine)]
    assert engine.stats().num_running == 2
    engine.add_request(EngineRequest([9, 8, 7, 6], SHORT, "urgent", priority=0))
    before = time.monotonic()
    during = step(engine)
    first = [o for o in during if o.request_id == "urgent"]
    assert first and first[0].token_ids  # its first token came out of that very step
    assert first[0].first_scheduled_time is not None and first[0].first_scheduled_time >= before
    stats = engine.stats()
    assert stats.num_priority_preemptions == 1 and stats.num_running == 2
    rest = run_to_completion(engine)
    # The preempted request resumed and generated exactly what it generates alone.
    for rid in ("low-a", "low-b"):
        streamed = [o for o in earlier + during if o.request_id == rid]
        assert tokens_of(streamed) + tokens_of(rest[rid]) == tokens_of(alone[rid])


def _low_pair(engine: Engine) -> Engine:
    engine.add_request(EngineRequest([5, 6, 7, 8, 9], LONG, "low-a", priority=5))
    engine.add_request(EngineRequest([15, 16, 17], LONG, "low-b", priority=5))
    return engine


def test_aging_lets_low_priority_start_under_a_stream_of_urgent_work(llama_dir: Path) -> None:
    # Each urgent request is served in the step it arrives, so one always waits. After
    # 5 classes x 0.5 s = 25 steps of 0.1 s "low" is in class 0 too and, without the
    # express lane, wins the tie by its earlier arrival. With it, a fresh short class-0
    # prompt still jumps ahead (the lane overtakes its own class); after (5 + 1) x 0.5 s
    # = 30 steps "low" is in class -1, ahead of every newcomer (SCHEDULING.md's bound).
    for aging, adaptive, expected in (
        (0.5, False, (23, 26)),
        (0.5, True, (28, 31)),
        (None, True, None),
    ):
        engine = make_engine(
            llama_dir, max_num_seqs=1, aging_interval_s=aging, adaptive_step_budget=adaptive
        )
        skew = skewed_clock(engine)
        engine.add_request(EngineRequest([3, 4, 5], SHORT, "low", priority=5))
        started_at_step = None
        for i in range(60):
            engine.add_request(EngineRequest([7, 8, i % 50 + 2], ONE, f"urgent{i}", priority=0))
            skew[0] += 0.1  # a tenth of a second passes per step
            if any(o.request_id == "low" and o.token_ids for o in step(engine)):
                started_at_step = i
                break
        if expected is None:
            assert started_at_step is None  # starved while urgent work keeps coming
        else:
            assert started_at_step is not None
            assert expected[0] <= started_at_step <= expected[1], (adaptive, started_at_step)


def test_tenants_take_turns_whatever_their_queue_lengths(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, max_num_seqs=1)
    for i in range(6):
        engine.add_request(EngineRequest([2 + i, 3, 4], SHORT, f"loud{i}", tenant="loud"))
    for i in range(2):
        engine.add_request(EngineRequest([20 + i, 3, 4], SHORT, f"quiet{i}", tenant="quiet"))
    results = run_to_completion(engine)
    order = sorted(results, key=lambda rid: results[rid][0].first_scheduled_time or 0.0)
    assert order[:5] == ["loud0", "quiet0", "loud1", "quiet1", "loud2"]


def test_prefill_protection_lets_a_chat_start_through_a_document_burst(llama_dir: Path) -> None:
    """Four 90-token documents fill 64-token steps; a chat that arrives behind them gets
    its first token in the next step with protection, only after the burst without it."""
    steps = {}
    for protected in (True, False):
        off: dict[str, object] = {
            "prefill_reserve_share": 0.0,
            "long_prefill_token_threshold": 0,
            "adaptive_step_budget": False,  # nor the express lane
        }
        off = {} if protected else off
        engine = make_engine(llama_dir, max_num_batched_tokens=64, **off)
        for i in range(4):
            engine.add_request(EngineRequest([2 + i, *range(3, 92)], SHORT, f"doc{i}"))
        step(engine)
        engine.add_request(EngineRequest([5, 6, 7, 8], SHORT, "chat"))
        steps[protected] = next(
            n
            for n in range(1, 30)
            if any(o.request_id == "chat" and o.token_ids for o in step(engine))
        )
    assert steps[True] == 1
    assert steps[False] >= 4  # behind the rest of 360 prompt tokens


def test_num_interactive_counts_requests_below_the_batch_class(llama_dir: Path) -> None:
    """What a batch runner waits on: interactive requests submitted, waiting or running."""
    engine = make_engine(llama_dir, max_num_seqs=1)
    engine.add_request(EngineRequest([5, 6, 7], LONG, "batch", priority=5))
    engine.add_request(EngineRequest([2, 3, 4], SHORT, "chat", priority=0))
    assert engine.stats().num_interactive == 1  # submitted, not yet scheduled
    step(engine)  # one slot: the chat runs, the batch line waits
    engine.add_request(EngineRequest([8, 9, 10], SHORT, "chat-2", priority=1))
    step(engine)
    assert engine.num_interactive() == engine.stats().num_interactive == 2
    assert engine.stats().num_running + engine.stats().num_waiting == 3
    for _ in range(20):  # the chats' few tokens
        if not engine.num_interactive():
            break
        step(engine)
    assert engine.num_interactive() == 0
    assert "batch" in engine.scheduler.requests  # the batch line alone is left


def test_a_full_queue_sheds_new_requests(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, max_num_seqs=1, max_waiting_requests=1)
    engine.add_request(EngineRequest([2, 3, 4], LONG, "running"))
    step(engine)
    engine.add_request(EngineRequest([5, 6, 7], LONG, "waiting"))
    with pytest.raises(OverloadedError) as caught:
        engine.add_request(EngineRequest([8, 9, 10], LONG, "shed"))
    assert caught.value.retry_after_s >= 1
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_rejected_overloaded) == (1, 1, 1)
    assert set(run_to_completion(engine)) == {"running", "waiting"}  # nothing lost


def test_a_full_queue_sheds_its_least_urgent_for_a_more_urgent_request(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, max_num_seqs=1, max_waiting_requests=1)
    engine.add_request(EngineRequest([2, 3, 4], LONG, "running"))
    step(engine)
    engine.add_request(EngineRequest([5, 6, 7], LONG, "batch", priority=5))
    step(engine)  # queued: the admission snapshot sees it from this step on
    with pytest.raises(OverloadedError):
        engine.add_request(EngineRequest([8, 9, 10], LONG, "batch-2", priority=5))
    engine.add_request(EngineRequest([8, 9, 10], LONG, "urgent", priority=0))
    [shed] = [o for o in step(engine) if o.request_id == "batch"]
    assert (shed.finished, shed.finish_reason, shed.error, shed.token_ids) == (
        True,
        "rejected",
        "overloaded",
        [],
    )
    assert shed.retry_after_s is not None and shed.retry_after_s >= 1
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_rejected_overloaded) == (1, 1, 2)
    assert set(run_to_completion(engine)) == {"running", "urgent"}


def test_deadlines_reject_before_compute(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, max_num_seqs=1)
    with pytest.raises(DeadlineExceededError):
        engine.add_request(EngineRequest([2, 3], SHORT, "late", deadline=time.monotonic() - 1))
    engine.add_request(EngineRequest([2, 3, 4], LONG, "running"))
    step(engine)
    skew = skewed_clock(engine)
    engine.add_request(EngineRequest([5, 6, 7], SHORT, "queued", deadline=time.monotonic() + 5))
    skew[0] = 10.0  # its deadline passes while it waits
    [rejected] = [o for o in step(engine) if o.request_id == "queued"]
    assert (rejected.finished, rejected.finish_reason, rejected.error) == (
        True,
        "rejected",
        "deadline_exceeded",
    )
    assert rejected.token_ids == [] and rejected.first_scheduled_time is None
    assert engine.stats().num_rejected_deadline == 2


async def test_the_async_engine_raises_the_typed_errors(llama_dir: Path) -> None:
    engine = AsyncEngine(make_engine(llama_dir, max_num_seqs=1))
    try:
        with pytest.raises(DeadlineExceededError):
            async for _ in engine.generate(
                EngineRequest([2, 3], SHORT, "late", deadline=time.monotonic() - 1)
            ):
                pass
        outs = [o async for o in engine.generate(EngineRequest([2, 3], SHORT, "fine"))]
        assert outs[-1].finished and outs[-1].error is None
    finally:
        await engine.shutdown()


async def test_the_async_engine_raises_overloaded_for_a_displaced_request(
    llama_dir: Path,
) -> None:
    # A long context, so the busy request outlasts the test even on a fast machine.
    small = make_engine(
        llama_dir, max_num_seqs=1, max_waiting_requests=1, max_model_len=1024, num_kv_blocks=300
    )
    engine = AsyncEngine(small)
    busy = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
    running = engine.generate(EngineRequest([2, 3, 4], busy, "running"))
    try:
        await anext(running)
        displaced = asyncio.create_task(
            _collect(engine.generate(EngineRequest([5, 6], SHORT, "batch", priority=5)))
        )
        await eventually(lambda: engine.stats().waiting_tokens > 0)  # in the queue
        urgent = asyncio.create_task(
            _collect(engine.generate(EngineRequest([7, 8], SHORT, "urgent")))
        )
        with pytest.raises(OverloadedError) as caught:
            await displaced
        assert caught.value.retry_after_s >= 1
        await running.aclose()  # frees the slot: the urgent one runs to its end
        assert (await urgent)[-1].finish_reason == "length"
    finally:
        await running.aclose()
        await engine.shutdown()


async def _collect(outputs: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [o async for o in outputs]


# -- step cost and latency targets -----------------------------------------------------


def test_warm_up_fits_the_step_cost_and_leaves_no_trace(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    cost = engine.scheduler.step_cost
    assert cost.ready  # before any request: never blind
    stats = engine.stats()
    assert (stats.num_steps, stats.total_prefill_tokens, stats.kv_blocks_used) == (0, 0, 0)
    assert stats.kv_blocks_cached == 0 and not engine.has_work()
    assert stats.step_cost_s["prefill_token"] > 0 or stats.step_cost_s["prefill_pair"] > 0
    engine.add_request(EngineRequest(list(range(2, 60)), LONG, "a"))
    engine.add_request(EngineRequest([5, 6, 7], LONG, "b"))
    run_to_completion(engine)
    stats = engine.stats()
    assert stats.step_time_actual_s > 0 and stats.step_time_predicted_s > 0
    assert cost.num_observations > stats.num_steps  # warm-up plus every real step


def test_the_metrics_show_predicted_and_actual_step_times(llama_dir: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from backend.telemetry import EngineStatsCollector

    engine = make_engine(llama_dir)
    engine.add_request(EngineRequest([2, 3, 4, 5], SHORT, "a"))
    run_to_completion(engine)
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(engine.stats))
    text = generate_latest(registry).decode()
    stats = engine.stats()
    for name, value in (
        ("tollgate_engine_step_time_predicted_seconds", stats.step_time_predicted_s),
        ("tollgate_engine_step_time_actual_seconds", stats.step_time_actual_s),
    ):
        assert f"{name} {value!r}" in text or f"{name} {float(value)}" in text
    assert 'tollgate_engine_step_cost_seconds{term="prefill_token"}' in text
    assert "tollgate_engine_step_prefill_budget_tokens" in text
    assert f"tollgate_engine_batch_busy_seconds {stats.batch_busy_s!r}" in text


def test_batch_busy_time_is_each_steps_time_split_by_its_rows_tokens(llama_dir: Path) -> None:
    """The batch class's part of the engine's busy time (the console's batch share of
    engine time): none for interactive work, all of it for batch work alone, and for a
    step of both, its time split by the rows' tokens."""
    engine = make_engine(llama_dir)
    engine.add_request(EngineRequest([2, 3, 4, 5], SHORT, "chat", priority=0))
    run_to_completion(engine)
    assert engine.busy_s > 0 and engine.batch_busy_s == 0

    busy, floor = engine.busy_s, engine.config.batch_priority
    engine.add_request(EngineRequest([2, 3, 4, 5], SHORT, "line", priority=floor + 3))
    run_to_completion(engine)
    assert engine.batch_busy_s == pytest.approx(engine.busy_s - busy)

    engine.add_request(EngineRequest([20, 21, 22, 23, 24, 25], SHORT, "chat-2", priority=0))
    engine.add_request(EngineRequest([30, 31], SHORT, "line-2", priority=floor))
    shares = []
    for expected_tokens in ((6, 0), (2, 1), (0, 2)):  # the chat's prefill protected, then:
        busy, batch_busy = engine.busy_s, engine.batch_busy_s  # the line's beside its decode
        step(engine)
        stats = engine.stats()
        assert (stats.step_prefill_tokens, stats.step_decode_tokens) == expected_tokens
        shares.append((engine.batch_busy_s - batch_busy) / (engine.busy_s - busy))
    assert shares == pytest.approx([0, 2 / 3, 1 / 2])
    stats = engine.stats()
    assert (stats.busy_s, stats.batch_busy_s) == (engine.busy_s, engine.batch_busy_s)


def test_interactive_decodes_shrink_the_step_and_batch_work_gets_it_all(llama_dir: Path) -> None:
    """A long interactive prompt beside a decoding chat gets a step sized to the chat's
    inter-token target (a tiny target here: the floor, 16 tokens or half the step); a
    batch-class prompt there gets only what keeps the step within filler_slowdown of the
    chat's alone; the same prompt beside a batch-class stream gets the whole static
    budget. The step is sized on a known cost (the fit of a machine busy with other work
    can say anything)."""
    budgets = {}
    for chat_priority, doc_priority in ((0, 4), (0, 5), (5, 5)):
        engine = make_engine(
            llama_dir,
            interactive_itl_target_ms=0.001,
            interactive_ttft_target_ms=None,
            min_prefill_tokens_per_step=16,
            max_model_len=400,
            num_kv_blocks=256,
        )
        engine.add_request(EngineRequest([5, 6, 7], LONG, "chat", priority=chat_priority))
        step(engine)  # the chat's prefill; it decodes from now on
        doc = EngineRequest(list(range(2, 300)), SHORT, "doc", priority=doc_priority)
        engine.add_request(doc)
        engine.scheduler.step_cost = StepCostModel.fixed(CPU_LIKE)
        step(engine)
        stats = engine.stats()
        budgets[chat_priority, doc_priority] = (stats.step_prefill_tokens, stats.step_time_limit_s)
        run_to_completion(engine)
    # The floor: 16 tokens, or as many as the step's fixed part (overhead and the chat's
    # decode row) takes at the per-token cost: (15 + 1) / 1.1 ms, 14 tokens, on this cost.
    assert budgets[0, 4] == (16, 0.001 / 1000)
    # The chat's step alone, 16 ms, x 1.3 = 20.8 ms: 4 tokens at 1.1 ms.
    assert budgets[0, 5][0] == 4
    assert budgets[5, 5] == (255, None)  # 256 less the chat's decode


def test_a_step_gives_way_to_another_tenants_newcomer_without_changing_tokens(
    llama_dir: Path,
) -> None:
    """A request of a tenant below its share arrives while a step of another tenant's
    rows runs (here: added by a hook inside the first layer): the step is abandoned
    before its second, the newcomer's prompt runs in the next step, and what everyone
    generates is what they generate without it."""
    engine = make_engine(llama_dir, max_num_seqs=6)
    for i in range(5):
        engine.add_request(EngineRequest([2 + i, 3, 4], LONG, f"b{i}", tenant="B"))
    for _ in range(3):
        step(engine)
    arrive = [EngineRequest([30, 3, 4], SHORT, "c", tenant="C")]

    def arrival(*_: object) -> None:
        if arrive:
            engine.add_request(arrive.pop())

    layers = engine.runner.model.model.layers
    assert len(layers) > 1
    hook = layers[0].register_forward_pre_hook(arrival)
    try:
        assert step(engine) == []  # given way: no token for anyone
    finally:
        hook.remove()
    assert engine.stats().num_steps_given_way == 1
    step(engine)
    assert engine.scheduler.requests["c"].first_scheduled_time is not None
    results = run_to_completion(engine)

    alone = make_engine(llama_dir, max_num_seqs=6)
    for i in range(5):
        alone.add_request(EngineRequest([2 + i, 3, 4], LONG, f"b{i}", tenant="B"))
    reference = run_to_completion(alone)
    for i in range(5):
        before = len(tokens_of(reference[f"b{i}"])) - len(tokens_of(results[f"b{i}"]))
        assert tokens_of(results[f"b{i}"]) == tokens_of(reference[f"b{i}"])[before:]
    assert len(tokens_of(results["c"])) == SHORT.max_tokens - 1  # its first came a step before
