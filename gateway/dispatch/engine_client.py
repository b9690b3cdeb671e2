"""The one seam between gateway and engine.

The in-process client wraps `backend.AsyncEngine`; remote replicas over HTTP plug in
behind the same protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any, Protocol

from backend import AsyncEngine, EngineConfig, RequestOutput, SamplingParams
from backend.errors import (
    DeadlineExceededError,
    InvalidParameterError,
    OverloadedError,
    RequestFailedError,
)
from backend.telemetry import traced
from gateway.errors import ApiError, DeadlineExceeded, InternalError, InvalidRequest, Overloaded
from gateway.telemetry.request import current_request

IN_PROCESS = "in-process"  # the replica name of the engine in this process
RESTART = "restart"
"""finish_reason of the marker output a restartable request's retry on another replica
begins with: what came before it is void."""


class EngineClient(Protocol):
    model_name: str
    max_model_len: int
    max_token_chars: int  # the tokenizer's bound on characters per token
    tool_call_parser: str  # the model's tool-call format (gateway/api/tools.py PARSERS)
    hidden_size: int | None  # the length of an embedding (None: a replica did not say)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_text(self, token_id: int) -> str: ...

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """The chat template's prompt; `tools` and the messages' tool calls follow Hugging
        Face's convention. Raises ValueError when the template refuses the messages."""
        ...

    def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        tenant: str | None = None,
        weight: int = 1,
        deadline: float | None = None,
        restartable: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """`deadline`: time.monotonic() by which the first token is due. Raises Overloaded
        (503, Retry-After) or DeadlineExceeded (504) when the engine's policy rejects it.
        `restartable`: the caller sends nothing on until the end, so the request may be
        started over elsewhere after an output with finish_reason RESTART."""
        ...

    async def embed(self, prompts: list[list[int]]) -> list[list[float]]:
        """Each prompt's mean-pooled final hidden states. Raises Overloaded when the
        engine has no room for them now."""
        ...

    def abort(self, request_id: str) -> None: ...

    def is_ready(self) -> bool: ...

    def is_alive(self) -> bool:
        """False once an engine this process runs has died for good: the liveness probe
        fails so a supervisor restarts the process. (Remote replicas are probed and
        restarted on their own.)"""
        ...

    async def close(self) -> None: ...


class InProcessEngineClient:
    """The engine in this process; its step loop runs in its own thread."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.max_token_chars = engine.tokenizer.max_token_chars
        self.tool_call_parser = engine.tokenizer.tool_call_parser
        self.hidden_size: int | None = engine.engine.model_config.hidden_size

    @classmethod
    async def load(cls, model_path: Path, config: EngineConfig) -> InProcessEngineClient:
        # Loading reads weights from disk: keep it off the event loop.
        engine = await asyncio.to_thread(AsyncEngine.from_pretrained, model_path, config)
        return cls(engine)

    def encode(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.engine.tokenizer.decode(ids)

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        return self.engine.tokenizer.apply_chat_template(messages, tools=tools)

    def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        tenant: str | None = None,
        weight: int = 1,
        deadline: float | None = None,
        restartable: bool = False,  # one engine: nowhere else to restart
    ) -> AsyncIterator[RequestOutput]:
        outputs = self.engine.generate(
            prompt,
            params,
            request_id=request_id,
            priority=priority,
            deadline=deadline,
            tenant=tenant,
            weight=weight,
        )
        current_request().route(IN_PROCESS)
        return policy_errors(traced(outputs, request_id))  # traced: engine phase spans

    async def embed(self, prompts: list[list[int]]) -> list[list[float]]:
        current_request().route(IN_PROCESS)
        try:
            return await self.engine.embed(prompts)
        except ENGINE_REFUSALS as exc:
            raise refusal(exc) from exc

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def is_ready(self) -> bool:
        return self.engine.is_running()

    def is_alive(self) -> bool:
        return not self.engine.has_crashed()

    async def close(self) -> None:
        await self.engine.shutdown()


def overloaded(retry_after_s: float, message: str) -> Overloaded:
    retry_after = str(max(1, round(retry_after_s)))
    return Overloaded(message, headers={"Retry-After": retry_after})


ENGINE_REFUSALS = (
    InvalidParameterError,
    OverloadedError,
    DeadlineExceededError,
    RequestFailedError,
)


def refusal(
    exc: InvalidParameterError | OverloadedError | DeadlineExceededError | RequestFailedError,
) -> ApiError:
    """What the engine refused on purpose, as the gateway's typed error."""
    if isinstance(exc, InvalidParameterError):
        return InvalidRequest(str(exc), param=exc.param)
    if isinstance(exc, OverloadedError):
        return overloaded(exc.retry_after_s, str(exc))
    if isinstance(exc, DeadlineExceededError):
        return DeadlineExceeded(str(exc))
    return InternalError(str(exc), code=RequestFailedError.kind)


async def policy_errors(
    outputs: AsyncGenerator[RequestOutput, None],
) -> AsyncGenerator[RequestOutput, None]:
    """The engine's refusals (invalid parameters, scheduling rejections) as the gateway's
    typed errors. Closing this closes the engine's stream at once, which aborts the
    request there."""
    try:
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                yield out
    except ENGINE_REFUSALS as exc:
        raise refusal(exc) from exc
