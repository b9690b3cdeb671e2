"""The scheduler without a model: budgets, ordering, reservations and finishing."""

from __future__ import annotations

from backend.config import EngineConfig
from backend.engine.batch import ModelRunnerOutput, SchedulerOutput
from backend.engine.block_manager import BlockManager
from backend.engine.request import Request, RequestStatus
from backend.engine.scheduler import Scheduler
from backend.sampling import SamplingParams


def make(num_blocks: int = 64, **config: int) -> Scheduler:
    cfg = EngineConfig(block_size=4, num_kv_blocks=num_blocks, **config)  # type: ignore[arg-type]
    return Scheduler(cfg, BlockManager(num_blocks, 4))


def request(rid: str, prompt_len: int, max_tokens: int = 8) -> Request:
    params = SamplingParams(max_tokens=max_tokens)
    return Request(rid, list(range(prompt_len)), params, max_len=prompt_len + max_tokens)


def advance(s: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    s.update_from_output(out, ModelRunnerOutput({r.request_id: token for r in out.requests}))


def test_status_is_ordered() -> None:
    assert RequestStatus.WAITING < RequestStatus.RUNNING < RequestStatus.FINISHED_STOPPED
    assert not RequestStatus.RUNNING.is_finished
    assert all(s.is_finished for s in list(RequestStatus)[2:])
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
    s = make(max_num_batched_tokens=16, max_model_len=16)
    s.add_request(request("a", 10))
    advance(s, s.schedule())
    for rid in ("b", "c", "d"):
        s.add_request(request(rid, 6))
    out = s.schedule()
    # a's decode (1) + b (6) + c (6) = 13; d (6) would exceed 16.
    assert [(r.request_id, len(r.token_ids)) for r in out.requests] == [
        ("a", 1),
        ("b", 6),
        ("c", 6),
    ]
    assert out.num_tokens == 13 and [r.request_id for r in s.waiting] == ["d"]


def test_max_num_seqs() -> None:
    s = make(max_num_seqs=2)
    for rid in "abc":
        s.add_request(request(rid, 3))
    out = s.schedule()
    assert [r.request_id for r in out.requests] == ["a", "b"]
    advance(s, out)
    out = s.schedule()
    assert [(r.request_id, len(r.token_ids)) for r in out.requests] == [("a", 1), ("b", 1)]
    advance(s, out)
    s.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert [r.request_id for r in out.requests] == ["b", "c"]
    assert out.finished_request_ids == ["a"]


def test_admission_reserves_room_to_finish() -> None:
    # Each request needs (4 + 12) / 4 = 4 blocks to finish; the pool has 10.
    s = make(num_blocks=10)
    for rid in "abc":
        s.add_request(request(rid, 4, max_tokens=12))
    assert [r.request_id for r in s.schedule().requests] == ["a", "b"]
    assert s.block_manager.num_used_blocks == 2
    s.finish_requests(["a"], RequestStatus.FINISHED_LENGTH)
    assert s.block_manager.num_used_blocks == 1
    assert "c" in [r.request_id for r in s.schedule().requests]


def test_finish_is_idempotent_and_drops_late_tokens() -> None:
    s = make()
    s.add_request(request("a", 3))
    out = s.schedule()
    done = s.finish_requests(["a", "a", "ghost"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in done] == ["a"] and done[0].is_finished
    assert s.update_from_output(out, ModelRunnerOutput({"a": 1})) == []
    assert s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED) == []
    assert s.block_manager.num_free_blocks == 64 and not s.has_unfinished()
