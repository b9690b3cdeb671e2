"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Protocol, TypeVar

from litestar import Controller, MediaType, Request, Response, get, post
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath
from litestar.response import Stream

from backend import InvalidParameterError, LoRARequest, SamplingParams
from backend.constraint import Constraint
from gateway.admission import idempotency, policy
from gateway.admission.idempotency import Claim, Replay
from gateway.api import generation
from gateway.api.formats import CHAT_FORMAT, TEXT_FORMAT, Format
from gateway.api.generation import Generation
from gateway.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    decode,
    encode,
)
from gateway.api.services import GenerationServices
from gateway.core.errors import Cancelled, InvalidRequest
from gateway.core.tasks import Interrupt
from gateway.core.usage import Charge
from gateway.dispatch.directory import ModelDirectory, not_found
from gateway.dispatch.engine_client import (
    INLINE_TOKENIZE_CHARS,
    ClientPrompt,
    EngineClient,
    chat_chars,
)
from gateway.http.auth import authenticate, new_request_id
from gateway.openapi import AUTHENTICATED, GENERATION, route
from gateway.openapi.shapes import ChatCompletion, ChatCompletionChunk, Completion, Model, ModelList
from gateway.telemetry import current_request
from tenants.adapters import Adapter
from tenants.models import IdempotencyRecord
from tenants.registry import ModelKind
from tenants.services import Principal

T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _sampling(
    fields: SamplingFields, max_tokens: int, constraint: Constraint | None
) -> SamplingParams:
    fields.refuse_unsupported()
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if fields.temperature is None else fields.temperature,
            top_p=1.0 if fields.top_p is None else fields.top_p,
            top_k=fields.top_k or 0,
            seed=fields.seed,
            stop=fields.stop_strings(),
            stop_token_ids=fields.stop_token_ids,
            ignore_eos=fields.ignore_eos,
            n=fields.n,
            logprobs=fields.engine_logprobs(),
            min_tokens=fields.min_tokens,
            repetition_penalty=fields.repetition_penalty or 1.0,
            presence_penalty=fields.presence_penalty or 0.0,
            frequency_penalty=fields.frequency_penalty or 0.0,
            min_p=fields.min_p or 0.0,
            logit_bias=fields.token_biases(),
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
    policy.room_for_output(len(prompt), engine.max_model_len, param)
    limit = policy.output_limit(principal, body.output_limit(), len(prompt), engine.max_model_len)
    return _sampling(body, limit, constraint)


class OpenAIController(Controller):
    path = "/v1"
    tags = ["OpenAI-compatible"]
    dependencies = {"principal": Provide(authenticate)}

    @route(
        post,
        "/chat/completions",
        ChatCompletion,
        body=ChatCompletionRequest,
        errors=GENERATION,
        stream=ChatCompletionChunk,
        idempotent=True,
    )
    async def chat_completions(
        self,
        request: Request[Any, Any, Any],
        principal: NamedDependency[Principal],
        services: NamedDependency[GenerationServices],
    ) -> Response[Any]:
        body = decode(await request.body(), ChatCompletionRequest)
        return await chat(request, services, principal, body)

    @route(
        post,
        "/completions",
        Completion,
        body=CompletionRequest,
        errors=GENERATION,
        stream=Completion,
        idempotent=True,
    )
    async def completions(
        self,
        request: Request[Any, Any, Any],
        principal: NamedDependency[Principal],
        services: NamedDependency[GenerationServices],
    ) -> Response[Any]:
        body = decode(await request.body(), CompletionRequest)
        return await complete(request, services, principal, body)

    @route(get, "/models", ModelList, errors=AUTHENTICATED)
    async def list_models(
        self, directory: NamedDependency[ModelDirectory], principal: NamedDependency[Principal]
    ) -> dict[str, Any]:
        names = policy.visible_models(principal, directory.names())
        cards = [_model_card(directory, name) for name in names]
        for adapter in directory.adapters_of(principal.tenant_id):
            if adapter.base_model in names:  # the tenant's own, on a base it may use
                cards.append(_adapter_card(directory, adapter))
        return {"object": "list", "data": cards}

    # `path`: ids may hold '/' (meta-llama/Llama-3.1-8B)
    @route(get, "/models/{model_id:path}", Model, errors=(*AUTHENTICATED, 403, 404))
    async def get_model(
        self,
        model_id: FromPath[str],
        directory: NamedDependency[ModelDirectory],
        principal: NamedDependency[Principal],
    ) -> dict[str, Any]:
        models, name = directory, model_id.lstrip("/")
        adapter = models.adapter(name, principal.tenant_id)
        base = name if adapter is None else adapter.base_model
        if base not in models.names():
            raise not_found(name)
        policy.check_model(principal, base)
        return _model_card(models, name) if adapter is None else _adapter_card(models, adapter)


async def complete(
    request: Request[Any, Any, Any],
    services: GenerationServices,
    principal: Principal,
    body: CompletionRequest,
    endpoint: str = "completions",
) -> Response[Any]:
    """A text completion (of each prompt when there are several)."""
    engine, adapter = services.directory.ready(body.model, principal.tenant_id)
    policy.check_model(principal, body.model if adapter is None else adapter.base_model)
    given = body.prompts()
    prompts = await _completion_prompts(services, principal, engine, given)
    longest = max(prompts, key=len)
    params = _params(principal, body, longest, engine, "prompt", body.constraint())
    gen = _generation(services, principal, body, TEXT_FORMAT, endpoint, prompts[0], params, adapter)
    if len(prompts) > 1:
        gen.batch = prompts
    elif isinstance(given[0], str):
        gen.source = ClientPrompt(text=given[0])  # an upstream gets the text as sent
    if body.echo:
        gen.echo = [p if isinstance(p, str) else engine.decode(p) for p in given]
    return await _respond(request, services, principal, gen, engine, stream=body.stream)


# Characters in all the prompts of a batch together: each prompt is bounded by the context,
# the batch by the CPU its tokenizing takes (about a quarter of a second at this size).
MAX_BATCH_CHARS = 2**20


async def _completion_prompts(
    services: GenerationServices,
    principal: Principal,
    engine: EngineClient,
    given: list[str] | list[list[int]],
) -> list[list[int]]:
    """The token ids of each prompt, each text bounded before it is tokenized."""
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
        prompts = await tokenize(services, principal, chars, partial(_encode_all, engine, texts))
    if not all(prompts):
        raise InvalidRequest("the prompt is empty", param="prompt")
    return prompts  # the context check: the longest, in _params


async def _encode_all(engine: EngineClient, texts: list[str]) -> list[list[int]]:
    return [await engine.tokenize(text) for text in texts]


async def chat(
    request: Request[Any, Any, Any],
    services: GenerationServices,
    principal: Principal,
    body: ChatCompletionRequest,
    endpoint: str = "chat.completions",
    reshape: Reshape | None = None,
    param: str = "messages",  # what the messages are called in errors
) -> Response[Any]:
    """A chat completion, or another API's answer (`reshape`) made from one."""
    engine, adapter = services.directory.ready(body.model, principal.tenant_id)
    policy.check_model(principal, body.model if adapter is None else adapter.base_model)
    tools = body.tool_plan(engine.tool_call_parser)
    constraint = body.constraint(tools)
    chars, turns = body.prompt_chars(), len(body.messages)
    policy.check_prompt_chars(chars, engine.max_model_len, engine.max_token_chars, param, turns)
    messages = body.template_messages()
    count = partial(_count_chat, engine, messages, body.template_tools(), param)
    prompt = await tokenize(services, principal, chat_chars(chars, turns), count)
    params = _params(principal, body, prompt, engine, param, constraint)
    gen = _generation(services, principal, body, CHAT_FORMAT, endpoint, prompt, params, adapter)
    gen.tools = tools
    gen.source = ClientPrompt(messages=messages, fields=body.forwarded())
    return await _respond(
        request, services, principal, gen, engine, stream=body.stream, reshape=reshape
    )


async def _count_chat(
    engine: EngineClient,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    param: str,
) -> list[int]:
    try:
        return await engine.tokenize_chat(messages, tools)
    except InvalidRequest as exc:  # the template refused the messages: named as this API does
        if exc.param != "messages":
            raise
        raise InvalidRequest(exc.message, param=param) from None


async def tokenize(
    services: GenerationServices, principal: Principal, chars: int, work: Callable[[], Awaitable[T]]
) -> T:
    """The engine client counts the prompt (off the event loop when it is long); a long one
    is not counted for a key with nothing left to spend."""
    if chars > INLINE_TOKENIZE_CHARS:
        await services.admission.refuse_if_exhausted(principal)
    return await work()


def _model_card(models: ModelDirectory, name: str) -> dict[str, Any]:
    """OpenAI's model object, with vLLM's `max_model_len` and OpenRouter's
    `context_length` (null while an upstream's is unknown). `owned_by` is "tollgate" for
    Tollgate's own engines and "upstream" for an OpenAI-compatible server."""
    spec, client = models.spec(name), models.built(name)
    context = client.max_model_len if client is not None else spec and spec.context_length
    upstream = spec is not None and spec.kind is ModelKind.OPENAI
    return {
        "id": name,
        "object": "model",
        "created": models.opened_at(name) or models.default_opened_at,
        "owned_by": "upstream" if upstream else "tollgate",
        "max_model_len": context,
        "context_length": context,
    }


def _adapter_card(models: ModelDirectory, adapter: Adapter) -> dict[str, Any]:
    """A tenant's LoRA adapter as vLLM lists one: its base model as `parent` (its folder,
    vLLM's `root`, is the operator's business, not the tenant's)."""
    return {
        **_model_card(models, adapter.base_model),
        "id": adapter.name,
        "parent": adapter.base_model,
    }


def _generation(
    services: GenerationServices,
    principal: Principal,
    body: SamplingFields,
    fmt: Format,
    endpoint: str,
    prompt: list[int],
    params: SamplingParams,
    adapter: Adapter | None = None,
) -> Generation:
    priority = policy.priority(principal, body.priority)
    base = None if adapter is None else adapter.base_model
    charge = Charge(
        new_request_id(), principal, body.model, endpoint, priority=priority, base_model=base
    )
    return Generation(
        charge=charge,
        lora=None if adapter is None else LoRARequest(adapter.name, adapter.path),
        format=fmt,
        prompt=prompt,
        params=params,
        include_usage=body.include_usage(),
        timeout_s=services.settings.request_timeout_s,
        first_token_s=None if body.ttft_deadline_ms is None else body.ttft_deadline_ms / 1000,
    )


class Reshape(Protocol):
    """Another API's answer made from chat's, as it goes (the Responses API)."""

    def whole(self, body: dict[str, Any]) -> dict[str, Any]: ...

    def events(self, chat: AsyncIterator[bytes]) -> AsyncIterator[bytes]: ...

    def is_last(self, event: bytes) -> bool:
        """The event that ends a whole stream (stored for replays before it is sent)."""
        ...


@dataclass(frozen=True)
class Admitted:
    """A request past idempotency and admission: its charge holds the reservation."""

    charge: Charge
    claim: Claim | None  # its Idempotency-Key's, stored with the answer
    headers: dict[str, str]


async def admit(
    request: Request[Any, Any, Any],
    services: GenerationServices,
    principal: Principal,
    charge: Charge,
    prompt_tokens: int,
    output_tokens: int,
) -> Admitted | Response[Any]:
    """Claim the Idempotency-Key (a finished request's answer is replayed: the Response)
    and reserve the worst case of `output_tokens` at the price in force now. A batch line's
    key claims nothing: the runner keeps its answer with the line and runs it once at a
    time (its lease), and the key still bills it once (the ledger's unique key)."""
    scope = current_request()
    claim: Claim | None = None
    raw_key = request.headers.get(idempotency.HEADER)
    key = raw_key if charge.batch else None
    if raw_key is not None and not charge.batch:
        with scope.span("idempotency"):
            begun = await services.idempotency.begin(
                principal, raw_key, charge.endpoint, await request.body()
            )
        if isinstance(begun, Replay):
            return _replay(begun.record)
        claim, key = begun, begun.key
    try:
        with scope.span("admission"):
            # Reserve at the price the request will be charged (the book's version now).
            quote = await services.recorder.prices.quote(
                charge.model, charge.started_at, charge.base_model
            )
            registered = services.directory.spec(charge.base_model or charge.model) is not None
            policy.check_priced(quote, charge.model, registered)
            price = quote.price.for_batch() if charge.batch else quote.price
            ticket = await services.admission.reserve(
                principal, charge.request_id, prompt_tokens, output_tokens, price
            )
    except BaseException:
        if claim is not None:  # rejected, not stored: a retry with this key runs afresh
            services.tasks.spawn(services.idempotency.abandon(claim))
        raise
    scope.admitted = True
    headers = {"x-request-id": charge.request_id, **ticket.headers}
    charge = replace(charge, reservation=ticket.reservation, idempotency_key=key)
    return Admitted(charge, claim, headers)


async def respond_whole(
    request: Request[Any, Any, Any],
    services: GenerationServices,
    admitted: Admitted,
    work: Awaitable[dict[str, Any]],
) -> Response[Any]:
    """Answer with `work`'s body (stored for its Idempotency-Key), unless the client left."""
    claim = admitted.claim
    result = await _abandon_on_failure(claim, services, _unless_disconnected(request, work))
    if claim is not None:
        held = current_request().take_hold()  # stored for replays only once on disk
        if held is not None:
            await _abandon_on_failure(claim, services, asyncio.shield(held))
        body = encode(result)
        await services.idempotency.finish(
            claim, admitted.charge.request_id, 200, MediaType.JSON, body
        )
    return Response(result, media_type=MediaType.JSON, headers=admitted.headers)


async def _respond(
    request: Request[Any, Any, Any],
    services: GenerationServices,
    principal: Principal,
    gen: Generation,
    engine: EngineClient,
    *,
    stream: bool,
    reshape: Reshape | None = None,
) -> Response[Any]:
    current_request().describe(gen, stream)
    output_tokens = gen.params.max_tokens * gen.choice_count  # every prompt of a batch
    admitted = await admit(
        request, services, principal, gen.charge, gen.prompt_tokens, output_tokens
    )
    if isinstance(admitted, Response):
        return admitted
    gen.charge, claim, headers = admitted.charge, admitted.claim, admitted.headers
    if stream:
        # Until the first output a refusal is still an HTTP error; after it, Litestar
        # cancels the stream when the client disconnects, and generation aborts then.
        opening = generation.stream(gen, engine, services.recorder)
        events = await _abandon_on_failure(claim, services, _unless_disconnected(request, opening))
        is_last = _is_done
        if reshape is not None:
            events, is_last = reshape.events(events), reshape.is_last
        if claim is not None:
            events = _recorded(events, claim, services, gen.charge.request_id, is_last)
        return Stream(events, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
    whole = _whole(gen, engine, services, reshape)
    return await respond_whole(request, services, admitted, whole)


async def _whole(
    gen: Generation, engine: EngineClient, services: GenerationServices, reshape: Reshape | None
) -> dict[str, Any]:
    body = await generation.complete(gen, engine, services.recorder)
    return body if reshape is None else reshape.whole(body)


def _is_done(event: bytes) -> bool:
    return event == generation.DONE


async def _abandon_on_failure(
    claim: Claim | None, services: GenerationServices, work: Awaitable[T]
) -> T:
    try:
        return await work
    except BaseException:
        if claim is not None:  # not stored: a retry with this key runs afresh
            services.tasks.spawn(services.idempotency.abandon(claim))
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
    events: AsyncIterator[bytes],
    claim: Claim,
    services: GenerationServices,
    request_id: str,
    is_last: Callable[[bytes], bool],
) -> AsyncIterator[bytes]:
    """Pass the stream through, and store it once whole, before its final event is sent,
    so a retry after [DONE] (or `is_last`'s event) always finds the replay."""
    sent: list[bytes] = []
    stored = False
    try:
        async for event in events:
            if is_last(event):
                sent.append(event)
                stored = True
                body = b"".join(sent)
                await services.idempotency.finish(claim, request_id, 200, "text/event-stream", body)
            else:
                sent.append(event)
            yield event
    finally:
        if not stored:  # cancelled or failed: a retry with this key runs afresh
            services.tasks.spawn(services.idempotency.abandon(claim))


async def _unless_disconnected(request: Request[Any, Any, Any], work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts the engine request) if the client leaves:
    a watcher cancels this task then (no task of its own for `work`, nor a race)."""
    leaving = Interrupt()
    done = False

    def cancel_on_leaving(watcher: asyncio.Future[None]) -> None:
        if watcher.cancelled():
            return
        watcher.exception()  # retrieved: a failed watch means the client is gone too
        if not done:  # a callback run after `work` ended cancels nothing
            leaving.fire()

    watcher = asyncio.ensure_future(_disconnected(request))
    watcher.add_done_callback(cancel_on_leaving)
    try:
        return await work
    except asyncio.CancelledError:
        if leaving.ours():
            raise Cancelled("the client closed the connection") from None
        raise
    finally:
        done = True
        watcher.cancel()


async def _disconnected(request: Request[Any, Any, Any]) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
