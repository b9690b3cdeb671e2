"""The one seam between gateway and engine.

The in-process client wraps `backend.AsyncEngine`; Tollgate backend replicas over HTTP
(remote.py) and OpenAI-compatible upstreams (upstream.py) plug in behind the same
protocol. Counting a prompt is async at the seam: an upstream without a local tokenizer
asks its server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from backend import EngineConfig, EngineRequest, RequestOutput
from backend.errors import (
    DeadlineExceededError,
    InvalidParameterError,
    OverloadedError,
    RequestFailedError,
)
from backend.telemetry import traced
from backend.tokenizer import Tokenizer
from gateway.core.errors import (
    ApiError,
    DeadlineExceeded,
    InternalError,
    InvalidRequest,
    Overloaded,
)
from gateway.telemetry.request import current_request

if TYPE_CHECKING:  # torch comes with it: a gateway fronting replicas never loads it
    from backend import AsyncEngine

IN_PROCESS = "in-process"  # the replica name of the engine in this process
RESTART = "restart"
"""finish_reason of the marker output a restartable request's retry on another replica
begins with: what came before it is void."""
TARGET_PARSES = "target"
"""tool_call_parser of a target that finds the tool calls in its output itself (an
OpenAI-compatible upstream): the gateway forwards the tools and relays the calls."""
# Past this many characters, tokenizing takes long enough (about 2.5 ms per 10k characters
# on a 2-core machine) to hold up every other request on the event loop: it runs in a thread.
INLINE_TOKENIZE_CHARS = 4096
# What a chat template adds per message (role markers, separators: 17 characters for the
# built-in model's, about 50 for Llama 3's), counted as characters of work: 100k empty
# messages render to megabytes, so their count, not their content, says what is long.
TEMPLATE_CHARS_PER_MESSAGE = 32
T = TypeVar("T")


@dataclass(frozen=True)
class ClientPrompt:
    """The prompt as the client sent it, for a target that tokenizes and templates it
    itself (an OpenAI-compatible upstream): chat messages, or a completion's text; with
    neither, the token ids are the prompt. Tollgate's own engines use the ids.

    `fields`: the client's request fields such a target answers itself (`response_format`,
    `tools`, `tool_choice`, `parallel_tool_calls`), in OpenAI's JSON, forwarded as sent.
    Tollgate's own engines get their meaning from SamplingParams and the tool plan."""

    messages: list[dict[str, Any]] | None = None
    text: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GenerateRequest(EngineRequest):
    """One generation request at the dispatch seam, whatever serves it: the engine's
    request (backend.EngineRequest: what reaches an engine, in process or over the wire)
    and what only the gateway's side uses.

    `prompt` is the gateway's tokens of the prompt; `source` the prompt as the client sent
    it (for a target that tokenizes it itself). `restartable`: the caller sends nothing on
    until the end, so the request may be started over elsewhere after an output with
    finish_reason RESTART."""

    prompt: list[int]
    restartable: bool = False
    source: ClientPrompt | None = None


class EngineClient(Protocol):
    model_name: str
    max_model_len: int
    max_token_chars: int  # the tokenizer's bound on characters per token
    # The model's tool-call format (gateway/api/tools.py PARSERS), or TARGET_PARSES: the
    # target parses its output's tool calls itself and sends them as OpenAI's `tool_calls`.
    tool_call_parser: str
    hidden_size: int | None  # the length of an embedding (None: a replica did not say)

    async def tokenize(self, text: str) -> list[int]: ...

    async def tokenize_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The chat template applied, then tokenized; `tools` and the messages' tool calls
        follow Hugging Face's convention. InvalidRequest (param `messages`) when the
        template refuses the messages."""
        ...

    def decode(self, ids: list[int]) -> str: ...

    def token_text(self, token_id: int) -> str: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Raises Overloaded (503, Retry-After) or DeadlineExceeded (504) when the
        engine's policy rejects the request."""
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

    def interactive_work(self) -> int:
        """Requests below the batch class running or waiting behind this client (a batch
        runner starts no line while there are any); 0 where it cannot tell."""
        ...

    async def close(self) -> None: ...


class LocalTokens:
    """Counting with a tokenizer in this process (the engine's, a replica's, or an
    upstream's local folder); a long text is tokenized in a thread."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.max_token_chars = tokenizer.max_token_chars
        self.tool_call_parser = tokenizer.tool_call_parser

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools)
        except InvalidParameterError as exc:  # the template refused these messages
            raise InvalidRequest(str(exc), param="messages") from None

    async def tokenize(self, text: str) -> list[int]:
        return await _off_loop_if_long(len(text), self.encode, text)

    async def tokenize_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        chars = chat_chars(sum(len(str(m.get("content") or "")) for m in messages), len(messages))
        return await _off_loop_if_long(
            chars, lambda: self.encode(self.render_chat(messages, tools))
        )


def chat_chars(content_chars: int, messages: int) -> int:
    """The characters a chat's rendering works through: its content and its template's."""
    return content_chars + TEMPLATE_CHARS_PER_MESSAGE * messages


async def _off_loop_if_long(chars: int, work: Callable[..., T], *args: Any) -> T:
    if chars <= INLINE_TOKENIZE_CHARS:
        return work(*args)
    return await asyncio.to_thread(work, *args)


class InProcessEngineClient(LocalTokens):
    """The engine in this process; its step loop runs in its own thread."""

    def __init__(self, engine: AsyncEngine) -> None:
        super().__init__(engine.tokenizer)
        self.engine = engine
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.hidden_size: int | None = engine.engine.model_config.hidden_size

    @classmethod
    async def load(cls, model_path: Path, config: EngineConfig) -> InProcessEngineClient:
        from backend import AsyncEngine  # torch, only for a gateway running an engine

        # Loading reads weights from disk: keep it off the event loop.
        engine = await asyncio.to_thread(AsyncEngine.from_pretrained, model_path, config)
        return cls(engine)

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """One engine: nowhere to restart; it runs the gateway's tokens, not `source`."""
        outputs = self.engine.generate(request)
        current_request().route(IN_PROCESS)
        return policy_errors(traced(outputs, request.request_id))  # traced: engine phase spans

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

    def interactive_work(self) -> int:
        return self.engine.engine.num_interactive()

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
