"""The asyncio front: the engine steps in its own thread; each step's outputs are handed
to the event loop with call_soon_threadsafe, into one asyncio.Queue per request.

A batch-class request's outputs wait while interactive work is in the engine (for
BATCH_HOLD_S at most): what a batch request does on the event loop at each output, and
its settlement after the last, would take the GIL from the step thread and the loop from
the interactive streams (bench/batch_fill.py). They are handed on, in order, once that
work has drained, each completion's deltas as one; the batch rows themselves go on in the
engine meanwhile. Without interactive work they go out every BATCH_COALESCE_S, and at the
end, likewise as one delta each."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from backend.config import EngineConfig
from backend.engine.engine import Engine
from backend.errors import (
    ConstraintError,
    DeadlineExceededError,
    EngineDeadError,
    GrammarTooComplexError,
    OverloadedError,
    RequestFailedError,
)
from backend.outputs import EngineStats, RequestOutput, coalesced
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from backend.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# The step thread and the event loop share the GIL: a thread that wants it waits up to
# the switch interval (CPython's default 5 ms) while the other runs Python. Beside a
# backlog's 32 streams that wait was most of a newcomer's admission delay (sent ->
# engine p95 18 ms, 7 ms at 1 ms; bench/README.md, issue 32), at no cost in throughput.
SWITCH_INTERVAL_S = 0.001

BATCH_HOLD_S = 1.0  # the longest a batch request's outputs wait for interactive work
# With no interactive work, a batch request's outputs still go out this often (and at its
# end), as one delta: a token per step would wake its consumer on the event loop ~100
# times a second, for a client that reads the answer whole (a batch line).
BATCH_COALESCE_S = 0.05


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    batch: bool = False  # its outputs wait while interactive work is in the engine
    held: list[RequestOutput] = field(default_factory=list)  # the step thread's
    held_since: float = 0.0


@dataclass
class _Embedding:
    """An embed() call: its prompts, embedded a step's token budget per turn of the step
    loop."""

    prompts: list[list[int]]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[list[float]]]
    vectors: list[list[float]] = field(default_factory=list)


class AsyncEngine:
    def __init__(self, engine: Engine, model_name: str | None = None) -> None:
        self.engine = engine
        self.model_name = model_name or engine.model_dir.name
        self._streams: dict[str, _Stream] = {}
        self._embeddings: list[_Embedding] = []  # waiting for the step thread, oldest first
        self._held: dict[str, _Stream] = {}  # batch streams with outputs held (step thread)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._error: BaseException | None = None  # what crashed the step loop
        self._dead: str | None = None  # why the loop has ended, once it has
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._run, name="tollgate-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, path: Path | str, config: EngineConfig | None = None) -> AsyncEngine:
        """Loads the checkpoint (blocking) and starts the step thread."""
        return cls(Engine(path, config))

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def has_crashed(self) -> bool:
        """True once the step loop has ended on an error (liveness probe)."""
        return self._error is not None

    def is_running(self) -> bool:
        """False once shut down or after the step loop crashed (readiness probe)."""
        return self._thread.is_alive() and not self._stopping and self._dead is None

    async def generate(self, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        """Yields deltas until every one of the params.n completions has yielded one with
        finished=True.
        Leaving early (break, aclose, task cancellation) aborts the request in the engine.
        Raises OverloadedError or DeadlineExceededError (before the first output) when the
        scheduling policy rejects the request."""
        request_id, params = request.request_id, request.params
        batch = request.priority >= self.engine.config.batch_priority
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), batch)
        with self._lock:  # the same lock _fail_all takes, so no stream is left unanswered
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already being generated")
            self._streams[request_id] = stream
        added = False
        unfinished = params.n
        try:
            if params.constraint is not None:  # compiled off this loop and the step thread
                await self.engine.grammars.prepare(params.constraint, request.tenant)
            self.engine.add_request(request)
            added = True
            self._wake.set()
            while unfinished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:
                    raise _rejection(item, params)
                unfinished -= item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if added and unfinished:
                self.abort(request_id)

    async def embed(self, prompts: Sequence[str | list[int]]) -> list[list[float]]:
        """Each prompt's mean-pooled final hidden states, computed on the step thread (at
        most a step's token budget of prompts between two steps, so running streams keep
        flowing). Raises
        InvalidParameterError or PromptTooLongError for a bad prompt, at once, and
        OverloadedError when the KV cache has no room for one."""
        ids = [self.engine.embedding_prompt(p) for p in prompts]
        loop = asyncio.get_running_loop()
        job = _Embedding(ids, loop, loop.create_future())
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            self._embeddings.append(job)
        self._wake.set()
        return await job.future  # cancelled: the step thread skips what is left of it

    def abort(self, request_id: str) -> None:
        """Thread-safe and idempotent; an unknown or finished id is a no-op."""
        self.engine.abort(request_id)
        self._wake.set()

    async def shutdown(self) -> None:
        """Stops the step thread; generators still running raise EngineDeadError."""
        self._stopping = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join)

    # -- the step thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                embedding = self._next_embedding()
                if embedding is not None:
                    self._embed_one(embedding)
                elif not self.engine.has_work():
                    self._dispatch([], drain=True)  # what was held: nothing is left
                    self._wake.wait()
                    self._wake.clear()
                    continue
                if self.engine.has_work():
                    self._dispatch(self.engine.step())
        except BaseException as exc:
            log.exception("engine step loop crashed")
            self._error = exc
        reason = f"engine stopped: {self._error!r}" if self._error else "engine is shut down"
        self._fail_all(reason)

    def _next_embedding(self) -> _Embedding | None:
        with self._lock:
            return self._embeddings[0] if self._embeddings else None

    def _embed_one(self, job: _Embedding) -> None:
        """Embed the job's next prompts (one pass); answer it once all are done or one
        failed."""
        outcome: list[list[float]] | BaseException | None = None  # None: nobody waits
        if not job.future.done():  # done already: the caller went away, drop the rest
            try:
                rest = job.prompts[len(job.vectors) :]
                job.vectors += self.engine.embed(rest[: self.engine.take_embedding_batch(rest)])
            except OverloadedError as exc:
                outcome = exc
            except Exception:  # this input's fault or the device's: the loop goes on
                log.exception("an embedding failed")
                outcome = RequestFailedError("the engine failed this embedding request")
            else:
                if len(job.vectors) < len(job.prompts):
                    return
                outcome = job.vectors
        with self._lock:
            self._embeddings.remove(job)
        if outcome is not None:
            _resolve(job, outcome)

    def _dispatch(self, outputs: list[RequestOutput], drain: bool = False) -> None:
        """A step's outputs, handed to each event loop in one call: a wake-up of the loop
        per step, not per token (call_soon_threadsafe writes to the loop's self-pipe).
        A batch stream's wait (while interactive work is in the engine, and between its
        deliveries) ends with `drain`."""
        if not outputs and not self._held:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        hold = self.engine.num_interactive() > 0 and not drain
        now = time.monotonic()
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:  # the consumer may have gone; its abort is on the way
                    continue
                if not stream.batch:
                    by_loop.setdefault(stream.loop, []).append((stream, out))
                    continue
                self._hold(out.request_id, stream, out, now)
                if not hold and out.finished:  # its last, with what waited
                    by_loop.setdefault(stream.loop, []).extend(self._release(out.request_id))
            for request_id, stream in list(self._held.items()):
                waited = now - stream.held_since
                if drain or waited > BATCH_HOLD_S or (not hold and waited >= BATCH_COALESCE_S):
                    by_loop.setdefault(stream.loop, []).extend(self._release(request_id))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed event loop: nobody listens
                loop.call_soon_threadsafe(_deliver, items)

    def _hold(self, request_id: str, stream: _Stream, out: RequestOutput, now: float) -> None:
        if not stream.held:
            stream.held_since = now
            self._held[request_id] = stream
        stream.held.append(out)

    def _release(self, request_id: str) -> list[tuple[_Stream, RequestOutput]]:
        """The stream's held outputs, oldest first, to hand on now (under self._lock: its
        consumer may have gone, and then nobody gets them)."""
        stream = self._held.pop(request_id, None)
        if stream is None:
            return []
        held, stream.held = stream.held, []
        if request_id not in self._streams:
            return []
        # One delta per completion, not one per held token: a second of a batch line's
        # tokens costs the event loop one wake-up of its consumer, not ~100.
        return [(stream, out) for out in coalesced(held)]

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            self._dead = reason
            streams = list(self._streams.values())
            embeddings, self._embeddings = self._embeddings, []
        for stream in streams:
            _put(stream, EngineDeadError(reason))
        for embedding in embeddings:
            _resolve(embedding, EngineDeadError(reason))


def _deliver(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.queue.put_nowait(out)


def _put(stream: _Stream, item: RequestOutput | BaseException) -> None:
    with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is listening
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)


def _resolve(job: _Embedding, outcome: list[list[float]] | BaseException) -> None:
    def settle() -> None:
        if job.future.done():  # cancelled meanwhile
            return
        if isinstance(outcome, BaseException):
            job.future.set_exception(outcome)
        else:
            job.future.set_result(outcome)

    with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is listening
        job.loop.call_soon_threadsafe(settle)


def _rejection(out: RequestOutput, params: SamplingParams) -> Exception:
    """The error a request the policy rejected, or a step failed, raises (out.error says
    why)."""
    if out.error == GrammarTooComplexError.kind and params.constraint is not None:
        field = params.constraint.field
        return ConstraintError(
            f"{field} became too complex for the parser to follow at this point of the "
            "output (a right-recursive rule grows with it: make it left-recursive; "
            "or fewer optional properties in one object)",
            field,
        )
    if out.error == RequestFailedError.kind:
        return RequestFailedError("the engine failed this request")
    if out.error == OverloadedError.kind:
        return OverloadedError(
            "the engine is overloaded: a more urgent request took this one's place",
            out.retry_after_s or 1.0,
        )
    return DeadlineExceededError("the first token could not come by the deadline")
