"""Protected work and filler rows (backend/SCHEDULING.md): batch rows fill what interactive
work leaves of a step, and a tenant's rows past its share fill what another tenant's
newcomer leaves of its first step, each within filler_slowdown x the step the protected
work takes alone (by the step-cost fit); with nothing to protect, everything runs."""

from __future__ import annotations

import pytest

from backend.config import EngineConfig
from backend.engine.batch import SchedulerOutput
from backend.engine.scheduler import Scheduler
from backend.engine.step_cost import StepShape
from tests.engine.test_scheduler_policy import Clock, advance, make, request

BATCH = 5  # the default batch_priority


def fitted(s: Scheduler) -> Scheduler:
    """A CPU-like machine: 10 ms per step, 1 ms per decode row and per prefill token. A
    step of one chat row takes 11 ms; 1.3x of it leaves room for 3 more rows."""
    for prefill, rows in ((0, 1), (10, 0), (100, 4), (50, 16), (200, 0), (0, 32)):
        s.step_cost.observe(StepShape(prefill, rows, 0), 0.001 * (10 + prefill + rows))
    return s


def rows_of(out: SchedulerOutput, prefix: str) -> list[tuple[str, int]]:
    return [
        (r.request_id, len(r.token_ids)) for r in out.requests if r.request_id.startswith(prefix)
    ]


def decoding_batch(s: Scheduler, n: int, prompt: int = 4) -> None:
    for i in range(n):
        s.add_request(request(f"batch{i}", prompt, priority=BATCH, tenant="T", max_tokens=500))
    advance(s, s.schedule())  # prefilled together: every row decodes from now on


def test_batch_rows_take_what_keeps_the_step_within_the_slowdown_of_interactive_work() -> None:
    clock = Clock()
    s = fitted(make(clock))
    decoding_batch(s, 8)
    assert len(rows_of(s.schedule(), "batch")) == 8  # nothing interactive: full width
    s.add_request(request("chat", 4, tenant="A", max_tokens=100))
    advance(s, s.schedule())
    out = s.schedule()
    # 11 ms for the chat's row alone; 1.3x is 14.3 ms: three batch rows, the best-ranked.
    assert rows_of(out, "chat") == [("chat", 1)]
    assert rows_of(out, "batch") == [(f"batch{i}", 1) for i in range(3)]
    advance(s, out)
    s.finish_requests(["chat"], s.requests["chat"].status.FINISHED_STOPPED)
    assert len(rows_of(s.schedule(), "batch")) == 8  # the chat left: full width again


def test_a_held_row_runs_without_its_drafts() -> None:
    """Speculative decoding proposes drafts for every decoding row; a filler row runs
    its one token only (its drafts would cost the step time it is held to)."""
    clock = Clock()
    s = fitted(make(clock))
    decoding_batch(s, 2)
    s.add_request(request("chat", 4, tenant="A", max_tokens=100))
    advance(s, s.schedule())
    for req in s.running:
        req.spec_token_ids = [7, 7]
    out = s.schedule()
    assert dict(rows_of(out, "batch")) == {"batch0": 1, "batch1": 1}
    assert all(r.num_drafts == 0 for r in out.requests if r.request_id.startswith("batch"))


def test_batch_prefill_waits_while_an_interactive_prompt_waits_or_computes() -> None:
    clock = Clock()
    s = fitted(make(clock, long_prefill_token_threshold=16))
    s.add_request(request("chat", 40, tenant="A", max_tokens=100))  # short: 40 <= 512
    s.add_request(request("batch-doc", 300, priority=BATCH, tenant="T", max_tokens=10))
    out = s.schedule()
    assert rows_of(out, "batch") == []  # neither started nor chunked beside the prompt
    advance(s, out)
    while s.requests["chat"].num_computed_tokens < 40:
        out = s.schedule()
        assert rows_of(out, "batch") == []
        advance(s, out)
    out = s.schedule()  # the chat decodes: the batch prompt gets what 1.3x leaves
    assert rows_of(out, "chat") == [("chat", 1)]
    assert rows_of(out, "batch") == [("batch-doc", 3)]  # 11 ms x 1.3 = 14.3: 3 tokens


def test_batch_work_aged_past_the_interactive_classes_is_no_longer_held() -> None:
    clock = Clock()
    s = fitted(make(clock, aging_interval_s=1.0))
    decoding_batch(s, 8)
    s.add_request(request("chat", 4, tenant="A", max_tokens=1000))
    advance(s, s.schedule())
    assert len(rows_of(s.schedule(), "batch")) == 3
    clock.now = 6.0  # five classes up: class 0, level with the chat
    assert len(rows_of(s.schedule(), "batch")) == 8


def _b_running_in_every_slot() -> Scheduler:
    """Tenant B's 8 long requests decoding in all 8 slots, three steps in."""
    s = fitted(make(Clock(), max_num_seqs=8, num_blocks=2048))
    for i in range(8):
        s.add_request(request(f"b{i}", 40, tenant="B", max_tokens=2000))
    for _ in range(3):
        advance(s, s.schedule())
    return s


def test_a_tenant_past_its_share_fills_what_another_tenants_newcomer_leaves() -> None:
    """B runs all 8 slots; C's short chat arrives. The slot share gives C a slot at once,
    and the step that computes C's prompt carries only what keeps it within 1.3x of C's
    chunk alone; the next step, C decoding, carries every row again."""
    s = _b_running_in_every_slot()
    s.add_request(request("c", 4, tenant="C", max_tokens=10))
    out = s.schedule()
    assert rows_of(out, "c") == [("c", 4)]
    assert s.num_slot_share_preemptions == 1
    # C's chunk alone: 10 + 4 = 14 ms; 1.3x is 18.2 ms: four of B's rows.
    assert len(rows_of(out, "b")) == 4
    advance(s, out)
    out = s.schedule()
    assert rows_of(out, "c") == [("c", 1)] and len(rows_of(out, "b")) == 7


def test_within_its_share_a_tenant_is_not_held_for_another_tenants_newcomer() -> None:
    clock = Clock()
    s = fitted(make(clock, max_num_seqs=8, num_blocks=2048))
    for i in range(3):  # 3 of 8 slots: within half
        s.add_request(request(f"b{i}", 40, tenant="B", max_tokens=2000))
    advance(s, s.schedule())
    s.add_request(request("c", 4, tenant="C", max_tokens=10))
    out = s.schedule()
    assert rows_of(out, "c") == [("c", 4)] and len(rows_of(out, "b")) == 3


def test_with_filler_slowdown_none_nothing_is_held() -> None:
    clock = Clock()
    s = fitted(make(clock, filler_slowdown=None))
    decoding_batch(s, 8)
    s.add_request(request("chat", 4, tenant="A", max_tokens=100))
    advance(s, s.schedule())
    assert len(rows_of(s.schedule(), "batch")) == 8


@pytest.mark.parametrize("value", [0.5, 0, -1.0, float("inf"), "1.3", True])
def test_filler_slowdown_is_validated(value: object) -> None:
    with pytest.raises(ValueError, match="filler_slowdown"):
        EngineConfig(filler_slowdown=value)  # type: ignore[arg-type]


def test_a_step_gives_way_only_to_a_newcomer_it_would_hold_rows_for() -> None:
    """Engine._run_sync abandons a step that holds nothing back for a request that
    arrived during it if that request would be protected in the next step: a short
    interactive prompt of a tenant below its share while another runs above its own,
    with a slot for it (here the slot share's victim)."""
    s = _b_running_in_every_slot()
    assert not s.protecting
    assert s.gives_way_to(request("c", 4, tenant="C", max_tokens=10))
    assert not s.gives_way_to(request("b8", 4, tenant="B", max_tokens=10))  # above its share
    assert not s.gives_way_to(request("c-doc", 600, tenant="C"))  # not a short prompt
    assert not s.gives_way_to(request("c-batch", 4, priority=BATCH, tenant="C"))  # no target
    s.add_request(request("c", 4, tenant="C", max_tokens=10))
    advance(s, s.schedule())
    assert s.protecting  # the newcomer's step holds B's rows: it would not give way again


def test_no_step_gives_way_within_shares_or_without_filler_rows() -> None:
    clock = Clock()
    s = fitted(make(clock, max_num_seqs=8, num_blocks=2048))
    for i in range(3):  # 3 of 8 slots: within half
        s.add_request(request(f"b{i}", 40, tenant="B", max_tokens=2000))
    advance(s, s.schedule())
    assert not s.gives_way_to(request("c", 4, tenant="C", max_tokens=10))
    off = fitted(make(clock, max_num_seqs=8, num_blocks=2048, filler_slowdown=None))
    for i in range(8):
        off.add_request(request(f"b{i}", 40, tenant="B", max_tokens=2000))
    advance(off, off.schedule())
    assert not off.gives_way_to(request("c", 4, tenant="C", max_tokens=10))


def test_a_step_of_batch_rows_gives_way_to_an_interactive_newcomer() -> None:
    """The batch lane: a chat arriving during a step of batch rows at full width would
    make them filler in the next step, so that step is abandoned for it (a slot free:
    the gateway's lines hold half of them); a batch newcomer, or one with no slot, not."""
    clock = Clock()
    s = fitted(make(clock, max_num_seqs=16, num_blocks=2048))
    decoding_batch(s, 8)
    advance(s, s.schedule())
    assert not s.protecting
    assert s.gives_way_to(request("chat", 4, tenant="A", max_tokens=10))
    assert not s.gives_way_to(request("line", 4, priority=BATCH, tenant="A", max_tokens=10))
    full = fitted(make(clock, max_num_seqs=8, num_blocks=2048))
    decoding_batch(full, 8)  # every slot: the chat waits for one (its tenant's is T's)
    assert not full.gives_way_to(request("chat", 4, tenant="T", max_tokens=10))
    s.add_request(request("chat", 4, tenant="A", max_tokens=10))
    advance(s, s.schedule())
    assert s.protecting  # the chat's step holds the batch rows: it would not give way
