"""The synchronous engine: step() = admit -> schedule -> run -> sample -> update.

add_request() and abort() may be called from any thread; everything else runs on the one
thread that calls step(). New requests and aborts wait in an inbox until a step boundary."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from backend.config import EngineConfig
from backend.engine.batch import PLACEHOLDER, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from backend.engine.block_manager import BlockManager
from backend.engine.lora import AdapterSlots
from backend.engine.model_runner import Launched, ModelRunner
from backend.engine.request import Request, RequestStatus, fan_out
from backend.engine.scheduler import Scheduler
from backend.engine.speculative import Speculator, draft_cost_ratio
from backend.engine.step_cost import warm_up, warm_up_shapes
from backend.errors import (
    GrammarTooComplexError,
    InvalidParameterError,
    OverloadedError,
    PromptTooLongError,
    RequestFailedError,
    RequestStepError,
    UnknownAdapterError,
)
from backend.grammar import GrammarCompiler
from backend.layers.kv_quant import kv_bytes_per_token
from backend.loader import resolve_device
from backend.models.config import load_model_config
from backend.outputs import EngineStats, RequestOutput, TokenLogprobs
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from backend.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)

EMBED_ID = "\0embed"  # an embedding's block table: no request id has a NUL
# Steps failing in a row with no request to blame: past this, the fault is the engine's
# own (a CUDA error is sticky), so the step loop ends and the health probes fail.
MAX_FAILED_STEPS = 3


class _GaveWay(Exception):
    """Raised between the layers of a step abandoned for a newcomer (Engine._give_way)."""


@dataclass(frozen=True)
class _InFlight:
    """A step launched asynchronously, not read back yet."""

    batch: SchedulerOutput
    launched: Launched
    placed: list[tuple[Request, int]]  # its placeholders (scheduler.advance)
    started: float  # time.monotonic() at launch


class _Landing:
    """The step in flight, read back and processed once (a call): inside the next
    step's launch when that step's sampling needs its tokens, else after the launch.
    `failed`: what reading it back raised (the engine's own fault: not retried)."""

    def __init__(
        self, land: Callable[[_InFlight], list[RequestOutput]], flight: _InFlight | None
    ) -> None:
        self._land, self._flight = land, flight
        self.outputs: list[RequestOutput] = []
        self.failed: Exception | None = None

    def __call__(self) -> None:
        flight, self._flight = self._flight, None
        if flight is None:
            return
        try:
            self.outputs += self._land(flight)
        except Exception as exc:
            self.failed = exc
            raise


def _needs_tokens(batch: SchedulerOutput) -> bool:
    """Whether a row samples with a grammar's mask or penalties while its last output
    token is still on the device (a PLACEHOLDER in the request's own list)."""
    return any(
        r.sample
        and (r.matcher is not None or r.params.penalized)
        and r.output_token_ids
        and r.output_token_ids[-1] == PLACEHOLDER
        for r in batch.requests
    )


@dataclass
class _Seq:
    """One completion between add_request and its final output, with its text state."""

    request: Request
    detok: IncrementalDetokenizer
    text: str = ""  # all output text so far (cut at a stop string)
    sent: int = 0  # characters of `text` already handed out


class Engine:
    def __init__(self, model_dir: Path | str, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        self.config = config = config.on_device(resolve_device(config.device).type)
        self.model_dir = Path(model_dir)
        self.model_config = load_model_config(self.model_dir)
        self.tokenizer = Tokenizer(self.model_dir)
        context = self.model_config.max_position_embeddings
        wanted = min(config.max_model_len or context, context)
        self.runner = ModelRunner(
            self.model_dir, self.model_config, config, wanted, self.tokenizer.eos_token_ids
        )
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.max_model_len = self._fit_max_model_len(wanted)
        self.scheduler = Scheduler(config, self.block_manager)
        self.adapters: AdapterSlots | None = None
        if config.max_loras:
            layers = self.runner.lora_layers
            self.adapters = AdapterSlots(layers, config.max_loras, config.max_lora_rank)
            self.scheduler.adapters = self.adapters
        self.speculator: Speculator | None = None
        if config.speculative_method != "off":
            drafter = self.runner.drafter
            cost = 0.0 if drafter is None else draft_cost_ratio(drafter.model, self.runner.model)
            self.speculator = Speculator(
                config.speculative_method, config.num_speculative_tokens, cost
            )
        # With speculation, steps with drafts still run in turn (_step_async).
        self.async_scheduling = config.async_scheduling == "on" or (
            config.async_scheduling == "auto" and self.runner.device.type == "cuda"
        )
        self.grammars = GrammarCompiler(
            self.model_dir / "tokenizer.json",
            max(self.model_config.vocab_size, self.tokenizer.vocab_size),
            self.tokenizer.eos_token_ids,
            share_cache=config.share_prefix_cache,  # kept per tenant as the prefix cache is
        )
        log.info("%s", self.describe())
        self.num_steps = 0
        self.busy_s = 0.0  # seconds spent in step(), cumulative
        # Of busy_s, the batch class's part: each step's time split by its rows' tokens.
        self.batch_busy_s = 0.0
        # Of the step read back in this step() (async: its wait is most of the call).
        self._step_batch_fraction = 0.0
        self.num_failed_requests = 0  # failed by a fault while stepping them
        self._failed_steps = 0  # in a row
        self._step_tokens = (0, 0)  # prefill, decode tokens of the last step
        self._total_tokens = (0, 0)
        self._lock = threading.Lock()
        self._inbox: list[Request] = []
        self._inbox_tokens = 0  # their prompts' tokens, for admission
        self._inbox_seen = 0  # of the inbox, the requests the step in flight has looked at
        self.num_steps_given_way = 0  # abandoned for a newcomer (_run_sync)
        self._gave_way = False  # the last step was: the next one runs to its end
        self._may_give_way = False  # the step running now may (_interruptible)
        self._aborts: list[Request] = []
        self._groups: dict[str, list[Request]] = {}  # caller's id -> its n completions
        self._seqs: dict[str, _Seq] = {}  # engine key -> completion state
        self._in_flight: _InFlight | None = None
        self._warm_up()
        self.runner.between_layers = self._give_way

    def _warm_up(self) -> None:
        """Time a few steps before the first request: the step-cost fit is never blind."""
        bm = self.block_manager
        capacity = min(bm.num_blocks * bm.block_size, self.max_model_len)
        steps = warm_up_shapes(self.config.max_num_batched_tokens, capacity)
        warm_up(
            self.scheduler.step_cost, steps, self.runner.execute, bm, self.model_config.vocab_size
        )

    def _fit_max_model_len(self, wanted: int) -> int:
        """One sequence of max_model_len must fit the pool, or preemption could never
        make room for it. An explicit max_model_len that does not fit is an error; the
        default shrinks to what fits."""
        bm = self.block_manager
        capacity = bm.num_blocks * bm.block_size
        if wanted <= capacity:
            return wanted
        if self.config.max_model_len is not None or capacity < 2:
            raise ValueError(
                f"the KV pool has {bm.num_blocks} blocks of {bm.block_size} tokens, "
                f"too few for one sequence of max_model_len={wanted}"
            )
        log.info("max_model_len capped at %d tokens: the KV pool holds no more", capacity)
        return capacity

    def describe(self) -> str:
        """The one start-up line: where it runs, and how much the KV pool holds."""
        runner, bs = self.runner, self.config.block_size
        per_seq = -(-self.max_model_len // bs)  # blocks one sequence of max_model_len needs
        kv_bytes = runner.kv_cache.numel() * runner.kv_cache.element_size()
        return (
            f"engine: device={runner.device} dtype={str(runner.dtype).removeprefix('torch.')} "
            f"quantization={self.config.quantization} "
            f"kv_cache_dtype={str(runner.kv_dtype).removeprefix('torch.')} "
            f"kv_bytes_per_token={kv_bytes_per_token(self.model_config, runner.kv_dtype)} "
            f"attention={runner.attention_name} kv_blocks={runner.num_blocks} "
            f"kv_bytes={kv_bytes} ({kv_bytes / 2**30:.2f} GiB) "
            f"max_seqs_at_max_model_len={runner.num_blocks // per_seq} "
            f"(max_model_len={self.max_model_len}) "
            f"cuda_graphs={'on' if runner.use_cuda_graphs else 'off'} "
            f"async_scheduling={'on' if self.async_scheduling else 'off'}"
            f"{self._describe_speculation()}"
        )

    def _describe_speculation(self) -> str:
        cfg, drafter = self.config, self.runner.drafter
        if cfg.speculative_method == "off":
            return ""
        line = f" speculative={cfg.speculative_method} k={cfg.num_speculative_tokens}"
        if self.speculator is not None:
            line += f" min_acceptance={self.speculator.min_acceptance:.2f}"
        if drafter is not None and drafter.kv_cache is not None:
            line += f" draft_kv_bytes={drafter.kv_cache.numel() * drafter.kv_cache.element_size()}"
        return line

    # -- any thread ---------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        """Validate and queue a request. Raises InvalidParameterError for a prompt the
        caller must change (PromptTooLongError when it does not fit, ConstraintError for a
        constraint that cannot be compiled), ValueError for ids or weights the gateway got
        wrong, OverloadedError (the waiting queue is full) or
        DeadlineExceededError (the first token cannot come by its deadline) in the caller's
        thread."""
        request_id, params, weight = request.request_id, request.params, request.weight
        if not isinstance(weight, int) or isinstance(weight, bool) or weight < 1:
            raise ValueError(f"weight must be a positive integer, got {weight!r}")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or "\0" in request_id:
            raise ValueError("request_id must be a string without NUL characters")
        ids = self._prompt_ids(request.prompt)
        vocab = self.model_config.vocab_size
        if any(token >= vocab for token in params.logit_bias):
            raise InvalidParameterError(
                f"logit_bias token ids must be in [0, {vocab})", "logit_bias"
            )
        self._check_adapter(request)
        reqs = fan_out(
            request,
            ids,
            min(len(ids) + params.max_tokens, self.max_model_len),
            cache_salt=self._cache_salt(request),
            arrival_time=self.scheduler.clock(),  # the clock that ages it
        )
        if params.constraint is not None:
            for req in reqs:  # compiled once (then cached); each completion its own matcher
                req.matcher = self.grammars.matcher(params.constraint, request.tenant)
        with self._lock:
            if request_id in self._groups:
                raise ValueError(f"request id {request_id!r} is already in the engine")
            pending = (len(self._inbox), self._inbox_tokens)
            self.scheduler.check_admission(
                len(ids), request.deadline, request.priority, len(reqs), pending
            )
            self._groups[request_id] = reqs
            for req in reqs:
                self._seqs[req.request_id] = _Seq(req, IncrementalDetokenizer(self.tokenizer, ids))
            self._inbox += reqs
            self._inbox_tokens += sum(r.num_tokens for r in reqs)

    def _check_adapter(self, request: EngineRequest) -> None:
        """Raises a LoRAError for an adapter this engine cannot serve."""
        if request.lora is None:
            return
        if self.adapters is None:
            raise UnknownAdapterError("this engine serves no LoRA adapters (max_loras is 0)")
        self.adapters.check(request.lora)

    def _cache_salt(self, request: EngineRequest) -> str | None:
        """The tenant (unless the cache is shared) and the adapter: a prefix computed with
        one adapter's weights is never reused by another, nor by the base model."""
        salt = None if self.config.share_prefix_cache else request.tenant
        lora = request.lora
        if lora is None:
            return salt
        return f"{salt or ''}\0lora\0{lora.name}\0{lora.path}"

    def embedding_prompt(self, prompt: str | list[int]) -> list[int]:
        """A prompt to embed, validated as add_request validates one (any thread)."""
        return self._prompt_ids(prompt)

    def abort(self, request_id: str) -> None:
        """Idempotent; takes effect at the next step boundary. Unknown or finished ids are
        ignored. The abort is bound to the request live now, not to a later one reusing
        the id. Aborts every completion of an n > 1 request."""
        with self._lock:
            reqs = self._groups.get(request_id)
            if reqs is not None:
                self._aborts += reqs

    def has_work(self) -> bool:
        with self._lock:
            pending = bool(self._inbox or self._aborts)
        return pending or self._in_flight is not None or self.scheduler.has_unfinished()

    def num_interactive(self) -> int:
        """Interactive (below the batch class) requests submitted, running or waiting:
        a batch runner starts no line while there are any (gateway/batches/runner.py)."""
        batch = self.scheduler.config.batch_priority
        with self._lock:
            queued = sum(req.priority < batch for req in self._inbox)
        return queued + self.scheduler.num_interactive()

    def stats(self) -> EngineStats:
        bm, sched = self.block_manager, self.scheduler
        cost = sched.step_cost
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting) + len(self._inbox),
            num_interactive=self.num_interactive(),
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_free=bm.num_free_blocks - bm.num_cached_blocks,
            block_size=bm.block_size,
            num_steps=self.num_steps,
            busy_s=self.busy_s,
            batch_busy_s=self.batch_busy_s,
            kv_blocks_cached=bm.num_cached_blocks,
            prefix_cache_queries=sched.prefix_cache_queries,
            prefix_cache_hits=sched.prefix_cache_hits,
            num_preemptions=sched.num_preemptions,
            num_priority_preemptions=sched.num_priority_preemptions,
            num_slot_share_preemptions=sched.num_slot_share_preemptions,
            num_steps_given_way=self.num_steps_given_way,
            num_rejected_overloaded=sched.num_rejected_overloaded,
            num_rejected_deadline=sched.num_rejected_deadline,
            waiting_tokens=sched.waiting.num_tokens,
            step_prefill_tokens=self._step_tokens[0],
            step_decode_tokens=self._step_tokens[1],
            total_prefill_tokens=self._total_tokens[0],
            total_decode_tokens=self._total_tokens[1],
            step_time_predicted_s=cost.last_predicted_s,
            step_time_actual_s=cost.last_actual_s,
            step_time_error_ratio=cost.relative_error,
            step_cost_s=cost.coefficients,
            step_time_limit_s=sched.step_limit_s,
            step_prefill_budget=sched.step_prefill_budget,
            **self._spec_stats(),
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict[str, Any]:
        if self.adapters is None:
            return {}
        running, waiting = self.scheduler.adapters_in_use
        return {
            "max_lora": self.adapters.max_loras,
            "running_lora_adapters": running,
            "waiting_lora_adapters": waiting,
            "loaded_lora_adapters": list(self.adapters.loaded),
            "lora_loads": self.adapters.num_loads,
        }

    def _spec_stats(self) -> dict[str, Any]:
        if self.speculator is None:
            return {}
        c = self.speculator.counters
        return {
            "speculative_method": self.speculator.method,
            "spec_decode_num_drafts": c.num_drafts,
            "spec_decode_num_draft_tokens": c.num_draft_tokens,
            "spec_decode_num_accepted_tokens": c.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(c.accepted_per_pos),
        }

    # -- the step thread ----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        step_started = time.perf_counter()
        self._step_batch_fraction = 0.0
        try:
            return self._step(step_started)
        finally:  # the engine's busy time: its share of the wall clock is its load
            busy = time.perf_counter() - step_started
            self.busy_s += busy
            self.batch_busy_s += busy * self._step_batch_fraction

    def _step(self, step_started: float) -> list[RequestOutput]:
        with self._lock:
            inbox, self._inbox, self._inbox_tokens = self._inbox, [], 0
            self._inbox_seen = 0
        for req in inbox:
            self.scheduler.add_request(req)
        outputs = self._apply_aborts()
        if self.async_scheduling:
            return outputs + self._step_async(step_started)
        batch = self.scheduler.schedule()
        outputs += self._rejected()
        return outputs + self._run_sync(batch, step_started)

    def _run_sync(self, batch: SchedulerOutput, step_started: float) -> list[RequestOutput]:
        started = time.monotonic()
        self._may_give_way = self._interruptible()
        try:
            result = self.runner.execute(batch)
        except _GaveWay:  # nothing advanced: the next step schedules these rows again
            self.num_steps_given_way += 1
            self._gave_way = True
            return []
        except Exception as exc:
            self._may_give_way = False
            return self._recover(batch, exc, started, step_started)
        finally:
            self._may_give_way = False
        self._gave_way = False
        self._failed_steps = 0
        if not batch.requests:
            return []
        return self._complete(batch, result, time.monotonic() - started, step_started)

    def _interruptible(self) -> bool:
        """Whether this step may give way: on a CPU a step's time grows with its rows, so
        a newcomer that arrives during a step of another tenant's many rows waits for all
        of it (issue 32: up to 30 ms of its 50 ms TTFT p95) before its own short,
        protected step. Such a step (holding nothing back: no protected work in it) is
        abandoned at the next layer instead (_give_way), and its rows run again after
        the newcomer's step (as filler in it, then in full). At most every other step
        gives way, so the streams always progress; not with drafts (their state advances
        while drafting)."""
        if self._gave_way or self.speculator is not None or self.scheduler.protecting:
            self._gave_way = False
            return False
        return True

    def _give_way(self) -> None:
        """Before each layer of a step (ModelRunner.between_layers): raise _GaveWay if the
        step may give way and a request that arrived since it began would be protected in
        the next step (Scheduler.gives_way_to)."""
        if not self._may_give_way or len(self._inbox) == self._inbox_seen:  # no lock taken
            return
        with self._lock:
            new, self._inbox_seen = self._inbox[self._inbox_seen :], len(self._inbox)
        if any(self.scheduler.gives_way_to(req) for req in new):
            raise _GaveWay

    def _recover(
        self, batch: SchedulerOutput, exc: Exception, started: float, step_started: float
    ) -> list[RequestOutput]:
        apart = self._run_apart(batch, exc)
        if apart is None:
            return self._fail_step(batch.requests, exc)
        result, outputs = apart
        self._failed_steps = 0
        return outputs + self._complete(batch, result, time.monotonic() - started, step_started)

    def _complete(
        self,
        batch: SchedulerOutput,
        result: ModelRunnerOutput,
        run_s: float,
        step_started: float,
        placed: list[tuple[Request, int]] | None = None,
    ) -> list[RequestOutput]:
        """A step's tokens, read back: progress, stop checks, text. `placed`: the step
        was launched asynchronously and advanced then (its placeholders to resolve)."""
        self._step_batch_fraction = self._batch_fraction(batch)
        self.scheduler.record_step(batch.num_prefill_tokens, batch.num_decode_tokens, run_s)
        # Aborts that arrived during the forward pass win over its tokens.
        outputs = self._apply_aborts()
        if placed is None:
            new_tokens = self.scheduler.update_from_output(batch, result)
        else:
            new_tokens = self.scheduler.resolve(placed, result)
        for req, tokens in new_tokens:
            try:
                outputs.append(self._process_tokens(req, tokens, result))
            except GrammarTooComplexError:  # the client's grammar: it fails alone, a 400
                outputs += self._fail([req.request_id], GrammarTooComplexError.kind)
            except Exception:
                log.exception("failed to process a sampled token; failing its request")
                outputs += self._fail([req.request_id])
        if self.speculator is not None:
            self._observe_drafts(batch, result)
            self.speculator.propose(self.scheduler.running)
        self.num_steps += 1
        self.scheduler.observe_step(batch, time.perf_counter() - step_started)
        self._step_tokens = (batch.num_prefill_tokens, batch.num_decode_tokens)
        prefill, decode = self._total_tokens
        self._total_tokens = (prefill + batch.num_prefill_tokens, decode + batch.num_decode_tokens)
        return outputs

    def _batch_fraction(self, batch: SchedulerOutput) -> float:
        """The share of a step's tokens computed for batch-class rows (priority at or
        above batch_priority), read before its finished requests leave."""
        floor, live = self.config.batch_priority, self.scheduler.requests
        total = batch_tokens = 0
        for item in batch.requests:  # one pass: the step thread runs this every step
            tokens = len(item.token_ids)
            total += tokens
            req = live.get(item.request_id)
            if req is not None and req.priority >= floor:
                batch_tokens += tokens
        return batch_tokens / total if total else 0.0

    # -- async scheduling: step N + 1 is scheduled and launched before N is read back --

    def _step_async(self, step_started: float) -> list[RequestOutput]:
        """Schedule and launch the next step while the one in flight runs on the device,
        then read that one back and process its tokens while the new one runs: the
        host's work hides behind the device's. Rows still decoding take their input from
        the step in flight, on the device (PLACEHOLDER on the host until read back). A
        request that finishes on a token of the step in flight wasted its row in the next
        one: that row's token is dropped.

        Rows whose sampling needs their last token on the host (a grammar's mask,
        penalties over the output) do not stop the overlap: the new step's forward pass
        is launched first, the step in flight is read back while it runs, and only then
        are the new step's sampling inputs staged (ModelRunner.launch's `land`).
        Speculative decoding is the exception: a step with drafts places a request's
        next tokens by its accepted count, and drafts continue from the last token, so
        while any running request has drafts proposed the step in flight is read back
        before the next is scheduled, and a step with drafts runs synchronously. Steps
        without drafts (speculation paused, or rows it cannot take) overlap."""
        outputs: list[RequestOutput] = []
        flight, self._in_flight = self._in_flight, None
        if flight is not None and self._drafting():
            outputs += self._land(flight, step_started)
            flight = None
        batch = self.scheduler.schedule()
        outputs += self._rejected()
        if not batch.requests:
            self.runner.execute(batch)  # the runner drops the finished requests' state
            return outputs + (self._land(flight, step_started) if flight else [])
        if any(r.num_drafts for r in batch.requests):  # flight is None: see _drafting
            return outputs + self._run_sync(batch, step_started)
        landing = _Landing(lambda f: self._land(f, step_started), flight)
        early = landing if flight is not None and _needs_tokens(batch) else None
        started = time.monotonic()
        try:
            launched = self.runner.launch(batch, flight.launched if flight else None, early)
        except Exception as exc:
            if exc is landing.failed:  # reading the step in flight back failed: as ever
                raise
            landing()
            outputs += landing.outputs
            return outputs + self._recover(self._resolved(batch), exc, started, step_started)
        landing()
        placed = self.scheduler.advance(batch)
        self._in_flight = _InFlight(batch, launched, placed, started)
        return outputs + landing.outputs

    def _land(self, flight: _InFlight, step_started: float) -> list[RequestOutput]:
        """Read a launched step back (the wait) and process its tokens."""
        try:
            result = flight.launched.collect()
        except Exception as exc:  # already advanced: its requests cannot simply rerun
            return self._fail_step(flight.batch.requests, exc)
        self._failed_steps = 0
        run_s = time.monotonic() - flight.started
        return self._complete(flight.batch, result, run_s, step_started, flight.placed)

    def _drafting(self) -> bool:
        """Whether a running request has drafts proposed for its next step: it must see
        its tokens of the step in flight first."""
        return self.speculator is not None and any(r.spec_token_ids for r in self.scheduler.running)

    def _resolved(self, batch: SchedulerOutput) -> SchedulerOutput:
        """The batch with its placeholders replaced by the tokens read back since (rows of
        requests finished meanwhile dropped), to run synchronously after a failed launch."""
        live = self.scheduler.requests
        items = []
        for item in batch.requests:
            req = live.get(item.request_id)
            if req is None:
                continue
            end = item.start_pos + len(item.token_ids)
            items.append(replace(item, token_ids=req.token_ids(item.start_pos, end)))
        return replace(batch, requests=items)

    def embed(self, prompts: list[list[int]]) -> list[list[float]]:
        """The mean-pooled final hidden states of each prompt (from embedding_prompt), in
        one pass when there are several (take_embedding_batch sizes them to a step's
        budget) or in chunks for one long prompt. On the step thread, between steps: it
        borrows free KV blocks for the pass and gives them back. Raises OverloadedError
        when running requests hold too many of them."""
        bm = self.block_manager
        owners = [f"{EMBED_ID}{i}" for i in range(len(prompts))]
        try:
            for owner, prompt in zip(owners, prompts, strict=True):
                if bm.allocate_slots(owner, len(prompt)) is None:
                    raise OverloadedError("the KV cache has no room for this input now; retry", 1.0)
            return self.runner.embed(prompts, [bm.block_ids(owner) for owner in owners])
        finally:
            for owner in owners:
                bm.free(owner)  # a no-op for an owner with no blocks

    def take_embedding_batch(self, prompts: list[list[int]]) -> int:
        """How many of `prompts`, from the first, one embedding pass takes: as many as
        fit max_num_batched_tokens together, each counted in whole KV blocks (the pass
        borrows no more of the pool than a step's budget), at least one (a longer one
        is chunked)."""
        budget, size = self.config.max_num_batched_tokens, self.config.block_size
        taken = slots = 0
        for prompt in prompts:
            slots += -(-len(prompt) // size) * size
            if taken and slots > budget:
                break
            taken += 1
        return taken

    def _run_apart(
        self, batch: SchedulerOutput, exc: Exception
    ) -> tuple[ModelRunnerOutput, list[RequestOutput]] | None:
        """A step of several requests failed without naming one: run each alone, keep the
        tokens of those that pass and fail only those that fail alone, so one request's
        poison (a parameter, a grammar) never fails the others. None where that cannot
        help: the error named its requests, the step had one, or every request fails
        alone (the fault is the engine's: _fail_step). Costs a pass per request, on the
        failure path only."""
        if isinstance(exc, RequestStepError) or len(batch.requests) < 2:
            return None
        log.warning(
            "an engine step of %d requests failed (%s); running each alone",
            len(batch.requests),
            type(exc).__name__,
        )
        merged = ModelRunnerOutput({})
        culprits: list[str] = []
        finished = batch.finished_request_ids
        for item in batch.requests:
            alone = SchedulerOutput([item], finished)
            finished = []  # the runner drops those once
            try:
                result = self.runner.execute(alone)
            except Exception:
                log.exception("request %s fails alone; failing it", item.request_id)
                culprits.append(item.request_id)
                continue
            merged.sampled.update(result.sampled)
            merged.logprobs.update(result.logprobs)
        if len(culprits) == len(batch.requests):
            return None
        return merged, self._fail(culprits)

    def _fail_step(self, scheduled: list[ScheduledRequest], exc: Exception) -> list[RequestOutput]:
        """A step that raised changed nothing the next step relies on (progress advances
        only after it), so the requests it did not blame simply run again. A
        RequestStepError names the requests at fault; any other error fails the whole
        step's requests, and MAX_FAILED_STEPS of those in a row end the loop."""
        if isinstance(exc, RequestStepError):
            log.warning("%s", exc)  # ids and counts only: no prompt text in logs
            return self._fail(exc.request_ids)
        self._failed_steps += 1
        if self._failed_steps >= MAX_FAILED_STEPS:
            raise exc
        log.exception("an engine step failed; failing its %d request(s)", len(scheduled))
        return self._fail([r.request_id for r in scheduled])

    def _fail(
        self, request_ids: list[str], kind: str = RequestFailedError.kind
    ) -> list[RequestOutput]:
        """Finish these requests with an error of `kind` (request_failed unless the fault
        is known); their siblings (n > 1) are aborted, as after a rejection."""
        outputs = []
        for req in self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_FAILED):
            req.rejection = kind
            self.num_failed_requests += 1
            outputs.append(self._finish(req))
            self.abort(req.external_id)
        return outputs

    def _rejected(self) -> list[RequestOutput]:
        """Final outputs of requests the policy rejected; their siblings are aborted."""
        outputs = []
        for req in self.scheduler.take_rejected():
            outputs.append(self._finish(req))
            self.abort(req.external_id)
        return outputs

    def _apply_aborts(self) -> list[RequestOutput]:
        with self._lock:
            reqs, self._aborts = self._aborts, []
        live = self.scheduler.requests
        ids = [r.request_id for r in reqs if live.get(r.request_id) is r]
        done = self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        return [self._finish(req) for req in done]

    def _observe_drafts(self, batch: SchedulerOutput, result: ModelRunnerOutput) -> None:
        assert self.speculator is not None
        for item in batch.requests:
            tokens = result.verified.get(item.request_id) if item.num_drafts else None
            if tokens is not None:
                self.speculator.observe(item.request_id, item.num_drafts, len(tokens) - 1)

    def _process_tokens(
        self, req: Request, tokens: list[int], result: ModelRunnerOutput
    ) -> RequestOutput:
        """One output for a step's tokens (several from a row with accepted drafts), each
        checked for a stop in turn: the tokens after one are dropped."""
        if len(tokens) == 1:
            return self._process_token(req, tokens[0], result.logprobs.get(req.request_id))
        del req.output_token_ids[len(req.output_token_ids) - len(tokens) + 1 :]
        merged = self._process_token(req, tokens[0], None)
        for token in tokens[1:]:
            if req.is_finished:
                break
            req.output_token_ids.append(token)
            merged = merged.then(self._process_token(req, token, None))
        return merged

    def _process_token(
        self, req: Request, token: int, logprobs: TokenLogprobs | None
    ) -> RequestOutput:
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
        state = self._seqs[req.request_id]
        status = self._stop_status(req, token)
        old_len = len(state.text)
        if status != RequestStatus.FINISHED_STOPPED:  # a stop token's text is never shown
            state.text += state.detok.step(token)
            if req.matcher is not None and req.matcher.advance(token):
                status = RequestStatus.FINISHED_STOPPED  # the grammar is complete
        if status is not None:
            state.text += state.detok.flush()
        stops = req.params.stop
        if stops and len(req.output_token_ids) >= req.params.min_tokens:
            cut = _find_stop(state.text, stops, old_len)
            if cut is not None:
                state.text, status = state.text[:cut], RequestStatus.FINISHED_STOPPED
        # Hold back a tail that could still become a stop string.
        hold = 0 if status is not None or not stops else max(map(len, stops)) - 1
        end = max(len(state.text) - hold, state.sent)
        delta, state.sent = state.text[state.sent : end], end
        lps = None if logprobs is None else [logprobs]
        if status is None:
            return self._output(req, delta, [token], [now], lps)
        self.scheduler.finish_requests([req.request_id], status)
        self._forget(req)
        return self._output(req, delta, [token], [now], lps)

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        p = req.params
        # Below min_tokens the sampler masked EOS and stop tokens: they cannot end it.
        is_eos = not p.ignore_eos and token in self.tokenizer.eos_token_ids
        if (is_eos or token in p.stop_token_ids) and len(req.output_token_ids) > p.min_tokens:
            return RequestStatus.FINISHED_STOPPED
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= req.max_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request) -> RequestOutput:
        """The last output of a request that ended with no new token (failed, rejected,
        aborted)."""
        self._forget(req)
        return self._output(req, "", [], [], None)

    def _forget(self, req: Request) -> None:
        """Drop a finished request's state: its drafts, its detokenizer, and its group of
        completions (n > 1) once every one has finished."""
        if self.speculator is not None:
            self.speculator.forget(req.request_id)
        with self._lock:
            self._seqs.pop(req.request_id, None)
            group = self._groups.get(req.external_id)
            if group is not None and all(r.is_finished for r in group):
                del self._groups[req.external_id]

    def _output(
        self,
        req: Request,
        text: str,
        token_ids: list[int],
        times: list[float],
        logprobs: list[TokenLogprobs] | None,
    ) -> RequestOutput:
        if logprobs is None and req.params.logprobs is not None:
            logprobs = []  # asked for, and none are new in this delta
        return RequestOutput(
            request_id=req.external_id,
            text=text,
            token_ids=token_ids,
            finished=req.is_finished,
            finish_reason=req.status.finish_reason,
            prompt_tokens=req.num_prompt_tokens,
            completion_tokens=len(req.output_token_ids),
            cached_tokens=req.num_cached_tokens or 0,
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            token_times=times,
            index=req.index,
            prefill_chunks=req.num_prefill_chunks,
            logprobs=logprobs,
            error=req.rejection,
            retry_after_s=req.retry_after_s,
        )

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
            ids = list(prompt)
        else:
            raise InvalidParameterError("prompt must be a string or a list of token ids", "prompt")
        if not ids:
            raise InvalidParameterError("prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidParameterError(f"prompt token ids must be in [0, {vocab})", "prompt")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(len(ids), self.max_model_len)
        return ids


def _find_stop(text: str, stops: list[str], old_len: int) -> int | None:
    """Start of the earliest stop string that ends in the new part of `text`."""
    longest = max(map(len, stops))
    start = max(old_len - longest + 1, 0)
    hits = [i for s in stops if (i := text.find(s, start)) != -1]
    return min(hits) if hits else None
