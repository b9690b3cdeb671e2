"""POST /v1/embeddings: the model's mean-pooled final hidden states, billed as input tokens.

One ledger row per request (endpoint `embeddings`, no output tokens), admitted with a
worst case of its input tokens, through the same admission and idempotency as chat.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import struct
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Annotated, Any, Literal

from litestar import Controller, Request, Response, post
from litestar.di import NamedDependency, Provide
from msgspec import Meta, Struct

from backend import SamplingParams
from gateway.admission import policy
from gateway.api.generation import api_error
from gateway.api.openai import admit, respond_whole, tokenize
from gateway.api.schemas import PositiveInt, TokenId, decode
from gateway.api.services import GenerationServices
from gateway.core.errors import InvalidRequest, Overloaded
from gateway.core.usage import Charge, RequestUsage
from gateway.dispatch.engine_client import EngineClient
from gateway.http.auth import authenticate, new_request_id
from gateway.openapi import GENERATION, route
from gateway.openapi.shapes import EmbeddingList
from gateway.telemetry import current_request
from tenants.models import UsageStatus
from tenants.services import Principal

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
NOTHING_GENERATED = SamplingParams(max_tokens=1)  # what an embedding's span reports


class EmbeddingRequest(Struct, kw_only=True):
    model: str
    # A string, strings, token ids, or lists of token ids (checked to be one kind below).
    input: (
        Annotated[str, Meta(min_length=1)]
        | Annotated[list[str | TokenId | list[TokenId]], Meta(min_length=1, max_length=MAX_INPUTS)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveInt | None = None
    user: str | None = None

    def texts(self) -> list[str] | None:
        """The inputs as text, or None when they are token ids."""
        if isinstance(self.input, str):
            return [self.input]
        if all(isinstance(i, str) for i in self.input):
            return [i for i in self.input if isinstance(i, str)]
        return None

    def token_ids(self) -> list[list[int]]:
        """The inputs as token ids: one list, or a list of lists."""
        if all(isinstance(i, int) for i in self.input):
            return [[i for i in self.input if isinstance(i, int)]]
        if all(isinstance(i, list) and i for i in self.input):
            return [i for i in self.input if isinstance(i, list)]
        raise InvalidRequest(
            "input must be a string, a list of strings, a list of token ids, or a list of "
            "non-empty lists of token ids",
            param="input",
        )

    def check_dimensions(self, hidden_size: int | None) -> None:
        if self.dimensions is not None and self.dimensions != hidden_size:
            raise InvalidRequest(
                f"dimensions must be this model's embedding size ({hidden_size}): "
                "shortened embeddings are not supported",
                param="dimensions",
            )


@dataclass
class Embedding:
    """One admitted embeddings request, as telemetry reads it (gateway.core.usage.Metered)."""

    charge: Charge
    inputs: list[list[int]]
    started: float = field(default_factory=time.monotonic)

    @property
    def params(self) -> SamplingParams:
        return NOTHING_GENERATED

    @property
    def prompt(self) -> list[int]:
        return list(itertools.chain.from_iterable(self.inputs))

    @property
    def response_id(self) -> str:
        return self.charge.request_id


class EmbeddingsController(Controller):
    path = "/v1"
    dependencies = {"principal": Provide(authenticate)}

    @route(
        post,
        "/embeddings",
        EmbeddingList,
        body=EmbeddingRequest,
        errors=GENERATION,
        idempotent=True,
    )
    async def create_embeddings(
        self,
        request: Request[Any, Any, Any],
        principal: NamedDependency[Principal],
        services: NamedDependency[GenerationServices],
    ) -> Response[Any]:
        body = decode(await request.body(), EmbeddingRequest)
        return await embed(request, services, principal, body)


async def embed(
    request: Request[Any, Any, Any],
    services: GenerationServices,
    principal: Principal,
    body: EmbeddingRequest,
    endpoint: str = "embeddings",
    priority: int | None = None,  # None: the plan's default
) -> Response[Any]:
    engine, adapter = services.directory.ready(body.model, principal.tenant_id)
    if adapter is not None:  # the tenant's own: it may know the adapter exists
        raise InvalidRequest(
            f"{body.model!r} is a LoRA adapter; embeddings come from base models only",
            param="model",
            code="model_not_supported",
        )
    policy.check_model(principal, body.model)
    body.check_dimensions(engine.hidden_size)
    inputs = await _inputs(body, engine, services, principal)
    if priority is None:
        priority = policy.priority(principal, None)
    charge = Charge(new_request_id(), principal, body.model, endpoint, priority=priority)
    job = Embedding(charge, inputs)
    current_request().describe(job, stream=False)
    tokens = sum(map(len, inputs))
    admitted = await admit(request, services, principal, charge, tokens, 0)
    if isinstance(admitted, Response):
        return admitted
    job.charge = admitted.charge
    embedded = _embed(job, engine, services, body)
    return await respond_whole(request, services, admitted, embedded)


async def _inputs(
    body: EmbeddingRequest, engine: EngineClient, services: GenerationServices, principal: Principal
) -> list[list[int]]:
    """Each input's token ids, each within the model's context."""
    texts = body.texts()
    if texts is None:
        inputs = body.token_ids()
    else:
        for text in texts:
            policy.check_prompt_chars(
                len(text), engine.max_model_len, engine.max_token_chars, "input"
            )
        chars = sum(map(len, texts))
        inputs = await tokenize(services, principal, chars, partial(_encode_all, engine, texts))
    for ids in inputs:
        policy.room_for_output(len(ids), engine.max_model_len, "input")
    return inputs


async def _embed(
    job: Embedding, engine: EngineClient, services: GenerationServices, body: EmbeddingRequest
) -> dict[str, Any]:
    """The vectors, and the one ledger row: billed for the input, free if refused."""
    usage = RequestUsage(prompt_tokens=sum(map(len, job.inputs)))
    try:
        vectors = await engine.embed(job.inputs)
    except asyncio.CancelledError:  # the client left: the work was asked for
        usage.status = UsageStatus.CANCELLED
        _settle(job, services, usage)
        raise
    except Exception as exc:  # refused or failed: free (see UsageRecorder)
        error = api_error(exc)
        refused = isinstance(error, Overloaded)
        usage.status = UsageStatus.REJECTED if refused else UsageStatus.FAILED
        usage.error = error.code or error.type
        _settle(job, services, usage)
        if isinstance(error, InvalidRequest):  # the engine names the input "prompt"
            raise InvalidRequest(error.message, param="input") from exc
        raise error from exc
    await asyncio.shield(_settle(job, services, usage))
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
            for i, v in enumerate(vectors)
        ],
        "model": job.charge.model,
        "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens},
    }


async def _encode_all(engine: EngineClient, texts: list[str]) -> list[list[int]]:
    return [await engine.tokenize(text) for text in texts]


def _settle(
    job: Embedding, services: GenerationServices, usage: RequestUsage
) -> asyncio.Task[None]:
    usage.e2e_ms = (time.monotonic() - job.started) * 1000
    current_request().finish(job, usage)
    return services.recorder.settle(job.charge, usage)


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """As OpenAI sends it: floats, or base64 of little-endian float32."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
