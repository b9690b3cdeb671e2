"""The scheduling policy without a model: ranking with aging, deadlines, tenant fair
share, priority preemption, prefill protection, load shedding and deadline rejection,
with the scheduler on a hand-driven clock."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from backend.config import EngineConfig
from backend.engine.batch import ModelRunnerOutput, SchedulerOutput
from backend.engine.block_manager import BlockManager
from backend.engine.policy import FairShare, Ranking
from backend.engine.request import Request, RequestStatus, fan_out
from backend.engine.scheduler import Scheduler
from backend.engine.step_cost import StepShape
from backend.errors import DeadlineExceededError, OverloadedError
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from tests.unit.backend.accounting import check_accounting


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def make(clock: Clock, num_blocks: int = 256, **knobs: object) -> Scheduler:
    knobs = {"max_num_seqs": 64, **knobs}  # the library default these were written for
    cfg = EngineConfig(block_size=4, num_kv_blocks=num_blocks, **knobs)  # type: ignore[arg-type]
    blocks = BlockManager(num_blocks, 4, enable_caching=cfg.enable_prefix_caching)
    return Scheduler(cfg, blocks, clock=clock)


_ids = iter(range(10**9))


def request(
    rid: str,
    prompt_len: int = 4,
    *,
    at: float = 0.0,
    priority: int = 0,
    tenant: str | None = None,
    weight: int = 1,
    deadline: float | None = None,
    max_tokens: int = 64,
) -> Request:
    first = next(_ids) * 1000  # distinct prompts: no prefix-cache hits between requests
    prompt = list(range(first, first + prompt_len))
    params = SamplingParams(max_tokens=max_tokens)
    asked = EngineRequest(
        prompt, params, rid, priority=priority, tenant=tenant, weight=weight, deadline=deadline
    )
    (req,) = fan_out(asked, prompt, prompt_len + max_tokens, arrival_time=at)
    return req


def advance(s: Scheduler, out: SchedulerOutput) -> None:
    sampled = {r.request_id: 7 for r in out.requests if r.sample}
    s.update_from_output(out, ModelRunnerOutput(sampled))
    check_accounting(s.block_manager, (r.request_id for r in s.running))


def ids(out: SchedulerOutput) -> list[str]:
    return [r.request_id for r in out.requests]


# -- ranking -------------------------------------------------------------------------


def test_a_waiting_request_rises_one_class_per_interval() -> None:
    ranking = Ranking(aging_interval_s=2.0)
    req = request("a", priority=5, at=10.0)
    assert [ranking.effective(req, 10.0 + t) for t in (0, 1.9, 2.0, 4.0, 9.9, 10.0)] == [
        5,
        5,
        4,
        3,
        1,
        0,
    ]
    assert Ranking(None).effective(req, 1000.0) == 5  # aging off


def test_the_static_key_sorts_like_the_effective_priority_at_any_time() -> None:
    ranking = Ranking(aging_interval_s=1.5)
    reqs = [request(f"r{i}", priority=i % 6, at=i * 0.37) for i in range(40)]
    ordered = sorted(reqs, key=ranking.key)
    for now in (15.0, 17.3, 40.0, 100.0):
        classes = [ranking.effective(r, now) for r in ordered]
        assert classes == sorted(classes)


def test_aging_lets_low_priority_overtake_fresh_urgent_work() -> None:
    for aging, expected in ((1.0, "low"), (None, "fresh")):
        clock = Clock()
        s = make(clock, max_num_seqs=1, aging_interval_s=aging)
        s.add_request(request("busy", max_tokens=1000))
        advance(s, s.schedule())
        s.add_request(request("low", priority=3, at=0.0))
        clock.now = 3.5  # low has aged three classes: class 0, and it arrived first
        s.add_request(request("fresh", priority=0, at=3.5))
        s.finish_requests(["busy"], RequestStatus.FINISHED_STOPPED)
        assert ids(s.schedule()) == [expected], aging


def test_ties_go_to_the_earliest_deadline_then_the_earliest_arrival() -> None:
    clock = Clock(now=1.0)
    s = make(clock, max_num_seqs=1)
    s.add_request(request("busy", max_tokens=1000))
    advance(s, s.schedule())
    s.add_request(request("early", at=0.1))
    s.add_request(request("later-deadline", at=0.2, deadline=60.0))
    s.add_request(request("soonest-deadline", at=0.3, deadline=30.0))
    order = []
    for _ in range(3):
        s.finish_requests([s.running[0].request_id], RequestStatus.FINISHED_STOPPED)
        out = s.schedule()
        order += ids(out)
        advance(s, out)
    assert order == ["soonest-deadline", "later-deadline", "early"]


# -- fairness ------------------------------------------------------------------------


def test_tenants_of_one_class_alternate_by_tokens_served_per_weight() -> None:
    clock = Clock()
    s = make(clock, max_num_seqs=1)
    for i in range(6):
        s.add_request(request(f"loud{i}", at=0.01 * i, tenant="loud"))
    for i in range(2):
        s.add_request(request(f"quiet{i}", at=1 + 0.01 * i, tenant="quiet"))
    order = []
    for _ in range(5):
        out = s.schedule()
        order += ids(out)
        advance(s, out)
        s.finish_requests(ids(out), RequestStatus.FINISHED_STOPPED)
    # First come first: loud0 (quiet has not arrived in the queue before it); then the
    # one served less goes first each time.
    assert order == ["loud0", "quiet0", "loud1", "quiet1", "loud2"]


def test_fair_share_counts_tokens_by_weight_and_banks_no_idle_credit() -> None:
    fair = FairShare()
    fair.charge(request("x", tenant="a", weight=1), 100)
    fair.charge(request("y", tenant="b", weight=4), 100)
    assert fair.served == {"a": 100.0, "b": 25.0}
    assert fair.neediest(["a", "b"]) == "b"
    fair.charge(request("z", tenant="a"), 1000)  # while b was not waiting
    fair.level("b", ["a"])  # b waits again: level with a, not 1,075 tokens ahead
    assert fair.served["b"] == fair.served["a"] == 1100.0
    fair.level("c", [])  # nobody else waits: nothing to level with
    assert "c" not in fair.served


def test_a_tenant_back_from_idle_does_not_monopolise() -> None:
    clock = Clock()
    s = make(clock, max_num_seqs=1, aging_interval_s=None)  # fairness alone
    s.add_request(request("busy0", tenant="busy"))
    for i in range(3):  # "busy" is served alone for a while
        out = s.schedule()
        advance(s, out)
        s.finish_requests(ids(out), RequestStatus.FINISHED_STOPPED)
        s.add_request(request(f"busy{i + 1}", at=i + 1.0, tenant="busy"))
    for i in range(3):
        s.add_request(request(f"back{i}", at=10.0 + i, tenant="back"))
    order = []
    for _ in range(4):
        out = s.schedule()
        order += ids(out)
        advance(s, out)
        s.finish_requests(ids(out), RequestStatus.FINISHED_STOPPED)
        if len(order) < 4:
            s.add_request(request(f"busy-more{len(order)}", at=20.0 + len(order), tenant="busy"))
    # "back" joined level with "busy" (not 3 requests' worth of tokens behind it), so it
    # gets half the turns instead of taking its three in a row.
    assert [rid.startswith("back") for rid in order].count(True) == 2


# -- priority preemption -------------------------------------------------------------


def _full_of_low_priority(clock: Clock, **knobs: Any) -> Scheduler:
    s = make(clock, max_num_seqs=2, **knobs)
    s.add_request(request("low-old", priority=5, at=0.0))
    s.add_request(request("low-new", priority=5, at=0.1))
    advance(s, s.schedule())
    return s


def test_an_urgent_request_preempts_the_lowest_ranked_running_one() -> None:
    clock = Clock(now=0.2)
    s = _full_of_low_priority(clock)
    s.add_request(request("urgent", priority=0, at=0.2))
    out = s.schedule()
    assert ids(out) == ["low-old", "urgent"]
    victim = s.requests["low-new"]
    assert victim.status == RequestStatus.PREEMPTED and victim.num_preemptions == 1
    assert victim.arrival_time == 0.1  # it keeps its age
    assert victim.output_token_ids == [7]  # and its output
    assert (s.num_preemptions, s.num_priority_preemptions) == (1, 1)
    advance(s, out)


def test_no_preemption_below_the_gap_or_past_the_bound() -> None:
    clock = Clock(now=0.2)
    s = _full_of_low_priority(clock, priority_preemption_gap=6)
    s.add_request(request("urgent", priority=0, at=0.2))
    assert ids(s.schedule()) == ["low-old", "low-new"]  # 5 < gap 6
    s = _full_of_low_priority(clock, max_preemptions_per_request=0)
    s.add_request(request("urgent", priority=0, at=0.2))
    assert ids(s.schedule()) == ["low-old", "low-new"] and s.num_priority_preemptions == 0


def test_a_running_request_that_has_aged_is_not_preempted() -> None:
    clock = Clock(now=0.2)
    s = _full_of_low_priority(clock, aging_interval_s=1.0)
    clock.now = 4.5  # both low requests are in class 1 now: only 1 above a new class 0
    s.add_request(request("urgent", priority=0, at=4.0))
    assert ids(s.schedule()) == ["low-old", "low-new"]


# -- prefill protection --------------------------------------------------------------


def test_running_prefills_leave_the_reserve_to_newcomers() -> None:
    clock = Clock()
    s = make(clock, max_num_batched_tokens=64, long_prefill_token_threshold=0)
    s.add_request(request("doc", 400))
    advance(s, s.schedule())
    s.add_request(request("chat", 10))
    out = s.schedule()
    # doc may take 64 - 16 (the 25% reserve) = 48; chat takes its 10 from the reserve,
    # and the 6 left over go back to doc.
    assert [(r.request_id, len(r.token_ids)) for r in out.requests] == [("doc", 54), ("chat", 10)]


def test_the_long_prefill_threshold_lets_short_prompts_in_first() -> None:
    clock = Clock()
    s = make(clock, max_num_batched_tokens=64, long_prefill_token_threshold=16)
    s.add_request(request("doc-a", 400))
    s.add_request(request("doc-b", 400))
    s.add_request(request("chat", 20))
    out = s.schedule()
    sizes = {r.request_id: len(r.token_ids) for r in out.requests}
    # Each gets at most 16 at first; what is left goes to the closest to its first token
    # (chat's last 4), then in order.
    assert sizes == {"doc-a": 16 + 12, "doc-b": 16, "chat": 16 + 4}


# -- shedding and deadlines ----------------------------------------------------------


def test_the_waiting_queue_is_bounded_by_requests_and_tokens() -> None:
    clock = Clock()
    s = make(clock, max_num_seqs=1, max_waiting_requests=2, max_waiting_tokens=100)
    s.check_admission(1000, None, priority=0)  # an empty queue takes even an oversized prompt
    for rid in ("a", "b"):
        s.add_request(request(rid, 10))
    with pytest.raises(OverloadedError) as caught:
        s.check_admission(10, None, priority=0)
    assert caught.value.retry_after_s >= 1.0 and "max_waiting_requests" in str(caught.value)
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    with pytest.raises(OverloadedError, match="max_waiting_tokens"):
        s.check_admission(91, None, priority=0)
    s.check_admission(90, None, priority=0)
    assert s.num_rejected_overloaded == 2


def _full_queue(clock: Clock, shed_least_urgent_first: bool = True) -> Scheduler:
    """One slot, busy; a queue of two holding priority 3 then priority 5 (aging 10 s)."""
    s = make(
        clock,
        max_num_seqs=1,
        max_waiting_requests=2,
        aging_interval_s=10.0,
        shed_least_urgent_first=shed_least_urgent_first,
    )
    s.add_request(request("busy", max_tokens=1000))
    advance(s, s.schedule())
    for rid, priority in (("mid", 3), ("low", 5)):
        clock.now += 1
        s.add_request(request(rid, priority=priority, at=clock.now))
    return s


def test_a_full_queue_sheds_its_least_urgent_request_for_a_more_urgent_one() -> None:
    clock = Clock()
    s = _full_queue(clock)
    with pytest.raises(OverloadedError):
        s.check_admission(4, None, priority=5)  # the same class as the least urgent: refused
    s.check_admission(4, None, priority=4)
    s.add_request(request("urgent", priority=4, at=clock.now))
    [low] = s.take_rejected()
    assert (low.request_id, low.rejection, low.status.finish_reason) == (
        "low",
        "overloaded",
        "rejected",
    )
    assert low.retry_after_s is not None and low.retry_after_s >= 1.0
    assert [r.request_id for r in s.waiting] == ["mid", "urgent"]
    # A 4 is now the least urgent; two intervals later the 3 has aged to class 1 and
    # the 4 to class 2: a new 2 is refused, a new 1 displaces the (aged) 4.
    clock.now += 20
    with pytest.raises(OverloadedError):
        s.check_admission(4, None, priority=2)
    s.check_admission(4, None, priority=1)
    s.add_request(request("later", priority=1, at=clock.now))
    assert [r.request_id for r in s.take_rejected()] == ["urgent"]
    assert s.num_rejected_overloaded == 4  # two refused at the door, two displaced


def test_a_request_that_has_started_is_never_shed() -> None:
    clock = Clock()
    s = make(clock, max_num_seqs=1, max_waiting_requests=2)
    s.add_request(request("started", priority=5, max_tokens=1000))
    advance(s, s.schedule())
    s.add_request(request("vip", priority=0))
    advance(s, s.schedule())  # vip preempts it: back in the queue, with its output
    assert [r.request_id for r in s.running] == ["vip"] and s.num_priority_preemptions == 1
    clock.now = 1.0
    s.add_request(request("fresh", priority=5, at=1.0))
    s.check_admission(4, None, priority=1)
    s.add_request(request("urgent", priority=1, at=1.0))
    assert [r.request_id for r in s.take_rejected()] == ["fresh"]
    # "started" ranks lowest but cannot be shed: the least urgent sheddable is a 1.
    with pytest.raises(OverloadedError):
        s.check_admission(4, None, priority=1)


def test_a_shed_request_takes_its_other_completions_with_it() -> None:
    clock = Clock()
    s = make(clock, max_num_seqs=1, max_waiting_requests=3)
    s.add_request(request("busy", max_tokens=1000))
    advance(s, s.schedule())
    params = SamplingParams(max_tokens=8, n=2)
    prompt = [9, 8, 7, 6, 5]
    for req in fan_out(EngineRequest(prompt, params, "pair", priority=5), prompt, 13):
        s.add_request(req)
    s.add_request(request("mid", priority=3))
    s.check_admission(4, None, priority=0)
    s.add_request(request("urgent", priority=0))
    shed = s.take_rejected()
    assert sorted(r.request_id for r in shed) == ["pair", "pair\x001"]
    assert {r.rejection for r in shed} == {"overloaded"} and s.num_rejected_overloaded == 1
    assert [r.request_id for r in s.waiting] == ["urgent", "mid"]


def test_without_shedding_by_urgency_a_full_queue_refuses_everyone() -> None:
    clock = Clock()
    s = _full_queue(clock, shed_least_urgent_first=False)
    with pytest.raises(OverloadedError):
        s.check_admission(4, None, priority=0)
    assert s.take_rejected() == [] and len(s.waiting) == 2


def test_a_deadline_that_cannot_be_met_is_rejected_before_compute() -> None:
    clock = Clock(now=10.0)
    s = make(clock)
    with pytest.raises(DeadlineExceededError):
        s.check_admission(10, deadline=9.0, priority=0)  # already past
    s.check_admission(1000, deadline=10.5, priority=0)  # no throughput yet: benefit of doubt
    s.record_step(prefill_tokens=1000, decode_tokens=0, seconds=1.0)  # 1,000 tokens/s
    with pytest.raises(DeadlineExceededError):
        s.check_admission(1000, deadline=10.5, priority=0)  # needs about 1 s
    s.check_admission(400, deadline=10.5, priority=0)
    assert s.num_rejected_deadline == 2


def test_a_queued_request_whose_deadline_passes_is_rejected_not_run() -> None:
    clock = Clock()
    s = make(clock, max_num_seqs=1)
    s.add_request(request("busy", max_tokens=1000))
    advance(s, s.schedule())
    late = request("late", deadline=1.0)
    s.add_request(late)
    clock.now = 2.0
    s.finish_requests(["busy"], RequestStatus.FINISHED_STOPPED)
    assert ids(s.schedule()) == []
    assert s.take_rejected() == [late] and s.take_rejected() == []
    assert late.status == RequestStatus.FINISHED_REJECTED and late.rejection == "deadline_exceeded"
    assert late.status.finish_reason == "rejected" and not s.has_unfinished()


def test_policy_knobs_are_validated() -> None:
    for bad in (
        {"aging_interval_s": 0},
        {"aging_interval_s": -1.0},
        {"priority_preemption_gap": 0},
        {"max_preemptions_per_request": -1},
        {"prefill_reserve_share": 1.0},
        {"prefill_reserve_share": True},
        {"long_prefill_token_threshold": -5},
        {"max_waiting_requests": 0},
        {"max_waiting_tokens": 1.5},
        {"tenant_fairness": "yes"},
        {"shed_least_urgent_first": 1},
        {"adaptive_step_budget": 1},
        {"batch_priority": -1},
        {"interactive_itl_target_ms": 0},
        {"interactive_ttft_target_ms": float("inf")},
        {"step_time_target_ms": "50"},
        {"min_prefill_tokens_per_step": 0},
        {"latency_window_s": -1.0},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig(**bad)  # type: ignore[arg-type]
    cfg = EngineConfig(max_num_batched_tokens=1000)
    assert (cfg.long_prefill_cap, cfg.prefill_reserve_tokens) == (250, 250)
    assert EngineConfig(long_prefill_token_threshold=0).long_prefill_cap == 2048


# -- latency targets: the adaptive budget, the express lane, slot shares ---------------


def fitted(s: Scheduler) -> Scheduler:
    """Teach the scheduler a machine: 1 ms per step, 1 ms per prefill token, 1 ms per
    decode row (attention free)."""
    for prefill, rows in ((0, 1), (10, 0), (100, 4), (50, 16), (200, 0), (0, 32)):
        shape = StepShape(prefill, rows, 0)
        s.step_cost.observe(shape, 0.001 * (1 + prefill + rows))
    return s


def test_the_budget_is_what_keeps_the_step_within_the_tightest_target() -> None:
    clock = Clock()
    # ITL 20.5 ms: with one decode row, 1 + 1 + n ms <= 20.5 leaves n = 18 tokens.
    s = fitted(make(clock, interactive_itl_target_ms=20.5, min_prefill_tokens_per_step=4))
    s.add_request(request("chat", 4, max_tokens=100))
    advance(s, s.schedule())
    s.add_request(request("doc", 4000))  # not short (over 512): no express lane
    out = s.schedule()
    assert [(r.request_id, len(r.token_ids)) for r in out.requests] == [("chat", 1), ("doc", 18)]
    assert s.step_limit_s == pytest.approx(0.0205)
    # A global cap below it wins; a floor above what fits wins over both.
    s = fitted(make(clock, step_time_target_ms=10.0, min_prefill_tokens_per_step=4))
    s.add_request(request("doc", 4000, priority=5))  # batch: no target of its own
    assert len(s.schedule().requests[0].token_ids) == 8
    s = fitted(make(clock, step_time_target_ms=10.0, min_prefill_tokens_per_step=30))
    s.add_request(request("doc", 4000, priority=5))
    assert len(s.schedule().requests[0].token_ids) == 30


def test_the_tail_of_a_long_prompt_is_not_a_short_one() -> None:
    """A document whose prompt is over long_prefill_cap keeps the step's budget to its
    end: its last 512 tokens neither jump nor stretch the step beside a token stream
    (they did: a flood of document tails held the chat's inter-token p95 at twice
    its target)."""
    clock = Clock()
    s = fitted(make(clock, interactive_itl_target_ms=20.5, min_prefill_tokens_per_step=4))
    s.add_request(request("chat", 4, max_tokens=100))
    advance(s, s.schedule())
    s.add_request(request("doc", 530))  # over 512
    chunks = []
    for _ in range(4):
        out = s.schedule()
        chunks.append([len(r.token_ids) for r in out.requests if r.request_id == "doc"])
        advance(s, out)
    assert chunks == [[18]] * 4  # 512 left after the first: still the same budget


def test_batch_work_alone_gets_the_static_budget() -> None:
    clock = Clock()
    s = fitted(make(clock, num_blocks=2048, latency_window_s=1.0))
    s.add_request(request("chat", 4, max_tokens=1))
    advance(s, s.schedule())
    s.finish_requests(["chat"], RequestStatus.FINISHED_LENGTH)
    s.add_request(request("doc", 4000, priority=5))
    # The chat was seen just now: a newcomer of its class must not wait behind a full
    # step, so the step is held to half its TTFT target (1 s: 1 + n ms <= 500 ms) ...
    out = s.schedule()
    assert s.step_limit_s == pytest.approx(0.5) and len(out.requests[0].token_ids) in (498, 499)
    advance(s, out)
    clock.now = 2.0  # ... until the window has passed: then nothing asks for a limit
    out = s.schedule()
    assert s.step_limit_s is None and len(out.requests[0].token_ids) == 2048


def test_a_short_interactive_prompt_jumps_the_chunk_queue() -> None:
    clock = Clock()
    s = fitted(make(clock, max_num_batched_tokens=256, step_time_target_ms=50.0))
    s.add_request(request("doc-a", 2000))
    s.add_request(request("doc-b", 2000))
    advance(s, s.schedule())
    advance(s, s.schedule())
    # 60 tokens: more than a 50 ms step holds (49 tokens) beside the floor; an express
    # prompt may stretch its step to twice the limit (99 tokens).
    s.add_request(request("chat", 60))
    s.add_request(request("batch-chat", 20, priority=5))
    out = s.schedule()
    sizes = {r.request_id: len(r.token_ids) for r in out.requests}
    # The chat computes its whole prompt now, first, ahead of both documents' chunks;
    # the rest keep the floor (32 tokens): the oldest prefill, less the reserve (12, a
    # quarter of the step's 49-token budget), then topped up with the reserve nobody
    # took: the batch-class prompt, which does not jump, waits while an interactive
    # prompt is computed (backend/SCHEDULING.md, "Protected work and filler rows").
    assert ids(out) == ["chat", "doc-a"]
    assert [sizes[r] for r in ids(out)] == [60, 32]
    assert s.step_prefill_budget in (48, 49)  # the fit, to a token
    advance(s, out)
    assert s.requests["chat"].output_token_ids  # its first token, from that very step
    # Without the adaptive budget it is admitted after the running prefills, as before.
    s = fitted(make(clock, max_num_batched_tokens=256, adaptive_step_budget=False))
    s.add_request(request("doc-a", 2000))
    advance(s, s.schedule())
    s.add_request(request("chat", 100))
    out = s.schedule()
    assert ids(out) == ["doc-a", "chat"]


def test_a_long_interactive_prompt_does_not_jump() -> None:
    clock = Clock()
    s = fitted(make(clock, max_num_batched_tokens=256, step_time_target_ms=30.0))
    s.add_request(request("doc-a", 2000))
    advance(s, s.schedule())
    s.add_request(request("doc-b", 100))  # over long_prefill_cap (64)
    out = s.schedule()
    # It starts after the running prefill, on the reserve (a quarter of the 32 tokens).
    assert [(r.request_id, len(r.token_ids)) for r in out.requests] == [
        ("doc-a", 24),
        ("doc-b", 8),
    ]


def test_a_new_tenant_gets_its_share_of_full_slots_by_preemption() -> None:
    clock = Clock()
    s = fitted(make(clock, max_num_seqs=4))
    for i in range(6):
        s.add_request(request(f"loud{i}", 4, tenant="loud", max_tokens=200))
    advance(s, s.schedule())
    for i in range(3):
        s.add_request(request(f"quiet{i}", 4, tenant="quiet", max_tokens=200))
    out = s.schedule()
    running = sorted(r.request_id for r in s.running)
    # Half the slots each (equal weights): two loud requests make room, at once.
    assert [r for r in running if r.startswith("quiet")] == ["quiet0", "quiet1"]
    assert len(running) == 4 and s.num_slot_share_preemptions == 2
    advance(s, out)
    for _ in range(5):  # and nobody trades slots back and forth afterwards
        advance(s, s.schedule())
    assert s.num_slot_share_preemptions == 2 and s.num_preemptions == 2


def test_slots_are_not_taken_when_waiting_is_cheaper_or_the_share_is_below_one() -> None:
    clock = Clock()
    s = fitted(make(clock, max_num_seqs=4, enable_prefix_caching=False))
    for i in range(4):  # each has 2 tokens left: a slot frees sooner than a recompute
        s.add_request(request(f"loud{i}", 200, tenant="loud", max_tokens=2))
    advance(s, s.schedule())
    s.add_request(request("quiet", 4, tenant="quiet"))
    s.schedule()
    assert s.num_slot_share_preemptions == 0
    s = fitted(make(clock, max_num_seqs=1))  # half a slot each: nobody preempts
    s.add_request(request("loud", 4, tenant="loud", max_tokens=200))
    advance(s, s.schedule())
    s.add_request(request("quiet", 4, tenant="quiet"))
    s.schedule()
    assert s.num_slot_share_preemptions == 0


def test_a_victim_s_recompute_is_only_what_the_prefix_cache_does_not_keep() -> None:
    """The same full slots as above, with the prefix cache on: a preempted request's
    full blocks stay in the cache, so taking the slot costs the quiet tenant's victim
    the 1 token past them, not its 200 (issue 32: counted whole, a backlog's long streams
    were never worth a slot to a tenant short of its share)."""
    clock = Clock()
    s = fitted(make(clock, max_num_seqs=4))
    for i in range(4):
        s.add_request(request(f"loud{i}", 200, tenant="loud", max_tokens=2))
    advance(s, s.schedule())
    s.add_request(request("quiet", 4, tenant="quiet"))
    out = s.schedule()
    assert s.num_slot_share_preemptions == 1 and "quiet" in ids(out)
    (victim,) = [r for r in s.requests.values() if r.status == RequestStatus.PREEMPTED]
    advance(s, out)
    others = [r.request_id for r in s.running if r.tenant == "loud"]
    s.finish_requests(others, RequestStatus.FINISHED_LENGTH)  # their slots free
    (chunk,) = [r for r in s.schedule().requests if r.request_id == victim.request_id]
    assert chunk.start_pos == 200 and len(chunk.token_ids) == 1  # from its cached blocks


def test_short_prompts_get_the_tokens_their_ttft_target_needs_up_to_the_stretch() -> None:
    """The ITL target alone would leave 18 tokens a step (1 + 1 + n ms <= 20.5 ms). Two
    waiting 40-token prompts with a 50 ms TTFT target need 80 x 20.5 / 50 = 33 tokens a
    step to start in time, so the step takes that many; twenty would need 328, but the
    step stretches at most to twice its limit for them (39 tokens)."""
    for prompts, budget in ((2, 33), (20, 39)):
        clock = Clock()
        s = fitted(make(clock, interactive_itl_target_ms=20.5, interactive_ttft_target_ms=50.0))
        s.add_request(request("chat", 4, max_tokens=100))
        advance(s, s.schedule())
        for i in range(prompts):
            s.add_request(request(f"short{i}", 40))
        s.schedule()
        assert s.step_prefill_budget == budget, prompts


def test_only_the_least_served_tenant_may_stretch_a_step() -> None:
    """A 50 ms step holds 49 tokens; the express lane may stretch it to 99. A tenant's
    flood of short prompts gets the stretch while it is alone, not while a tenant
    served less than it is running: that tenant's stream would pay for the flood."""
    scheduled = {}
    for with_quiet in (False, True):
        clock = Clock()
        s = fitted(make(clock, step_time_target_ms=50.0))
        if with_quiet:
            s.add_request(request("quiet", 4, tenant="quiet", max_tokens=100))
            advance(s, s.schedule())
        for i in range(10):
            s.add_request(request(f"flood{i}", 40, tenant="flood"))
        s.fair.charge(request("past", tenant="flood"), 1000)  # type: ignore[union-attr]
        out = s.schedule()
        scheduled[with_quiet] = out.num_prefill_tokens
    assert scheduled == {False: 99, True: 48}  # 48: beside the quiet decode row


def test_old_service_is_no_debt_when_a_tenant_waits_again() -> None:
    fair = FairShare()
    fair.charge(request("x", tenant="old"), 10_000)  # a busy period long ago
    fair.charge(request("y", tenant="new"), 10)
    fair.level("old", ["new"])  # "old" waits again beside "new": level, not 9,990 behind
    assert fair.served["old"] == fair.served["new"] == 10.0


def test_a_target_too_tight_for_the_machine_still_leaves_half_a_step_to_prefill() -> None:
    """40 decode rows already take 41 ms, past the 20.5 ms ITL target: the floor rises
    to the 41 tokens that take as long, so prefill keeps half of each step."""
    clock = Clock()
    s = fitted(make(clock, interactive_itl_target_ms=20.5))
    for i in range(40):
        s.add_request(request(f"chat{i}", 4, max_tokens=100))
    advance(s, s.schedule())
    s.add_request(request("doc", 4000))
    out = s.schedule()
    assert out.num_decode_tokens == 40 and out.num_prefill_tokens in (40, 41)


# -- aging within a tenant's fair share (issue 32) -----------------------------------


def _steps_until_scheduled(
    s: Scheduler, clock: Clock, late: Request, at: float, step_s: float
) -> int:
    """Run steps of `step_s` (finishing requests at max_tokens) until `late`, added at
    `at`, is scheduled; the number of steps it waited."""
    added = None
    for step in range(100_000):
        clock.now = step * step_s
        if added is None and clock.now >= at:
            s.add_request(late)
            added = step
        out = s.schedule()
        if added is not None and late.request_id in ids(out):
            return step - added
        advance(s, out)
        done = [r.request_id for r in s.running if len(r.output_token_ids) >= r.params.max_tokens]
        s.finish_requests(done, RequestStatus.FINISHED_LENGTH)
    raise AssertionError("never scheduled")


@pytest.mark.parametrize(("late_priority", "at"), [(4, 10.0), (4, 30.0), (0, 30.0), (0, 60.0)])
def test_a_tenants_aged_backlog_never_starves_another_tenants_fresh_request(
    late_priority: int, at: float
) -> None:
    """Issue 32: B streams 32 long requests with 168 more queued, all at its plan's
    priority 4. Aged from arrival, B's backlog and streams outranked C's fresh request of
    class 4 at once and of class 0 after 20 s (4 classes x 5 s): C waited for B's
    streams to end (hundreds of seconds here). Aged only while B goes unserved, C starts in the
    step it arrives: its tenant's share of the slots is taken from B by preemption."""
    clock = Clock()
    s = fitted(make(clock, num_blocks=20_000, max_num_seqs=32))
    for i in range(200):
        s.add_request(request(f"b{i}", 40, tenant="B", priority=4, max_tokens=4000))
    chat = request("c", 8, tenant="C", priority=late_priority, max_tokens=4, at=at)
    assert _steps_until_scheduled(s, clock, chat, at, step_s=0.5) <= 1


def test_a_low_class_tenant_still_gets_in_once_aged_while_another_is_served() -> None:
    """Aging still bounds starvation across tenants: A's class 3 request waits while B's
    class 0 requests keep the one slot busy, and starts once it has aged 3 classes (3 s
    at 1 s a class), when the slot frees: B being served does not age B's queue."""
    clock = Clock()
    s = make(clock, max_num_seqs=1, aging_interval_s=1.0)
    for i in range(400):
        s.add_request(request(f"b{i}", 4, tenant="B", priority=0, max_tokens=3))
    low = request("a", 4, tenant="A", priority=3, max_tokens=3, at=0.5)
    waited = _steps_until_scheduled(s, clock, low, 0.5, step_s=0.05) * 0.05
    assert 3.0 <= waited <= 3.0 + 4 * 0.05  # aged to class 0, then the next free slot


@pytest.mark.parametrize("priority", [0, 2, 4])
def test_a_served_backlog_never_ranks_above_another_tenants_request_of_its_class(
    priority: int,
) -> None:
    """The ordering bound between tenants (backend/SCHEDULING.md): B's queue waited 100 s
    (20 classes at 5 s) while B's streams were served every step; against C's request of
    the same priority, every one of B's queued requests is still in that class or below,
    and once B has been served one more step, C's fresh request takes the next free slot
    (tokens served per weight decide within the class)."""
    clock = Clock()
    s = make(clock, max_num_seqs=2, tenant_fairness=True)
    for i in range(6):
        s.add_request(request(f"b{i}", 4, tenant="B", priority=priority, max_tokens=10_000))
    for _ in range(100):
        clock.now += 1.0
        advance(s, s.schedule())
    c = request("c", 4, tenant="C", priority=priority, at=clock.now)
    s.add_request(c)
    queued_b = [r for r in s.waiting if r.tenant == "B"]
    assert len(queued_b) == 4
    ranks = [s.waiting.competing_class(r, clock.now) for r in queued_b]
    assert min(ranks) >= s.waiting.competing_class(c, clock.now) == priority
    advance(s, s.schedule())  # both slots busy: B's streams are served, C waits
    s.finish_requests(["b0"], RequestStatus.FINISHED_STOPPED)  # a slot frees
    assert ids(s.schedule())[-1] == "c"
