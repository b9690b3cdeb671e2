"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar

from litestar import Controller, MediaType, Request, Response, get, post
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath
from litestar.response import Stream

from backend import InvalidParameterError, SamplingParams
from backend.constraint import Constraint
from gateway.admission import idempotency, policy
from gateway.admission.auth import authenticate, new_request_id
from gateway.admission.idempotency import Claim, Replay
from gateway.api import generation
from gateway.api.formats import ChatFormat, Format, TextFormat
from gateway.api.generation import Generation
from gateway.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    decode,
    encode,
)
from gateway.dispatch.engine_client import EngineClient
from gateway.errors import Cancelled, InvalidRequest
from gateway.runtime import Runtime
from gateway.telemetry import current_request
from gateway.usage import Charge
from tenants.models import IdempotencyRecord
from tenants.services import Principal

T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _sampling(
    fields: SamplingFields, max_tokens: int, constraint: Constraint | None
) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if fields.temperature is None else fields.temperature,
            top_p=1.0 if fields.top_p is None else fields.top_p,
            top_k=fields.top_k or 0,
            seed=fields.seed,
            stop=fields.stop_strings(),
            ignore_eos=fields.ignore_eos,
            n=fields.n,
            logprobs=fields.engine_logprobs(),
            min_tokens=fields.min_tokens,
            repetition_penalty=fields.repetition_penalty or 1.0,
            presence_penalty=fields.presence_penalty or 0.0,
            frequency_penalty=fields.frequency_penalty or 0.0,
            constraint=constraint,
        )
    except InvalidParameterError as exc:  # a combination the schema cannot check, e.g. min > max
        param = exc.param if exc.param and hasattr(fields, exc.param) else None
        raise InvalidRequest(str(exc), param=param) from None


def _params(
    principal: Principal,
    body: SamplingFields,
    prompt: list[int],
    engine: EngineClient,
    param: str,
    constraint: Constraint | None,
) -> SamplingParams:
    room = policy.room_for_output(len(prompt), engine.max_model_len, param)
    return _sampling(body, policy.output_limit(principal, body.output_limit(), room), constraint)


class OpenAIController(Controller):
    path = "/v1"
    dependencies = {"principal": Provide(authenticate)}

    @post("/chat/completions", status_code=200)
    async def chat_completions(
        self,
        request: Request[Any, Any, Any],
        principal: NamedDependency[Principal],
        runtime: NamedDependency[Runtime],
    ) -> Response[Any]:
        body = decode(await request.body(), ChatCompletionRequest)
        engine = runtime.engine
        policy.check_model(principal, body.model, engine.model_name)
        tools = body.tool_plan(engine.tool_call_parser)
        constraint = body.constraint(tools)
        chars = body.prompt_chars()
        policy.check_prompt_chars(chars, engine.max_model_len, engine.max_token_chars, "messages")
        render = partial(_chat_prompt, engine, body.template_messages(), body.template_tools())
        prompt = await _tokenize(runtime, principal, chars, render)
        params = _params(principal, body, prompt, engine, "messages", constraint)
        gen = _generation(runtime, principal, body, ChatFormat, "chat.completions", prompt, params)
        gen.tools = tools
        return await _respond(request, runtime, principal, gen, stream=body.stream)

    @post("/completions", status_code=200)
    async def completions(
        self,
        request: Request[Any, Any, Any],
        principal: NamedDependency[Principal],
        runtime: NamedDependency[Runtime],
    ) -> Response[Any]:
        body = decode(await request.body(), CompletionRequest)
        engine = runtime.engine
        policy.check_model(principal, body.model, engine.model_name)
        given = body.prompts()
        prompts = await _completion_prompts(runtime, principal, given)
        longest = max(prompts, key=len)
        params = _params(principal, body, longest, engine, "prompt", body.constraint())
        gen = _generation(runtime, principal, body, TextFormat, "completions", prompts[0], params)
        if len(prompts) > 1:
            gen.batch = prompts
        if body.echo:
            gen.echo = [p if isinstance(p, str) else engine.decode(p) for p in given]
        return await _respond(request, runtime, principal, gen, stream=body.stream)

    @get("/models")
    async def list_models(
        self, runtime: NamedDependency[Runtime], principal: NamedDependency[Principal]
    ) -> dict[str, Any]:
        engine = runtime.engine
        names = policy.visible_models(principal, [engine.model_name])
        return {"object": "list", "data": [_model_card(runtime, engine) for _ in names]}

    @get("/models/{model_id:str}")
    async def get_model(
        self,
        model_id: FromPath[str],
        runtime: NamedDependency[Runtime],
        principal: NamedDependency[Principal],
    ) -> dict[str, Any]:
        engine = runtime.engine
        policy.check_model(principal, model_id, engine.model_name)
        return _model_card(runtime, engine)


# Characters in all the prompts of a batch together: each prompt is bounded by the context,
# the batch by the CPU its tokenizing takes (about a quarter of a second at this size).
MAX_BATCH_CHARS = 2**20


async def _completion_prompts(
    runtime: Runtime, principal: Principal, given: list[str] | list[list[int]]
) -> list[list[int]]:
    """The token ids of each prompt, each text bounded before it is tokenized."""
    engine = runtime.engine
    texts = [p for p in given if isinstance(p, str)]
    for text in texts:
        policy.check_prompt_chars(len(text), engine.max_model_len, engine.max_token_chars, "prompt")
    chars = sum(len(text) for text in texts)
    if chars > MAX_BATCH_CHARS:
        raise InvalidRequest(
            f"the prompts have {chars} characters together; at most {MAX_BATCH_CHARS}",
            param="prompt",
            code="batch_too_large",
        )
    prompts = [p for p in given if isinstance(p, list)]
    if texts:
        prompts = await _tokenize(runtime, principal, chars, partial(_encode_all, engine, texts))
    if not all(prompts):
        raise InvalidRequest("the prompt is empty", param="prompt")
    return prompts  # the context check: the longest, in _params


def _encode_all(engine: EngineClient, texts: list[str]) -> list[list[int]]:
    return [engine.encode(text) for text in texts]


def _chat_prompt(
    engine: EngineClient, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[int]:
    try:
        rendered = engine.render_chat(messages, tools)
    except InvalidParameterError as exc:  # the template refused these messages (role order)
        raise InvalidRequest(str(exc), param="messages") from None
    return engine.encode(rendered)


# Past this many characters, tokenizing takes long enough (about 2.5 ms per 10k characters
# on a 2-core machine) to hold up every other request on the event loop: it runs in a thread.
INLINE_TOKENIZE_CHARS = 4096


async def _tokenize(runtime: Runtime, principal: Principal, chars: int, work: Callable[[], T]) -> T:
    if chars <= INLINE_TOKENIZE_CHARS:
        return work()
    await runtime.admission.refuse_if_exhausted(principal)  # a spent key costs no tokenizing
    return await asyncio.to_thread(work)


def _model_card(runtime: Runtime, engine: EngineClient) -> dict[str, Any]:
    return {
        "id": engine.model_name,
        "object": "model",
        "created": runtime.model_loaded_at,
        "owned_by": "tollgate",
        "max_model_len": engine.max_model_len,
    }


def _generation(
    runtime: Runtime,
    principal: Principal,
    body: SamplingFields,
    fmt: Format,
    endpoint: str,
    prompt: list[int],
    params: SamplingParams,
) -> Generation:
    priority = policy.priority(principal, body.priority)
    return Generation(
        charge=Charge(new_request_id(), principal, body.model, endpoint, priority=priority),
        format=fmt,
        prompt=prompt,
        params=params,
        include_usage=body.include_usage(),
        timeout_s=runtime.settings.request_timeout_s,
        first_token_s=None if body.ttft_deadline_ms is None else body.ttft_deadline_ms / 1000,
        priority=priority,
    )


async def _respond(
    request: Request[Any, Any, Any],
    runtime: Runtime,
    principal: Principal,
    gen: Generation,
    *,
    stream: bool,
) -> Response[Any]:
    scope = current_request()
    scope.describe(gen, stream)
    claim: Claim | None = None
    raw_key = request.headers.get(idempotency.HEADER)
    if raw_key is not None:
        with scope.span("idempotency"):
            begun = await runtime.idempotency.begin(
                principal, raw_key, gen.charge.endpoint, await request.body()
            )
        if isinstance(begun, Replay):
            return _replay(begun.record)
        claim = begun
    try:
        with scope.span("admission"):
            # Reserve at the price the request will be charged (the book's version now).
            quote = await runtime.recorder.prices.quote(gen.charge.model, gen.charge.started_at)
            ticket = await runtime.admission.reserve(
                principal,
                gen.charge.request_id,
                gen.prompt_tokens,
                gen.params.max_tokens * gen.choice_count,
                quote.price,
            )
    except BaseException:
        if claim is not None:  # rejected, not stored: a retry with this key runs afresh
            runtime.tasks.spawn(runtime.idempotency.abandon(claim))
        raise
    gen.charge = replace(gen.charge, reservation=ticket.reservation)
    scope.admitted = True
    headers = {"x-request-id": gen.charge.request_id, **ticket.headers}
    if stream:
        # Until the first output a refusal is still an HTTP error; after it, Litestar
        # cancels the stream when the client disconnects, and generation aborts then.
        opening = generation.stream(gen, runtime.engine, runtime.recorder)
        events = await _abandon_on_failure(claim, runtime, _unless_disconnected(request, opening))
        if claim is not None:
            events = _recorded(events, claim, runtime, gen.charge.request_id)
        return Stream(events, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
    work = generation.complete(gen, runtime.engine, runtime.recorder)
    result = await _abandon_on_failure(claim, runtime, _unless_disconnected(request, work))
    if claim is not None:
        body = encode(result)
        await runtime.idempotency.finish(claim, gen.charge.request_id, 200, MediaType.JSON, body)
    return Response(result, media_type=MediaType.JSON, headers=headers)


async def _abandon_on_failure(claim: Claim | None, runtime: Runtime, work: Awaitable[T]) -> T:
    try:
        return await work
    except BaseException:
        if claim is not None:  # not stored: a retry with this key runs afresh
            runtime.tasks.spawn(runtime.idempotency.abandon(claim))
        raise


def _replay(record: IdempotencyRecord) -> Response[Any]:
    headers = {"x-request-id": record.request_id, "idempotent-replayed": "true"}
    if record.media_type == "text/event-stream":
        headers.update(SSE_HEADERS)
    return Response(
        record.body,
        status_code=record.status_code,
        media_type=record.media_type,
        headers=headers,
    )


async def _recorded(
    events: AsyncIterator[bytes], claim: Claim, runtime: Runtime, request_id: str
) -> AsyncIterator[bytes]:
    """Pass the stream through, and store it once whole, before its final event is sent,
    so a retry after [DONE] always finds the replay."""
    sent: list[bytes] = []
    stored = False
    try:
        async for event in events:
            if event == generation.DONE:
                sent.append(event)
                stored = True
                body = b"".join(sent)
                await runtime.idempotency.finish(claim, request_id, 200, "text/event-stream", body)
            else:
                sent.append(event)
            yield event
    finally:
        if not stored:  # cancelled or failed: a retry with this key runs afresh
            runtime.tasks.spawn(runtime.idempotency.abandon(claim))


async def _unless_disconnected(request: Request[Any, Any, Any], work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts the engine request) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise Cancelled("the client closed the connection")
    return task.result()


async def _disconnected(request: Request[Any, Any, Any]) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
