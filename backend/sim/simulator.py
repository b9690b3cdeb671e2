"""Drive the real Scheduler and BlockManager with a virtual clock: no model runs; every
sampled token is a fake one, and each step takes the time the cost model says: the
roofline (backend/sim/cost.py) by default, or a real engine's fitted step-cost model
(backend/engine/step_cost.py), anything with `step_time(chunks)`. The scheduler fits its
own step-cost model from the simulated steps, as in the engine (after the same warm-up
shapes), and the result reports how far its predictions were from the steps' times."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from backend.config import EngineConfig
from backend.engine.batch import ModelRunnerOutput, SchedulerOutput
from backend.engine.block_manager import BlockManager
from backend.engine.request import RequestStatus, fan_out
from backend.engine.scheduler import Scheduler
from backend.engine.step_cost import StepShape, warm_up_shapes
from backend.errors import DeadlineExceededError, OverloadedError
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from backend.sim.cost import CostModel
from backend.sim.trace import Arrival

FAKE_TOKEN = 1


class StepTimer(Protocol):
    def step_time(self, chunks: Iterable[tuple[int, int]]) -> float:
        """Seconds of one step computing (start, num_tokens) chunks."""
        ...


@dataclass
class RequestRecord:
    arrival: Arrival
    outcome: str = "waiting"  # finished | cancelled | overloaded | deadline_exceeded | waiting
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    end: float | None = None  # when it finished, was cancelled or rejected
    preemptions: int = 0
    first_step: int | None = None  # the step that first scheduled it
    arrival_step: int = 0  # steps completed when it arrived
    running_at_arrival: int = 0  # requests running when it arrived


@dataclass
class SimResult:
    records: dict[str, RequestRecord]
    duration_s: float  # virtual time at the end
    num_steps: int
    num_preemptions: int
    num_priority_preemptions: int
    # Tokens scheduled per tenant over the steps where two or more tenants were waiting.
    contended_tokens: dict[str, int]
    kv_peak_fraction: float = 0.0  # of the KV blocks in use, the most at any step ...
    kv_mean_fraction: float = 0.0  # ... and the mean over steps
    # Mean |predicted - simulated| / simulated step time of the scheduler's own fit.
    step_time_error: float = 0.0


class Simulator:
    def __init__(
        self, config: EngineConfig, cost: StepTimer | None = None, num_kv_blocks: int | None = None
    ) -> None:
        """`num_kv_blocks` defaults to what the roofline's GPU holds (the CostModel given,
        or the default one); the config's device defaults are a GPU's."""
        self.config = config = config.on_device("cuda")
        self.cost: StepTimer = cost or CostModel()
        roofline = self.cost if isinstance(self.cost, CostModel) else CostModel()
        blocks = num_kv_blocks or config.num_kv_blocks or roofline.kv_blocks(config.block_size)
        self.block_manager = BlockManager(blocks, config.block_size, config.enable_prefix_caching)
        self.now = 0.0
        self.scheduler = Scheduler(config, self.block_manager, clock=lambda: self.now)
        self.records: dict[str, RequestRecord] = {}
        self.num_steps = 0
        self._contended: dict[str, int] = {}
        self._cancels: list[tuple[float, str]] = []
        self._kv_used: list[float] = []  # share of blocks in use, per step
        self._error_sum = 0.0
        self._warm_up(blocks * config.block_size)

    def _warm_up(self, capacity: int) -> None:
        """The engine's warm-up shapes, timed by the cost model (no virtual time passes)."""
        for chunks in warm_up_shapes(self.config.max_num_batched_tokens, capacity):
            seconds = self.cost.step_time(chunks)
            self.scheduler.step_cost.observe(StepShape.of_chunks(chunks), seconds)

    def run(self, trace: list[Arrival], until: float | None = None) -> SimResult:
        """Replay the trace until every request is done (or virtual time `until`)."""
        pending = deque(trace)
        sched = self.scheduler
        while pending or sched.has_unfinished():
            if until is not None and self.now >= until:
                break
            while pending and pending[0].time <= self.now:
                self._arrive(pending.popleft())
            self._cancel_due()
            if sched.has_unfinished():
                out = sched.schedule()
                self._rejected()
                if out.requests:
                    self._step(out)
                    continue
            upcoming = [t for t in (pending[0].time if pending else None, self._next_cancel()) if t]
            if not upcoming:
                if sched.has_unfinished():
                    raise RuntimeError("the scheduler made no progress with nothing to wait for")
                break
            self.now = max(self.now, min(upcoming))
        for record in self.records.values():
            if record.outcome == "waiting":
                record.end = self.now
        return SimResult(
            self.records,
            self.now,
            self.num_steps,
            sched.num_preemptions,
            sched.num_priority_preemptions,
            dict(self._contended),
            max(self._kv_used, default=0.0),
            sum(self._kv_used) / max(1, len(self._kv_used)),
            self._error_sum / max(1, self.num_steps),
        )

    def _arrive(self, a: Arrival) -> None:
        s = a.stream
        record = self.records[a.request_id] = RequestRecord(
            a, arrival_step=self.num_steps, running_at_arrival=len(self.scheduler.running)
        )
        base = len(self.records) * 1_000_003  # distinct prompts: no accidental cache hits
        prompt = list(range(base, base + a.prompt_tokens))
        asked = EngineRequest(
            prompt,
            SamplingParams(max_tokens=a.output_tokens, ignore_eos=True),
            a.request_id,
            priority=s.priority,
            tenant=s.tenant,
            weight=s.weight,
            deadline=None if s.deadline_s is None else a.time + s.deadline_s,
        )
        (req,) = fan_out(asked, prompt, a.prompt_tokens + a.output_tokens, arrival_time=a.time)
        try:
            self.scheduler.check_admission(a.prompt_tokens, req.deadline, req.priority)
        except (OverloadedError, DeadlineExceededError) as exc:
            record.outcome, record.end = exc.kind, self.now
            return
        self.scheduler.add_request(req)
        if a.cancel_at is not None:
            heapq.heappush(self._cancels, (a.cancel_at, a.request_id))

    def _next_cancel(self) -> float | None:
        return self._cancels[0][0] if self._cancels else None

    def _cancel_due(self) -> None:
        while self._cancels and self._cancels[0][0] <= self.now:
            _, request_id = heapq.heappop(self._cancels)
            if self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED):
                record = self.records[request_id]
                record.outcome, record.end = "cancelled", self.now

    def _rejected(self) -> None:
        for req in self.scheduler.take_rejected():
            record = self.records[req.request_id]
            record.outcome, record.end = req.rejection or "rejected", self.now

    def _step(self, out: SchedulerOutput) -> None:
        sched = self.scheduler
        waiting_tenants = sched.waiting.tenants()
        for item in out.requests:
            record = self.records[item.request_id]
            if record.first_scheduled is None:
                record.first_scheduled = self.now
                record.first_step = self.num_steps
            if len(waiting_tenants) > 1:
                tenant = record.arrival.stream.tenant
                self._contended[tenant] = self._contended.get(tenant, 0) + len(item.token_ids)
        bm = self.block_manager
        self._kv_used.append(bm.num_used_blocks / bm.num_blocks)
        dt = self.cost.step_time([(r.start_pos, len(r.token_ids)) for r in out.requests])
        predicted = sched.step_cost.predict(StepShape.of(out))
        self._error_sum += abs(predicted - dt) / dt if dt > 0 else 0.0
        self.now += dt
        self.num_steps += 1
        sched.record_step(out.num_prefill_tokens, out.num_decode_tokens, dt)
        sched.observe_step(out, dt)
        sampled = {r.request_id: FAKE_TOKEN for r in out.requests if r.sample}
        for req, _ in sched.update_from_output(out, ModelRunnerOutput(sampled)):
            record = self.records[req.request_id]
            record.token_times.append(self.now)
            record.preemptions = req.num_preemptions
            if req.first_token_time is None:
                req.first_token_time = record.first_token = self.now
            if len(req.output_token_ids) >= req.params.max_tokens:
                sched.finish_requests([req.request_id], RequestStatus.FINISHED_LENGTH)
                record.outcome, record.end = "finished", self.now
