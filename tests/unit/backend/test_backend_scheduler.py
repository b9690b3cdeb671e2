"""The scheduler without a model: budgets, ordering, chunked prefill, preemption, prefix
caching, forks for n > 1, and finishing."""

from __future__ import annotations

from dataclasses import replace

from backend.config import EngineConfig
from backend.engine.batch import ModelRunnerOutput, SchedulerOutput
from backend.engine.block_manager import BlockManager
from backend.engine.request import Request, RequestStatus, fan_out
from backend.engine.scheduler import Scheduler
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from tests.unit.backend.accounting import check_accounting


def make(num_blocks: int = 64, caching: bool = True, **config: int) -> Scheduler:
    # The mechanism alone: prefill protection (tests/engine/test_scheduler_policy.py) off.
    config = {
        "prefill_reserve_share": 0,
        "long_prefill_token_threshold": 0,
        "max_num_seqs": 64,
        **config,
    }
    cfg = EngineConfig(block_size=4, num_kv_blocks=num_blocks, **config)  # type: ignore[arg-type]
    return Scheduler(cfg, BlockManager(num_blocks, 4, enable_caching=caching))


def request(
    rid: str, prompt_len: int, max_tokens: int = 8, first: int = 0, salt: str | None = None
) -> Request:
    params = SamplingParams(max_tokens=max_tokens)
    prompt = list(range(first, first + prompt_len))
    (req,) = fan_out(
        EngineRequest(prompt, params, rid), prompt, prompt_len + max_tokens, cache_salt=salt
    )
    return req


def advance(s: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    sampled = {r.request_id: token for r in out.requests if r.sample}
    s.update_from_output(out, ModelRunnerOutput(sampled))
    check_accounting(s.block_manager, (r.request_id for r in s.running))


def chunks(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(r.request_id, len(r.token_ids)) for r in out.requests]


def test_status_is_ordered() -> None:
    assert RequestStatus.WAITING < RequestStatus.RUNNING < RequestStatus.PREEMPTED
    assert RequestStatus.PREEMPTED < RequestStatus.FINISHED_STOPPED
    assert not RequestStatus.PREEMPTED.is_finished
    assert all(s.is_finished for s in list(RequestStatus)[3:])
    assert RequestStatus.FINISHED_ABORTED.finish_reason == "abort"


def test_progress_is_num_computed_tokens_catching_up() -> None:
    s = make()
    req = request("a", 6)
    s.add_request(req)
    out = s.schedule()
    [item] = out.requests
    assert (item.token_ids, item.start_pos, item.sample) == (list(range(6)), 0, True)
    assert item.block_ids == [0, 1]
    advance(s, out, token=42)
    assert (req.num_computed_tokens, req.num_tokens, req.output_token_ids) == (6, 7, [42])
    [item] = s.schedule().requests
    assert (item.token_ids, item.start_pos) == ([42], 6)


def test_decodes_first_then_prefills_within_the_token_budget() -> None:
    s = make(max_num_batched_tokens=16)
    s.add_request(request("a", 10))
    advance(s, s.schedule())
    for i, rid in enumerate("bcd"):
        s.add_request(request(rid, 6, first=100 * (i + 1)))  # no shared prefix
    out = s.schedule()
    # a's decode (1) + b (6) + c (6) = 13; d gets the 3 tokens left as a first chunk.
    assert chunks(out) == [("a", 1), ("b", 6), ("c", 6), ("d", 3)]
    assert (out.num_decode_tokens, out.num_prefill_tokens, out.num_tokens) == (1, 15, 16)
    assert [r.sample for r in out.requests] == [True, True, True, False]


def test_chunked_prefill_lets_decodes_flow() -> None:
    s = make(max_num_batched_tokens=8)
    s.add_request(request("short", 3, max_tokens=20))
    advance(s, s.schedule())
    s.add_request(request("long", 30))
    steps: list[list[tuple[str, int]]] = []
    while len(steps) < 6:
        out = s.schedule()
        steps.append(chunks(out))
        advance(s, out)
    # The decode comes first every step; the 30-token prompt fills the rest: 7+7+7+7+2.
    assert all(step[0] == ("short", 1) for step in steps)
    assert [dict(step).get("long") for step in steps] == [7, 7, 7, 7, 2, 1]
    long = s.requests["long"]
    assert long.output_token_ids == [7, 7] and long.num_computed_tokens == 31


def test_max_num_seqs() -> None:
    s = make(max_num_seqs=2)
    for rid in "abc":
        s.add_request(request(rid, 3))
    out = s.schedule()
    assert [r.request_id for r in out.requests] == ["a", "b"]
    advance(s, out)
    out = s.schedule()
    assert chunks(out) == [("a", 1), ("b", 1)]
    advance(s, out)
    s.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert [r.request_id for r in out.requests] == ["b", "c"]
    assert out.finished_request_ids == ["a"]


def test_no_more_run_than_the_budget_has_tokens() -> None:
    # Otherwise the requests at the back of the running list would never get a decode.
    s = make(max_num_seqs=8, max_num_batched_tokens=3)
    for i in range(5):
        s.add_request(request(f"r{i}", 1, first=10 * i))
    for _ in range(4):
        advance(s, s.schedule())
    assert len(s.running) == 3
    out = s.schedule()
    assert chunks(out) == [("r0", 1), ("r1", 1), ("r2", 1)]


def test_admission_allocates_only_what_is_scheduled() -> None:
    # No worst-case reservation: three requests that could each grow to 4 blocks all
    # start in a pool of 10 blocks; preemption handles the pool running short later.
    s = make(num_blocks=10)
    for rid in "abc":
        s.add_request(request(rid, 4, max_tokens=12))
    assert [r.request_id for r in s.schedule().requests] == ["a", "b", "c"]
    assert s.block_manager.num_used_blocks == 3


def test_preemption_by_recompute_keeps_the_output() -> None:
    s = make(num_blocks=6, max_num_batched_tokens=64)
    for rid in "ab":
        s.add_request(request(rid, 8, max_tokens=16))
    advance(s, s.schedule(), token=1)  # a and b: 2 blocks each, one token out
    out = s.schedule()  # both need a third block: 6 in all, still fits
    advance(s, out, token=2)
    for _ in range(3):  # 10 tokens each: fine until 12
        advance(s, s.schedule(), token=3)
    b = s.requests["b"]
    assert b.num_tokens == 13 and b.num_computed_tokens == 12
    out = s.schedule()  # a needs a 4th block: b, admitted last, is preempted
    assert chunks(out) == [("a", 1)]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == [1, 2, 3, 3, 3] and list(s.waiting) == [b]
    assert s.num_preemptions == 1 and b.num_preemptions == 1
    advance(s, out, token=4)
    s.finish_requests(["a"], RequestStatus.FINISHED_LENGTH)
    out = s.schedule()  # b is recomputed: prompt + its 5 tokens, partly from the cache
    [item] = out.requests
    assert item.request_id == "b" and item.sample
    assert item.start_pos + len(item.token_ids) == 13
    assert item.start_pos == 12  # its three full blocks were still cached
    advance(s, out)
    assert b.output_token_ids == [1, 2, 3, 3, 3, 7]
    assert s.running == [b]


def test_a_preempted_request_scheduled_earlier_in_the_step_is_unscheduled() -> None:
    # "a" decodes; "b" is mid-prefill and needs blocks: the victim is the newest request.
    s = make(num_blocks=5, max_num_batched_tokens=8)
    s.add_request(request("a", 4, max_tokens=30))
    advance(s, s.schedule())
    s.add_request(request("b", 20))
    s.add_request(request("c", 4))
    out = s.schedule()
    assert chunks(out) == [("a", 1), ("b", 7)]
    advance(s, out)
    out = s.schedule()  # b needs 4 blocks for 14 tokens; a holds 2: b preempts itself
    assert chunks(out) == [("a", 1)]
    assert s.requests["b"].status == RequestStatus.PREEMPTED
    assert [r.request_id for r in s.waiting] == ["b", "c"]  # and nobody was admitted


def test_prefix_cache_hit_skips_the_prefix_and_is_salted() -> None:
    s = make()
    s.add_request(request("a", 10))
    advance(s, s.schedule())
    s.add_request(request("b", 11))  # same first 10 tokens
    s.add_request(request("other-tenant", 11, salt="t2"))
    out = s.schedule()
    b, other = s.requests["b"], s.requests["other-tenant"]
    assert chunks(out)[1:] == [("b", 3), ("other-tenant", 11)]
    assert (b.num_cached_tokens, other.num_cached_tokens) == (8, 0)
    a_table = s.block_manager.block_ids("a")
    assert s.block_manager.block_ids("b")[:2] == a_table[:2]
    assert s.block_manager.blocks[a_table[0]].ref_count == 2
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (10 + 11 + 11, 8)


def test_a_full_hit_still_computes_the_last_token() -> None:
    s = make()
    s.add_request(request("a", 8))
    advance(s, s.schedule())
    s.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    s.add_request(request("b", 8))
    [item] = s.schedule().requests
    assert (item.start_pos, item.token_ids, item.sample) == (4, [4, 5, 6, 7], True)


def test_prefix_cache_checks_the_tokens_on_a_hit() -> None:
    s = make()
    s.add_request(request("a", 8))
    advance(s, s.schedule())
    first = s.block_manager.blocks[s.block_manager.block_ids("a")[0]]
    first.token_ids = (9, 9, 9, 9)  # as if another prefix had collided with this hash
    s.add_request(request("b", 9))
    s.schedule()
    assert s.requests["b"].num_cached_tokens == 0


def test_cache_off_means_no_hits() -> None:
    s = make(caching=False)
    s.add_request(request("a", 8))
    advance(s, s.schedule())
    s.add_request(request("b", 9))
    s.schedule()
    assert s.requests["b"].num_cached_tokens == 0 and s.prefix_cache_queries == 0


def fork(s: Scheduler, n: int, prompt_len: int) -> list[Request]:
    parent = request("p", prompt_len)
    reqs = [parent] + [
        replace(request(f"p\0{i}", prompt_len), index=i, fork_of=parent) for i in range(1, n)
    ]
    for req in reqs:
        s.add_request(req)
    return reqs


def test_n_completions_share_the_prompt_blocks_without_the_cache() -> None:
    s = make(caching=False, max_num_batched_tokens=8)
    _, child = fork(s, 2, 10)
    out = s.schedule()  # the child waits until the parent has computed the prompt
    assert chunks(out) == [("p", 8)]
    advance(s, out)
    out = s.schedule()
    assert chunks(out) == [("p", 2), (child.request_id, 2)]  # the child computes the tail
    bm = s.block_manager
    assert bm.block_ids(child.request_id)[:2] == bm.block_ids("p")[:2]
    assert bm.blocks[bm.block_ids("p")[0]].ref_count == 2
    assert bm.block_ids(child.request_id)[2] != bm.block_ids("p")[2]
    advance(s, out)
    assert child.num_cached_tokens == 8 and len(child.output_token_ids) == 1


def test_finish_is_idempotent_and_drops_late_tokens() -> None:
    s = make()
    s.add_request(request("a", 3))
    out = s.schedule()
    done = s.finish_requests(["a", "a", "ghost"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in done] == ["a"] and done[0].is_finished
    assert s.update_from_output(out, ModelRunnerOutput({"a": 1})) == []
    assert s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED) == []
    assert s.block_manager.num_free_blocks == 64 and not s.has_unfinished()
