"""CORS for the OpenAI-compatible routes (/v1/*), so a page on another origin can call
them with fetch (the openai JS SDK's `dangerouslyAllowBrowser`). Off unless
TOLLGATE_CORS_ORIGINS lists origins; the console and admin API are never cross-origin.

Litestar's own CORS applies to every route and allows headers only by exact name; the
SDK sends a family of `x-stainless-*` headers that grows with its versions.
"""

from __future__ import annotations

from litestar.datastructures import Headers, MutableScopeHeaders
from litestar.enums import ScopeType
from litestar.types import (
    ASGIApp,
    HTTPResponseBodyEvent,
    HTTPResponseStartEvent,
    Message,
    Receive,
    Scope,
    Send,
)

METHODS = "GET, POST, OPTIONS"
HEADERS = frozenset(
    {
        "authorization",
        "content-type",
        "idempotency-key",
        "openai-organization",
        "openai-project",
        "x-request-id",
        "traceparent",
        "tracestate",
    }
)
SDK_HEADERS = "x-stainless-"  # any header of the openai SDKs' family
EXPOSED = ", ".join(
    (
        "x-request-id",
        "x-tollgate-request-id",
        *(
            f"x-ratelimit-{w}-{k}"
            for w in ("limit", "remaining", "reset")
            for k in ("requests", "tokens")
        ),
        "x-ratelimit-limit-concurrent-requests",
        "x-ratelimit-remaining-concurrent-requests",
        "retry-after",
        "x-should-retry",
        "idempotent-replayed",
    )
)
MAX_AGE_S = "600"


def allowed_headers(requested: str) -> list[str] | None:
    """The preflight's requested headers, if every one is allowed: the answer lists them
    (the browser checks it by name); None if one is not."""
    names = [name.strip().lower() for name in requested.split(",") if name.strip()]
    if all(name in HEADERS or name.startswith(SDK_HEADERS) for name in names):
        return names
    return None


class Cors:
    """Answers preflights of /v1/* from an allowed origin, and lets the browser read
    the answers' ids and rate-limit headers. Anything else passes through untouched (a
    browser then refuses the response to the page)."""

    def __init__(self, origins: tuple[str, ...]) -> None:
        self.any_origin = "*" in origins
        self.origins = frozenset(origins)

    def allows(self, origin: str) -> bool:
        return self.any_origin or origin in self.origins

    def middleware(self, app: ASGIApp) -> ASGIApp:
        async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != ScopeType.HTTP or not scope["path"].startswith("/v1/"):
                await app(scope, receive, send)
                return
            headers = Headers.from_scope(scope)
            origin = headers.get("origin", "")
            if not origin or not self.allows(origin):  # not a cross-origin call we allow
                await app(scope, receive, send)
            elif scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
                await self._preflight(origin, headers, send)
            else:
                await app(scope, receive, self._exposing(origin, send))

        return wrapped

    async def _preflight(self, origin: str, headers: Headers, send: Send) -> None:
        names = allowed_headers(headers.get("access-control-request-headers", ""))
        answer: list[tuple[bytes, bytes]] = [(b"vary", b"Origin")]
        if names is not None:
            answer += [
                (b"access-control-allow-origin", origin.encode("latin-1")),
                (b"access-control-allow-methods", METHODS.encode()),
                (b"access-control-allow-headers", ", ".join(names).encode("latin-1")),
                (b"access-control-max-age", MAX_AGE_S.encode()),
            ]
        start: HTTPResponseStartEvent = {
            "type": "http.response.start",
            "status": 204,
            "headers": answer,
        }
        await send(start)
        body: HTTPResponseBodyEvent = {
            "type": "http.response.body",
            "body": b"",
            "more_body": False,
        }
        await send(body)

    def _exposing(self, origin: str, send: Send) -> Send:
        async def exposing(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableScopeHeaders.from_message(message)
                headers["access-control-allow-origin"] = origin
                headers["access-control-expose-headers"] = EXPOSED
                headers.add("vary", "Origin")
            await send(message)

        return exposing
