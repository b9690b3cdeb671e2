"""Running one admitted request through the engine: streamed as SSE, or whole.

Every exit path — completion, engine failure, client disconnect — aborts what is left
in the engine and settles exactly one usage row.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from backend import EngineDeadError, RequestOutput, SamplingParams, TokenLogprobs
from gateway.api.formats import Format, tool_calls_delta, with_tool_calls
from gateway.api.schemas import encode
from gateway.api.tools import ToolCall, ToolPlan, ToolStream
from gateway.dispatch.engine_client import RESTART, EngineClient
from gateway.errors import (
    ApiError,
    DeadlineExceeded,
    EngineUnavailable,
    InternalError,
    InvalidRequest,
    Overloaded,
)
from gateway.metering import FIRST_CHECKPOINT_WAIT_S, Charge, Outcome, UsageRecorder
from gateway.telemetry import current_request
from tenants.models import UsageStatus

DONE = b"data: [DONE]\n\n"


@dataclass
class Job:
    charge: Charge
    format: Format
    prompt: list[int]
    params: SamplingParams
    include_usage: bool = False
    timeout_s: float = 600.0
    first_token_s: float | None = None  # the client's ttft_deadline_ms, in seconds
    priority: int = 0
    echo: str = ""  # completions: the prompt text, sent back before the answer
    tools: ToolPlan | None = None  # chat: how the output's tool calls are found
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.monotonic)

    @property
    def first_token_within_s(self) -> float:
        """Seconds from `started` by which the first token is due (never past the timeout)."""
        if self.first_token_s is None:
            return self.timeout_s
        return min(self.first_token_s, self.timeout_s)

    @property
    def response_id(self) -> str:
        return self.format.id_prefix + self.charge.request_id.removeprefix("req_")

    def envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": self.format.chunk_object if chunk else self.format.object,
            "created": self.created,
            "model": self.charge.model,
            "choices": choices,
        }


@dataclass
class Choices:
    """The n completions of one request as they arrive, interleaved by index."""

    n: int
    tokens: dict[int, int] = field(default_factory=dict)  # index -> completion tokens
    finish: dict[int, str | None] = field(default_factory=dict)
    texts: dict[int, list[str]] = field(default_factory=dict)
    logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)

    @property
    def completion_tokens(self) -> int:
        return sum(self.tokens.values())

    def collect(self, out: RequestOutput) -> None:
        """Keep text and logprobs too (for a whole, non-streamed response)."""
        self.texts.setdefault(out.index, []).append(out.text)
        if out.logprobs is not None:
            self.logprobs.setdefault(out.index, []).extend(out.logprobs)


def _observe(outcome: Outcome, choices: Choices, job: Job, out: RequestOutput) -> None:
    outcome.prompt_tokens = out.prompt_tokens
    outcome.cached_tokens = out.cached_tokens
    choices.tokens[out.index] = out.completion_tokens
    outcome.completion_tokens = choices.completion_tokens
    if outcome.queue_ms is None and out.first_scheduled_time is not None:
        outcome.queue_ms = (out.first_scheduled_time - out.arrival_time) * 1000
    if outcome.ttft_ms is None and out.completion_tokens > 0:
        outcome.ttft_ms = (time.monotonic() - job.started) * 1000
    if out.index == 0 and out.completion_tokens > outcome.stream_tokens:
        outcome.stream_tokens = out.completion_tokens
        outcome.last_token_ms = (time.monotonic() - job.started) * 1000
    if out.finished:
        choices.finish[out.index] = out.finish_reason
        outcome.finish_reason = choices.finish.get(0, out.finish_reason)


def _usage(outcome: Outcome) -> dict[str, Any]:
    return {
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": outcome.completion_tokens,
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
    }


def _fail(outcome: Outcome, exc: BaseException, delivered: int) -> ApiError:
    """Map an engine-side failure to its API error; bill only what reached the client."""
    if isinstance(exc, ApiError):
        error = exc
    elif isinstance(exc, EngineDeadError):
        error = EngineUnavailable("the engine stopped; retry shortly", headers={"Retry-After": "1"})
    elif isinstance(exc, ValueError):
        error = InvalidRequest(str(exc))
    else:
        error = InternalError("the engine failed this request")
    refused = isinstance(error, Overloaded | DeadlineExceeded) and delivered == 0
    outcome.status = UsageStatus.REJECTED if refused else UsageStatus.FAILED
    outcome.error = error.code or error.type
    outcome.completion_tokens = delivered
    return error


def _cancelled(outcome: Outcome, delivered: int) -> Outcome:
    outcome.status = UsageStatus.CANCELLED
    outcome.completion_tokens = delivered
    return outcome


async def _outputs(
    job: Job, engine: EngineClient, restartable: bool = False
) -> AsyncIterator[RequestOutput]:
    """The engine's outputs for this job, under its server-side deadlines: the first token
    by `first_token_within_s`, the last by `timeout_s`. Missing one closes the engine's
    stream, which aborts the request there."""
    started = asyncio.get_running_loop().time() - (time.monotonic() - job.started)  # loop clock
    last_due = started + job.timeout_s
    due = started + job.first_token_within_s
    outputs = engine.generate(
        job.prompt,
        job.params,
        job.charge.request_id,
        priority=job.priority,
        tenant=job.charge.principal.tenant_id,
        weight=job.charge.principal.plan.weight,
        # The engine rejects what cannot start by then, before spending compute on it.
        deadline=job.started + job.first_token_within_s,
        restartable=restartable,
    )
    outputs = current_request().dispatch(outputs)  # the dispatch span; the timeline
    while True:
        try:
            async with asyncio.timeout_at(due):
                out = await anext(outputs)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise DeadlineExceeded(_missed(job, first=due < last_due)) from None
        due = last_due
        yield out


def _missed(job: Job, first: bool) -> str:
    if first:
        return f"the first token did not come within {job.first_token_within_s * 1000:g} ms"
    return f"the request did not finish within {job.timeout_s:g} s"


async def complete(job: Job, engine: EngineClient, recorder: UsageRecorder) -> dict[str, Any]:
    """Run to the end and return the whole response body."""
    outcome = Outcome(prompt_tokens=len(job.prompt))
    choices = Choices(job.params.n)
    try:
        # Nothing reaches the client before the end, so a replica that dies on the way
        # does not fail the request: it starts over on another one.
        async for out in _outputs(job, engine, restartable=True):
            if out.finish_reason == RESTART:
                outcome, choices = Outcome(prompt_tokens=len(job.prompt)), Choices(job.params.n)
                continue
            _observe(outcome, choices, job, out)
            choices.collect(out)
    except Exception as exc:
        error = _fail(outcome, exc, delivered=0)
        recorder.settle(job.charge, _finish(outcome, job))
        raise error from exc
    except BaseException:  # cancelled: the client went away before the answer was sent
        with current_request().span("cancel"):
            engine.abort(job.charge.request_id)
        recorder.settle(job.charge, _finish(_cancelled(outcome, 0), job))
        raise
    # Settled exactly once from here, whatever happens to this task; the quota store's
    # part never fails it (see Admission.settle), so a completed request is a 200.
    await asyncio.shield(recorder.settle(job.charge, _finish(outcome, job)))
    want_logprobs = job.params.logprobs is not None
    body = job.envelope(
        [
            _with_calls(
                job,
                job.format.choice(
                    index,
                    job.echo + "".join(choices.texts.get(index, [])),
                    choices.finish.get(index),
                    choices.logprobs.get(index, []) if want_logprobs else None,
                    engine.token_text,
                ),
            )
            for index in range(choices.n)
        ],
        chunk=False,
    )
    body["usage"] = _usage(outcome)
    return body


def _with_calls(job: Job, choice: dict[str, Any]) -> dict[str, Any]:
    if job.tools is None or not job.tools.active:
        return choice
    text = choice["message"]["content"]
    return with_tool_calls(choice, *_calls(job.tools, text, choice["finish_reason"]))


def _calls(
    plan: ToolPlan, text: str, finish_reason: str | None
) -> tuple[str | None, list[ToolCall]]:
    """The content and tool calls of one finished output. A forced output that max_tokens
    cut short is not JSON: it is sent as it is, with finish_reason "length"."""
    if finish_reason == "length" and plan.forced is not None:
        return text, []
    return plan.calls(text)


def _finish(outcome: Outcome, job: Job) -> Outcome:
    outcome.e2e_ms = (time.monotonic() - job.started) * 1000
    current_request().finish(job, outcome)  # once per request: every path settles once
    return outcome


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + encode(payload) + b"\n\n"


async def stream(job: Job, engine: EngineClient, recorder: UsageRecorder) -> AsyncIterator[bytes]:
    """Wait for the engine's first output, then return the server-sent events. Nothing is
    sent before it, so a refusal (overloaded, deadline) is an HTTP error with its status
    and Retry-After rather than an error event after a 200."""
    outcome = Outcome(prompt_tokens=len(job.prompt))
    outputs = _outputs(job, engine)
    checkpointed = recorder.track(job.charge, outcome)  # written while the engine prefills
    try:
        first = await anext(outputs, None)
    except asyncio.CancelledError:  # the client left while queued; the engine aborted
        recorder.settle(job.charge, _finish(_cancelled(outcome, 0), job))
        raise
    except Exception as exc:
        error = _fail(outcome, exc, delivered=0)
        recorder.settle(job.charge, _finish(outcome, job))
        raise error from exc
    return _events(job, engine, recorder, outcome, _chain(first, outputs), checkpointed)


async def _chain(
    first: RequestOutput | None, rest: AsyncIterator[RequestOutput]
) -> AsyncIterator[RequestOutput]:
    if first is not None:
        yield first
    async for out in rest:
        yield out


def _delta_event(job: Job, choice: dict[str, Any]) -> bytes:
    body = job.envelope([choice], chunk=True)
    if job.include_usage:
        body["usage"] = None
    return _sse(body)


def _tool_streams(job: Job) -> dict[int, ToolStream]:
    """Per choice, what holds back tool-call text while it streams (none without tools)."""
    if job.tools is None or not job.tools.active:
        return {}
    return {index: ToolStream(job.tools) for index in range(job.params.n)}


async def _events(
    job: Job,
    engine: EngineClient,
    recorder: UsageRecorder,
    outcome: Outcome,
    outputs: AsyncIterator[RequestOutput],
    checkpointed: asyncio.Future[None],
) -> AsyncIterator[bytes]:
    """Server-sent events; the completion tokens billed are the ones written out. The
    first waits for the stream's first checkpoint: a client never holds a response that
    a gateway crash could leave without a ledger row."""
    choices = Choices(job.params.n)
    delivered = 0
    settled = False
    held = _tool_streams(job)

    def chunk(
        index: int,
        text: str,
        finish_reason: str | None,
        first: bool = False,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> bytes:
        choice = job.format.delta(index, text, finish_reason, first, logprobs, engine.token_text)
        return _delta_event(job, choice)

    streaming = current_request().start_span("stream")
    with contextlib.suppress(TimeoutError):  # a slow database delays billing, not tokens
        await asyncio.wait_for(asyncio.shield(checkpointed), FIRST_CHECKPOINT_WAIT_S)
    try:
        for index in range(choices.n):
            yield chunk(index, job.echo, None, first=True)
        async for out in outputs:
            _observe(outcome, choices, job, out)
            text = held[out.index].feed(out.text) if held else out.text
            if text or out.logprobs:
                yield chunk(out.index, text, None, logprobs=out.logprobs)
            delivered = outcome.delivered = choices.completion_tokens  # once the chunk was sent
            if out.finished:
                reason = out.finish_reason
                if held:  # what was held back: content that turned out not to be a call, calls
                    stream = held[out.index]
                    content, calls = _calls(stream.plan, stream.pending, reason)
                    if content:
                        yield chunk(out.index, content, None)
                    if calls:
                        yield _delta_event(job, tool_calls_delta(out.index, calls))
                        reason = "tool_calls"
                yield chunk(out.index, "", reason)
        settled = True
        await asyncio.shield(recorder.settle(job.charge, _finish(outcome, job)))
        if job.include_usage:
            yield _sse({**job.envelope([], chunk=True), "usage": _usage(outcome)})
        yield DONE
    except Exception as exc:
        error = _fail(outcome, exc, delivered)
        if not settled:
            settled = True
            recorder.settle(job.charge, _finish(outcome, job))
        yield _sse(error.body())
    finally:
        streaming.set_attribute("tollgate.stream.delivered_tokens", delivered)
        streaming.end()
        if not settled:  # the client disconnected mid-stream
            with current_request().span("cancel"):
                engine.abort(job.charge.request_id)
            recorder.settle(job.charge, _finish(_cancelled(outcome, delivered), job))
