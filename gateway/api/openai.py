"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import uuid
from typing import Any

from litestar import Controller, MediaType, Request, Response, get, post
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath
from litestar.response import Stream

from backend import SamplingParams
from gateway.admission.auth import authenticate
from gateway.api import generation
from gateway.api.generation import ChatFormat, Format, Job, TextFormat
from gateway.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    decode,
)
from gateway.dispatch.engine_client import EngineClient
from gateway.errors import ContextLengthExceeded, InvalidRequest, NotFound
from gateway.metering import Charge
from gateway.runtime import Runtime
from tenants.services import Principal

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def new_request_id() -> str:
    return "req_" + uuid.uuid4().hex


def _check_model(name: str, engine: EngineClient) -> None:
    if name != engine.model_name:
        raise NotFound(
            f"the model {name!r} does not exist; GET /v1/models lists the available ones",
            param="model",
            code="model_not_found",
        )


def _sampling(fields: SamplingFields, limit: int | None, room: int) -> SamplingParams:
    if limit is not None and limit > room:
        raise InvalidRequest(
            f"max_tokens is {limit} but only {room} tokens fit after the prompt "
            "in the model's context",
            param="max_tokens",
            code="context_length_exceeded",
        )
    try:
        return SamplingParams(
            max_tokens=limit or room,
            temperature=1.0 if fields.temperature is None else fields.temperature,
            top_p=1.0 if fields.top_p is None else fields.top_p,
            top_k=fields.top_k or 0,
            seed=fields.seed,
            stop=fields.stop_strings(),
            ignore_eos=fields.ignore_eos,
        )
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def _room(prompt: list[int], engine: EngineClient, param: str) -> int:
    room = engine.max_model_len - len(prompt)
    if room <= 0:
        raise ContextLengthExceeded(
            f"the prompt is {len(prompt)} tokens; this model's context is "
            f"{engine.max_model_len} tokens",
            param=param,
        )
    return room


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
        _check_model(body.model, engine)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            rendered = engine.render_chat(messages)
        except ValueError as exc:  # the template refused these messages (e.g. role order)
            raise InvalidRequest(str(exc), param="messages") from None
        prompt = engine.encode(rendered)
        params = _sampling(body, body.output_limit(), _room(prompt, engine, "messages"))
        return await _run(runtime, principal, body, ChatFormat, "chat.completions", prompt, params)

    @post("/completions", status_code=200)
    async def completions(
        self,
        request: Request[Any, Any, Any],
        principal: NamedDependency[Principal],
        runtime: NamedDependency[Runtime],
    ) -> Response[Any]:
        body = decode(await request.body(), CompletionRequest)
        engine = runtime.engine
        _check_model(body.model, engine)
        prompt = engine.encode(body.prompt) if isinstance(body.prompt, str) else body.prompt
        if not prompt:
            raise InvalidRequest("the prompt is empty", param="prompt")
        params = _sampling(body, body.output_limit(), _room(prompt, engine, "prompt"))
        return await _run(runtime, principal, body, TextFormat, "completions", prompt, params)

    @get("/models")
    async def list_models(
        self, runtime: NamedDependency[Runtime], principal: NamedDependency[Principal]
    ) -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(runtime.engine)]}

    @get("/models/{model_id:str}")
    async def get_model(
        self,
        model_id: FromPath[str],
        runtime: NamedDependency[Runtime],
        principal: NamedDependency[Principal],
    ) -> dict[str, Any]:
        engine = runtime.engine
        _check_model(model_id, engine)
        return _model_card(engine)


def _model_card(engine: EngineClient) -> dict[str, Any]:
    return {
        "id": engine.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "tollgate",
        "max_model_len": engine.max_model_len,
    }


async def _run(
    runtime: NamedDependency[Runtime],
    principal: NamedDependency[Principal],
    body: SamplingFields,
    fmt: Format,
    endpoint: str,
    prompt: list[int],
    params: SamplingParams,
) -> Response[Any]:
    request_id = new_request_id()
    job = Job(
        charge=Charge(request_id, principal, body.model, endpoint),
        format=fmt,
        prompt=prompt,
        params=params,
        include_usage=body.include_usage(),
    )
    headers = {"x-request-id": request_id}
    if body.stream:
        return Stream(
            generation.stream(job, runtime.engine, runtime.recorder),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **headers},
        )
    result = await generation.complete(job, runtime.engine, runtime.recorder)
    return Response(result, media_type=MediaType.JSON, headers=headers)
