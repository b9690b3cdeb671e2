"""Running one admitted request through the engine: streamed as SSE, or whole.

Every exit path (completion, engine failure, deadline, client disconnect) goes through
one `Settlement`, which aborts what is left in the engine and settles exactly one usage
row.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, TypeVar

from backend import EngineDeadError, LoRARequest, RequestOutput, SamplingParams, TokenLogprobs
from gateway.api.formats import (
    Format,
    choice_delta,
    function_call_deltas,
    tool_calls_delta,
    with_tool_calls,
)
from gateway.api.schemas import encode
from gateway.api.tools import ToolPlan, ToolStream, assembled
from gateway.core.errors import (
    ApiError,
    DeadlineExceeded,
    EngineUnavailable,
    InternalError,
    Overloaded,
)
from gateway.core.tasks import Interrupt
from gateway.core.usage import Charge, RequestUsage
from gateway.dispatch.engine_client import RESTART, ClientPrompt, EngineClient, GenerateRequest
from gateway.metering.recorder import FIRST_CHECKPOINT_WAIT_S, UsageRecorder
from gateway.openapi.shapes import ToolCall
from gateway.telemetry import current_request
from tenants.models import UsageStatus

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"


@dataclass
class Generation:
    """One admitted request for the engine: what to run, how to answer, by when."""

    charge: Charge
    format: Format
    prompt: list[int]
    params: SamplingParams
    include_usage: bool = False
    timeout_s: float = 600.0
    first_token_s: float | None = None  # the client's ttft_deadline_ms, in seconds
    echo: list[str] = field(default_factory=list)  # completions: each prompt's text, sent back
    # Completions: every prompt of a batch, when there are several (`prompt` is the first).
    # Each runs as its own engine request; their choices and usage add up to one response.
    batch: list[list[int]] = field(default_factory=list)
    tools: ToolPlan | None = None  # chat: how the output's tool calls are found
    source: ClientPrompt | None = None  # the prompt as sent, for an upstream that templates
    lora: LoRARequest | None = None  # the tenant's adapter `model` named; None: the base
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.monotonic)

    @property
    def first_token_within_s(self) -> float:
        """Seconds from `started` by which the first token is due (never past the timeout)."""
        if self.first_token_s is None:
            return self.timeout_s
        return min(self.first_token_s, self.timeout_s)

    @property
    def prompts(self) -> list[list[int]]:
        return self.batch or [self.prompt]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(prompt) for prompt in self.prompts)

    @property
    def choice_count(self) -> int:
        """Prompt i's completion j is choice i * n + j, as OpenAI numbers them."""
        return self.params.n * len(self.prompts)

    @property
    def engine_ids(self) -> list[str]:
        """The engine request of each prompt (a lone prompt's is the request's own id)."""
        if not self.batch:
            return [self.charge.request_id]
        return [f"{self.charge.request_id}-{i}" for i in range(len(self.batch))]

    def echo_of(self, index: int) -> str:
        """What choice `index` starts with: its prompt's text when echoed."""
        return self.echo[index // self.params.n] if self.echo else ""

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
    calls: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # an upstream's
    relayed_logprobs: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # its too

    @property
    def completion_tokens(self) -> int:
        return sum(self.tokens.values())

    def collect(self, out: RequestOutput) -> None:
        """Keep text and logprobs too (for a whole, non-streamed response)."""
        self.texts.setdefault(out.index, []).append(out.text)
        if out.logprobs is not None:
            self.logprobs.setdefault(out.index, []).extend(out.logprobs)
        if out.tool_calls:
            self.calls.setdefault(out.index, []).extend(out.tool_calls)
        if out.relayed_logprobs is not None:
            self.relayed_logprobs.setdefault(out.index, []).append(out.relayed_logprobs)


def _observe(usage: RequestUsage, choices: Choices, gen: Generation, out: RequestOutput) -> None:
    usage.prompt_tokens = out.prompt_tokens
    usage.cached_tokens = out.cached_tokens
    choices.tokens[out.index] = out.completion_tokens
    usage.completion_tokens = choices.completion_tokens
    if usage.queue_ms is None and out.first_scheduled_time is not None:
        usage.queue_ms = (out.first_scheduled_time - out.arrival_time) * 1000
    if usage.ttft_ms is None and out.completion_tokens > 0:
        usage.ttft_ms = (time.monotonic() - gen.started) * 1000
    if out.index == 0 and out.completion_tokens > usage.stream_tokens:
        usage.stream_tokens = out.completion_tokens
        usage.last_token_ms = (time.monotonic() - gen.started) * 1000
    if out.finished:
        choices.finish[out.index] = out.finish_reason
        usage.finish_reason = choices.finish.get(0, out.finish_reason)


def _usage_body(usage: RequestUsage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def api_error(exc: BaseException) -> ApiError:
    """The engine clients raise API errors for what the engine refused on purpose;
    anything else (a ValueError included) is a defect: a 500."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, EngineDeadError):
        return EngineUnavailable("the engine stopped; retry shortly", headers={"Retry-After": "1"})
    return InternalError("the engine failed this request")


class Settlement:
    """The one usage row of a generation, written exactly once however it ends.

    `settle()` writes the row the first time and returns that write every time after.
    Leaving the `async with` block with nothing settled (the client went away, the task
    was cancelled) aborts the request in the engine and settles it as cancelled, billed
    for the completion tokens delivered so far."""

    def __init__(self, gen: Generation, engine: EngineClient, recorder: UsageRecorder) -> None:
        self.gen = gen
        self.engine = engine
        self.recorder = recorder
        self.usage = RequestUsage(prompt_tokens=gen.prompt_tokens)
        self._written: asyncio.Task[None] | None = None
        # Resolved once the row's write is under way (metering): the answer is encoded
        # meanwhile, and starts once the write is done.
        self.committed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @property
    def settled(self) -> bool:
        return self._written is not None

    def restart(self) -> None:
        """The request starts over on another replica: what came before is void."""
        self.usage = RequestUsage(prompt_tokens=self.gen.prompt_tokens)

    def settle(self) -> asyncio.Task[None]:
        """Write the row for the usage as it is now (idempotent: the first write counts)."""
        if self._written is None:
            self.usage.e2e_ms = (time.monotonic() - self.gen.started) * 1000
            current_request().finish(self.gen, self.usage)  # once, as the row is
            self._written = self.recorder.settle(self.gen.charge, self.usage, self.committed)
        return self._written

    def fail(self, exc: BaseException) -> ApiError:
        """Settle an engine-side failure, billing only what reached the client; returns
        the API error to answer with."""
        error = api_error(exc)
        if not self.settled:
            refused = isinstance(error, Overloaded | DeadlineExceeded) and not self.usage.delivered
            self.usage.status = UsageStatus.REJECTED if refused else UsageStatus.FAILED
            self.usage.error = error.code or error.type
            self.usage.completion_tokens = self.usage.delivered
            self.settle()
        return error

    async def __aenter__(self) -> Settlement:
        return self

    async def __aexit__(self, *_: object) -> None:
        self.cancel()

    def cancel(self) -> None:
        """Unless settled: abort in the engine, settle as cancelled (what was delivered)."""
        if self.settled:
            return
        with current_request().span("cancel"):
            for engine_id in self.gen.engine_ids:
                self.engine.abort(engine_id)
        self.usage.status = UsageStatus.CANCELLED
        self.usage.completion_tokens = self.usage.delivered
        self.settle()


async def _outputs(
    gen: Generation, engine: EngineClient, restartable: bool = False
) -> AsyncIterator[RequestOutput]:
    """The engine's outputs for this generation, under its server-side deadlines: the
    first token by `first_token_within_s`, the last by `timeout_s`. Missing one closes the
    engine's stream, which aborts the request there."""
    started = asyncio.get_running_loop().time() - (time.monotonic() - gen.started)  # loop clock
    last_due = started + gen.timeout_s
    due = started + gen.first_token_within_s
    streams = [
        engine.generate(
            GenerateRequest(
                prompt,
                gen.params,
                engine_id,
                priority=gen.charge.priority,
                tenant=gen.charge.principal.tenant_id,
                weight=gen.charge.principal.plan.weight,
                # The engine rejects what cannot start by then, before spending compute on it.
                deadline=gen.started + gen.first_token_within_s,
                # A batch's restart would void the other prompts' choices too: it fails instead.
                restartable=restartable and not gen.batch,
                # A batch's prompts go as token ids; one prompt as the client sent it.
                source=None if gen.batch else gen.source,
                lora=gen.lora,
            )
        )
        for prompt, engine_id in zip(gen.prompts, gen.engine_ids, strict=True)
    ]
    merged = streams[0] if len(streams) == 1 else _merged(streams, gen)
    outputs = current_request().dispatch(merged)  # the dispatch span; the timeline
    deadline = Deadline(due)
    try:
        while True:
            try:
                out = await deadline.next(outputs)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise DeadlineExceeded(_missed(gen, first=due < last_due)) from None
            due = last_due
            deadline.move(due)
            yield out
    finally:
        deadline.close()


class Deadline:
    """asyncio.timeout_at for the many awaits of one stream, without a timer per await
    (that was ~3 us per output, ~18 outputs per 16-token answer): one timer, moved when the
    due time changes. It cancels the awaiting task only while it waits for the next item,
    never while the item is handed on; past due, the next wait fails at once."""

    def __init__(self, when: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._when = when
        self._timer = self._loop.call_at(when, self._expire)
        self._expired = False
        self._waiting: Interrupt | None = None  # of the task waiting in next()

    def move(self, when: float) -> None:
        if when != self._when:
            self._timer.cancel()
            self._when, self._expired = when, False
            self._timer = self._loop.call_at(when, self._expire)

    def close(self) -> None:
        self._timer.cancel()

    def _expire(self) -> None:
        self._expired = True
        if self._waiting is not None:
            self._waiting.fire()

    async def next(self, items: AsyncIterator[T]) -> T:
        """The next item, or TimeoutError once the due time has passed."""
        if self._expired:
            raise TimeoutError
        self._waiting = waiting = Interrupt()
        try:
            return await anext(items)
        except asyncio.CancelledError:
            if waiting.ours():
                raise TimeoutError from None
            raise
        finally:
            self._waiting = None


async def _merged(
    streams: list[AsyncIterator[RequestOutput]], gen: Generation
) -> AsyncIterator[RequestOutput]:
    """A batch's engine outputs as they come, each renumbered to its choice and counting
    the prompt tokens of the whole batch. Closing it closes (aborts) every engine request."""
    prompt_tokens = [len(prompt) for prompt in gen.prompts]
    cached_tokens = [0] * len(streams)
    pending = {asyncio.ensure_future(anext(stream)): i for i, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                prompt_tokens[i], cached_tokens[i] = out.prompt_tokens, out.cached_tokens
                yield replace(
                    out,
                    index=i * gen.params.n + out.index,
                    prompt_tokens=sum(prompt_tokens),
                    cached_tokens=sum(cached_tokens),
                )
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            close = getattr(stream, "aclose", None)
            if close is not None:
                await close()


def _missed(gen: Generation, first: bool) -> str:
    if first:
        return f"the first token did not come within {gen.first_token_within_s * 1000:g} ms"
    return f"the request did not finish within {gen.timeout_s:g} s"


async def complete(
    gen: Generation, engine: EngineClient, recorder: UsageRecorder
) -> dict[str, Any]:
    """Run to the end and return the whole response body."""
    choices = Choices(gen.choice_count)
    async with Settlement(gen, engine, recorder) as settlement:
        try:
            # Nothing reaches the client before the end, so a replica that dies on the way
            # does not fail the request: it starts over on another one.
            async for out in _outputs(gen, engine, restartable=True):
                if out.finish_reason == RESTART:
                    settlement.restart()
                    choices = Choices(gen.choice_count)
                    continue
                _observe(settlement.usage, choices, gen, out)
                choices.collect(out)
        except Exception as exc:
            raise settlement.fail(exc) from exc
        # Settled exactly once from here, whatever happens to this task; the quota
        # store's part never fails it (see Admission.settle), so a completed request is a 200.
        written = settlement.settle()
        await asyncio.shield(settlement.committed)
        # The answer is encoded while its row is synced to disk, and starts once it is.
        if not current_request().answer_after(written):
            await asyncio.shield(written)
    return _whole_body(gen, engine, choices, settlement.usage)


def _whole_body(
    gen: Generation, engine: EngineClient, choices: Choices, usage: RequestUsage
) -> dict[str, Any]:
    body = gen.envelope(
        [_whole_choice(gen, engine, choices, index) for index in range(choices.n)], chunk=False
    )
    body["usage"] = _usage_body(usage)
    return body


def _whole_choice(
    gen: Generation, engine: EngineClient, choices: Choices, index: int
) -> dict[str, Any]:
    want_logprobs = gen.params.logprobs is not None
    choice = gen.format.choice(
        index,
        gen.echo_of(index) + "".join(choices.texts.get(index, [])),
        choices.finish.get(index),
        choices.logprobs.get(index, []) if want_logprobs else None,
        engine.token_text,
    )
    relayed = choices.relayed_logprobs.get(index)
    if relayed:  # an upstream's, in the endpoint's shape already
        choice["logprobs"] = gen.format.joined(relayed)
    return _with_calls(gen, choices.calls.get(index), choice)


def _with_calls(
    gen: Generation, relayed: list[dict[str, Any]] | None, choice: dict[str, Any]
) -> dict[str, Any]:
    """A whole choice with its tool calls: an upstream's (`relayed`, its streamed deltas),
    or those parsed out of the engine's text."""
    if relayed:
        return with_tool_calls(choice, choice["message"]["content"] or None, assembled(relayed))
    if gen.tools is None or not gen.tools.active:
        return choice
    text = choice["message"]["content"]
    content, calls = _calls(gen.tools, text, choice["finish_reason"])
    return with_tool_calls(choice, content, calls, gen.tools.legacy)


def _calls(
    plan: ToolPlan, text: str, finish_reason: str | None
) -> tuple[str | None, list[ToolCall]]:
    """The content and tool calls of one finished output. A forced output that max_tokens
    cut short is not JSON: it is sent as it is, with finish_reason "length"."""
    if finish_reason == "length" and plan.forced is not None:
        return text, []
    return plan.calls(text)


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + encode(payload) + b"\n\n"


async def stream(
    gen: Generation, engine: EngineClient, recorder: UsageRecorder
) -> AsyncIterator[bytes]:
    """Wait for the engine's first output, then return the server-sent events. Nothing is
    sent before it, so a refusal (overloaded, deadline) is an HTTP error with its status
    and Retry-After rather than an error event after a 200."""
    settlement = Settlement(gen, engine, recorder)
    outputs = _outputs(gen, engine)
    checkpointed = recorder.track(gen.charge, settlement.usage)  # written while it prefills
    try:
        first = await anext(outputs, None)
    except Exception as exc:
        raise settlement.fail(exc) from exc
    except BaseException:  # cancelled: the client left while the request was queued
        settlement.cancel()
        raise
    return _events(settlement, _chain(first, outputs), checkpointed)


async def _chain(
    first: RequestOutput | None, rest: AsyncIterator[RequestOutput]
) -> AsyncIterator[RequestOutput]:
    if first is not None:
        yield first
    async for out in rest:
        yield out


def _chunk(
    gen: Generation,
    engine: EngineClient,
    index: int,
    text: str,
    finish_reason: str | None,
    first: bool = False,
    logprobs: list[TokenLogprobs] | None = None,
    relayed: dict[str, Any] | None = None,  # an upstream's logprobs, in this shape already
) -> bytes:
    choice = gen.format.delta(index, text, finish_reason, first, logprobs, engine.token_text)
    if relayed is not None:
        choice["logprobs"] = relayed
    return _delta_event(gen, choice)


def _first_chunk(gen: Generation, engine: EngineClient, index: int, tools: bool) -> bytes:
    """A choice's first chunk; with tools in play its content is null, as OpenAI's (an
    empty string there made the openai SDK's stream helper report a content event)."""
    choice = gen.format.delta(index, gen.echo_of(index), None, True, None, engine.token_text)
    if tools:
        choice["delta"]["content"] = None
    return _delta_event(gen, choice)


def _delta_event(gen: Generation, choice: dict[str, Any]) -> bytes:
    body = gen.envelope([choice], chunk=True)
    if gen.include_usage:
        body["usage"] = None
    return _sse(body)


def _held_end(
    gen: Generation, engine: EngineClient, stream: ToolStream, index: int, reason: str | None
) -> tuple[list[bytes], str | None]:
    """The events that end a choice whose output was held for tool calls (content that is
    not a call, what the calls still lack), and its finish reason. Text already streamed
    as a call is not sent again as content, even where it did not parse (cut short by
    max_tokens: OpenAI's and vLLM's streams end the same way, with "length")."""
    content, calls = _calls(stream.plan, stream.pending, reason)
    scanner = stream.scanner
    events = []
    if content and not (scanner is not None and scanner.announced):
        events.append(_chunk(gen, engine, index, content, None))
    if calls and stream.plan.legacy:
        for delta in function_call_deltas(calls[0]):
            events.append(_delta_event(gen, choice_delta(index, delta)))
        return events, "function_call"
    for delta in scanner.finish(calls) if scanner is not None else []:
        events.append(_delta_event(gen, tool_calls_delta(index, [delta])))
    return events, "tool_calls" if calls else reason


def _tool_streams(gen: Generation) -> dict[int, ToolStream]:
    """Per choice, what holds back tool-call text while it streams (none without tools)."""
    if gen.tools is None or not gen.tools.active:
        return {}
    return {index: ToolStream(gen.tools) for index in range(gen.params.n)}


async def _events(
    settlement: Settlement,
    outputs: AsyncIterator[RequestOutput],
    checkpointed: asyncio.Future[None],
) -> AsyncIterator[bytes]:
    """Server-sent events; the completion tokens billed are the ones written out. The
    first waits for the stream's first checkpoint: a client never holds a response that
    a gateway crash could leave without a ledger row."""
    gen, usage = settlement.gen, settlement.usage
    choices = Choices(gen.choice_count)
    chunk = partial(_chunk, gen, settlement.engine)
    held = _tool_streams(gen)
    streaming = current_request().start_span("stream")
    try:
        async with settlement:  # the client disconnecting mid-stream exits here
            with contextlib.suppress(TimeoutError):  # a slow database delays billing, not tokens
                await asyncio.wait_for(asyncio.shield(checkpointed), FIRST_CHECKPOINT_WAIT_S)
            try:
                for index in range(choices.n):
                    yield _first_chunk(gen, settlement.engine, index, tools=bool(held))
                async for out in outputs:
                    _observe(usage, choices, gen, out)
                    text, calling = held[out.index].feed(out.text) if held else (out.text, [])
                    if text or out.logprobs or out.relayed_logprobs:
                        relayed = out.relayed_logprobs
                        yield chunk(out.index, text, None, logprobs=out.logprobs, relayed=relayed)
                    for delta in calling:  # a call's arguments, as they are generated
                        yield _delta_event(gen, tool_calls_delta(out.index, [delta]))
                    if out.tool_calls:  # an upstream's, relayed as they come
                        yield _delta_event(gen, tool_calls_delta(out.index, out.tool_calls))
                    usage.delivered = choices.completion_tokens  # once the chunk was sent
                    if out.finished:
                        reason = out.finish_reason
                        if held:  # what was held back: content that is not a call, calls
                            ending, reason = _held_end(
                                gen, settlement.engine, held[out.index], out.index, reason
                            )
                            for event in ending:
                                yield event
                        yield chunk(out.index, "", reason)
                await asyncio.shield(settlement.settle())
                if gen.include_usage:
                    yield _sse({**gen.envelope([], chunk=True), "usage": _usage_body(usage)})
                yield DONE
            except Exception as exc:
                yield _sse(settlement.fail(exc).body())
    finally:
        streaming.set_attribute("tollgate.stream.delivered_tokens", usage.delivered)
        streaming.end()
