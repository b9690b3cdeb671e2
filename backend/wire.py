"""The internal HTTP API's wire protocol, shared by the replica (backend/server.py) and
the gateway's client of it (gateway/dispatch/remote.py): one typed struct per body.

`POST /internal/generate` takes a GenerateBody and streams newline-delimited JSON, one
Line per line: an OutputLine (`{"type": "output", "output": {RequestOutput}}`) or an
ErrorLine (`{"type": "error", "kind", "message", "param", "retry_after_s"}`). A refusal
before the stream (a bad body: 400; the engine not running: 503) and every other route's
refusal is an ErrorLine body. The error's kind names the engine's error type, so each
side maps it by kind alone: ErrorLine.of(exc) on the replica, .exception() on the gateway.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Literal

import msgspec

from backend.errors import (
    DeadlineExceededError,
    EngineDeadError,
    EngineError,
    InvalidParameterError,
    OverloadedError,
    RequestFailedError,
)
from backend.outputs import EngineStats, RequestOutput
from backend.requests import EngineRequest

SECRET_HEADER = "x-tollgate-secret"  # noqa: S105 (a header name, not a secret)

ErrorKind = Literal[
    "invalid_request", "overloaded", "deadline_exceeded", "request_failed", "engine_dead"
]


@dataclass(frozen=True)
class GenerateBody(EngineRequest):
    """The request, its first-token deadline relative (`timeout_s`: clocks differ by host;
    `deadline` goes as null). A replica takes token ids only (the gateway counted them for
    the reservation)."""

    prompt: list[int]
    timeout_s: float | None = None

    @classmethod
    def sent(cls, request: EngineRequest) -> GenerateBody:
        """`request` on the wire, its deadline made relative to now."""
        deadline = request.deadline
        timeout_s = None if deadline is None else deadline - time.monotonic()
        return cls(**{**EngineRequest.fields_of(request), "deadline": None}, timeout_s=timeout_s)

    def received(self) -> GenerateBody:
        """This body on the replica's clock: its deadline absolute again."""
        timeout_s = self.timeout_s
        return replace(self, deadline=None if timeout_s is None else time.monotonic() + timeout_s)


class EmbedBody(msgspec.Struct, frozen=True):
    prompts: list[list[int]]


class EmbedReply(msgspec.Struct, frozen=True):
    embeddings: list[list[float]]  # one mean-pooled vector per prompt


class AbortBody(msgspec.Struct, frozen=True):
    request_id: str


class OutputLine(msgspec.Struct, frozen=True, tag="output"):
    output: RequestOutput


class ErrorLine(msgspec.Struct, frozen=True, tag="error"):
    """A refusal: `param` names the parameter at fault (invalid_request), `retry_after_s`
    when to try again (overloaded)."""

    kind: ErrorKind
    message: str
    param: str | None = None
    retry_after_s: float | None = None

    @classmethod
    def of(cls, exc: EngineError) -> ErrorLine:
        """The engine's error on the wire; an unknown EngineError is request_failed."""
        if isinstance(exc, InvalidParameterError):
            return cls("invalid_request", str(exc), param=exc.param)
        if isinstance(exc, OverloadedError):
            return cls("overloaded", str(exc), retry_after_s=exc.retry_after_s)
        if isinstance(exc, DeadlineExceededError):
            return cls("deadline_exceeded", str(exc))
        if isinstance(exc, EngineDeadError):
            return cls("engine_dead", str(exc))
        return cls("request_failed", str(exc))

    def exception(self) -> EngineError:
        """The engine's error this line stands for, as the replica raised it."""
        if self.kind == "invalid_request":
            return InvalidParameterError(self.message, self.param)
        if self.kind == "overloaded":
            return OverloadedError(self.message, self.retry_after_s or 1.0)
        if self.kind == "deadline_exceeded":
            return DeadlineExceededError(self.message)
        if self.kind == "engine_dead":
            return EngineDeadError(self.message)
        return RequestFailedError(self.message)


Line = OutputLine | ErrorLine
REFUSALS = (
    InvalidParameterError,
    OverloadedError,
    DeadlineExceededError,
    RequestFailedError,
    EngineDeadError,
)  # what the replica answers with an ErrorLine; anything else breaks the stream


class StatsReply(msgspec.Struct, frozen=True):
    """What gateways route by, of `GET /internal/stats`; the reply carries every
    EngineStats field (stats_reply), and `running` is false while the replica drains."""

    running: bool
    num_running: int = 0
    num_waiting: int = 0
    num_interactive: int = 0  # of those, below the batch class (batch runners wait for 0)
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    busy_s: float = 0.0  # seconds spent stepping, and of those the batch class's (console)
    batch_busy_s: float = 0.0
    running_lora_adapters: list[str] = msgspec.field(default_factory=list)
    loaded_lora_adapters: list[str] = msgspec.field(default_factory=list)  # in a slot


def stats_reply(running: bool, stats: EngineStats) -> dict[str, object]:
    """The stats reply: `running` beside every field of the engine's snapshot."""
    fields: dict[str, object] = msgspec.to_builtins(stats)
    return {"running": running, **fields}


def invalid_body(exc: Exception) -> ErrorLine:
    """A body that does not decode, as an invalid_request line: the message and the
    parameter at fault, if named (msgspec wraps a SamplingParams refusal in its
    ValidationError; the cause keeps it)."""
    cause = exc if isinstance(exc, InvalidParameterError) else exc.__cause__
    param = cause.param if isinstance(cause, InvalidParameterError) else None
    return ErrorLine("invalid_request", str(exc), param=param)


LINES = msgspec.json.Decoder(Line)  # one line of a generate stream
ERRORS = msgspec.json.Decoder(ErrorLine)  # a refusal's body
