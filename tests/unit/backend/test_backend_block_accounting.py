"""Block accounting under any sequence of submit, step (finishing requests), abort (also
racing with a step) and the preemptions a small pool forces: a hypothesis state machine
drives the scheduler and block manager with a fake model and checks the books after
every rule."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from backend.config import EngineConfig
from backend.engine.batch import ModelRunnerOutput, SchedulerOutput
from backend.engine.block_manager import BlockManager
from backend.engine.request import Request, RequestStatus, fan_out
from backend.engine.scheduler import Scheduler
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from tests.unit.backend.accounting import check_accounting

BLOCK_SIZE = 4
NUM_BLOCKS = 12  # 48 tokens: fits the longest request (20 + 20), but not many at once
PREFIXES = [[3] * 12, [5, 6, 7, 8] * 3]  # shared prefixes make prefix-cache hits likely


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.caching = True
        self.scheduler = self._make(caching=True)
        self.requests: list[Request] = []
        self.step_no = 0

    def _make(self, caching: bool) -> Scheduler:
        cfg = EngineConfig(
            block_size=BLOCK_SIZE,
            num_kv_blocks=NUM_BLOCKS,
            max_num_batched_tokens=10,
            max_num_seqs=64,
        )
        return Scheduler(cfg, BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_caching=caching))

    @precondition(lambda self: not self.requests)
    @rule(caching=st.booleans())
    def configure(self, caching: bool) -> None:
        self.scheduler = self._make(caching)

    @rule(
        prefix=st.sampled_from(range(len(PREFIXES))),
        prefix_len=st.integers(0, 12),
        suffix=st.lists(st.integers(0, 9), max_size=8),
        max_tokens=st.integers(1, 20),
        n=st.integers(1, 3),
        salt=st.sampled_from([None, "tenant-a"]),
    )
    def submit(
        self,
        prefix: int,
        prefix_len: int,
        suffix: list[int],
        max_tokens: int,
        n: int,
        salt: str | None,
    ) -> None:
        prompt = PREFIXES[prefix][:prefix_len] + suffix or [1]
        params = SamplingParams(max_tokens=max_tokens, n=n)
        rid = f"r{len(self.requests)}"
        asked = EngineRequest(prompt, params, rid)
        for req in fan_out(asked, prompt, len(prompt) + max_tokens, cache_salt=salt):
            self.scheduler.add_request(req)
            self.requests.append(req)

    @rule(token=st.integers(0, 9))
    def step(self, token: int) -> None:
        self._finish_done(self._run(self.scheduler.schedule(), token))

    @rule(data=st.data(), token=st.integers(0, 9))
    def step_with_racing_abort(self, data: st.DataObject, token: int) -> None:
        """The abort lands between scheduling and the step's results (vLLM #29987)."""
        out = self.scheduler.schedule()
        if out.requests:
            victim = data.draw(st.sampled_from(out.requests)).request_id
            self.scheduler.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
        self._finish_done(self._run(out, token))

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        """Any id: running, waiting, preempted, finished, aborted twice, or unknown."""
        ids = [r.request_id for r in self.requests] + ["ghost"]
        rid = data.draw(st.sampled_from(ids))
        self.scheduler.finish_requests([rid, rid], RequestStatus.FINISHED_ABORTED)

    def _run(self, out: SchedulerOutput, token: int) -> list[Request]:
        self.step_no += 1
        sampled = {r.request_id: token for r in out.requests if r.sample}
        return [
            req for req, _ in self.scheduler.update_from_output(out, ModelRunnerOutput(sampled))
        ]

    def _finish_done(self, reqs: list[Request]) -> None:
        for req in reqs:
            if len(req.output_token_ids) >= req.params.max_tokens:
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_LENGTH)

    @invariant()
    def books_balance(self) -> None:
        s = self.scheduler
        check_accounting(s.block_manager, (r.request_id for r in s.running))
        assert all(r.status == RequestStatus.RUNNING for r in s.running)
        assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in s.waiting)
        assert len(s.running) + len(s.waiting) == len(s.requests)
        for req in self.requests:
            assert 0 <= req.num_computed_tokens <= req.num_tokens
            assert req.is_finished == (req.request_id not in s.requests)

    def teardown(self) -> None:
        """Everything left runs to completion; then no block is in use. The step bound
        grows with the work left (a flat 400 was too few for a long history with heavy
        preemption): a livelock never finishes, whatever the bound."""
        work = sum(r.max_len for r in self.requests if not r.is_finished)
        for _ in range(400 + 10 * work):
            if not self.scheduler.has_unfinished():
                break
            self.step(token=1)
            self.books_balance()
        assert not self.scheduler.has_unfinished(), "requests left unfinished: livelock"
        assert self.scheduler.block_manager.num_used_blocks == 0


SchedulerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
test_block_accounting = SchedulerMachine.TestCase
