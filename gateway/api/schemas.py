"""Request bodies of the OpenAI-compatible API, decoded and validated by msgspec.

Unknown fields are ignored (clients send many); wrong types and out-of-range values
are rejected with the offending field named in `param`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct

from backend.sampling import MAX_COUNT, MAX_SEED
from gateway.errors import InvalidRequest
from tenants.limits import LOWEST_PRIORITY

# Every number is bounded: an unbounded integer reaches torch (tensors, generator seeds)
# and must be refused here, not fail inside the engine's step.
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
PositiveInt = Annotated[int, Meta(ge=1, le=MAX_COUNT)]
NonNegativeInt = Annotated[int, Meta(ge=0, le=MAX_COUNT)]
TokenId = Annotated[int, Meta(ge=0, le=MAX_COUNT)]
Seed = Annotated[int, Meta(ge=0, le=MAX_SEED)]
MAX_STOP_CHARS = 1024  # each stop string is searched for after every token
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]
StopList = Annotated[list[StopString], Meta(max_length=4)]
DeadlineMs = Annotated[int, Meta(ge=1, le=3_600_000)]  # an hour: longer is no deadline
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]


class StreamOptions(Struct):
    include_usage: bool = False


class TextPart(Struct):
    type: Literal["text"]
    text: str


class ChatMessage(Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class SamplingFields(Struct, kw_only=True):
    """Fields shared by chat and text completions."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: NonNegativeInt | None = None
    n: Annotated[int, Meta(ge=1, le=16)] = 1
    stop: StopString | StopList | None = None
    seed: Seed | None = None
    ignore_eos: bool = False
    min_tokens: NonNegativeInt = 0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=100.0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    priority: Annotated[int, Meta(ge=0, le=LOWEST_PRIORITY)] | None = None  # 0: most urgent
    ttft_deadline_ms: DeadlineMs | None = None  # the first token within this, else 504
    user: str | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def output_limit(self) -> int | None:
        return self.max_tokens

    def engine_logprobs(self) -> int | None:
        """How many alternatives per token the engine reports; None: no logprobs."""
        return None

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | Annotated[list[TokenId], Meta(min_length=1)]
    echo: bool = False
    logprobs: TopLogprobs | None = None

    def engine_logprobs(self) -> int | None:
        return self.logprobs


T = TypeVar("T")

_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def decode(body: bytes, kind: type[T]) -> T:
    """Decode a JSON body or raise InvalidRequest naming the offending field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(_clean(str(exc)), param=_param_of(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None


def _param_of(message: str) -> str | None:
    missing = _MISSING.search(message)
    at = _PATH.search(message)
    path = at.group(1) if at else ""
    if missing:
        return f"{path}.{missing.group(1)}" if path else missing.group(1)
    return path or None


def _clean(message: str) -> str:
    return _PATH.sub(lambda m: f" (at '{m.group(1)}')" if m.group(1) else "", message)


def encode(payload: Any) -> bytes:
    return msgspec.json.encode(payload)
