"""The ASGI middleware around the app that gives every /v1 request its telemetry scope
(gateway/telemetry/request.py) and every other request its access log line."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from gateway.telemetry.request import Telemetry, opened

log = logging.getLogger("tollgate.requests")


def observed(telemetry: Telemetry, app: ASGIApp) -> ASGIApp:
    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP:
            await app(scope, receive, send)
        elif scope["path"].startswith("/v1/"):
            await _serve(telemetry, app, scope, receive, send)
        else:
            await _serve_plain(app, scope, receive, send)

    return wrapped


async def _serve(
    telemetry: Telemetry, app: ASGIApp, scope: Scope, receive: Receive, send: Send
) -> None:
    method, path = str(scope.get("method")), scope["path"]
    headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
    with opened(telemetry, method, path, headers, access_fields(scope)) as request:

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                held = request.take_hold()
                if held is not None:  # raises, before anything is sent, if it failed
                    await asyncio.shield(held)
                request.status = message["status"]
            await send(message)

        await app(scope, receive, send_status)


def access_fields(scope: Scope) -> dict[str, Any]:
    """What an access log line says of a request: method, path (no query string: it may
    carry what a log must not) and the client's address (the one behind a trusted proxy)."""
    client = scope.get("client")
    return {
        "http_method": scope.get("method"),
        "http_path": scope["path"],
        "client_ip": client[0] if client else None,
    }


async def _serve_plain(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    """A request outside /v1 (admin API, console, probes): no span, one log line."""
    started = time.monotonic()
    status, request_id = 500, None

    async def send_status(message: Message) -> None:
        nonlocal status, request_id
        if message["type"] == "http.response.start":
            status = message["status"]
        await send(message)
        if message["type"] == "http.response.start":
            # The app's before_send hook (gateway.http.auth.echo_request_id), outside
            # this middleware, gave the answer its id in place as it went out.
            headers = dict(message.get("headers", ()))
            ours = headers.get(b"x-tollgate-request-id") or headers.get(b"x-request-id")
            request_id = ours.decode("latin-1") if ours else None

    try:
        await app(scope, receive, send_status)
    finally:
        line = {
            **access_fields(scope),
            "http_status": status,
            "duration_ms": round((time.monotonic() - started) * 1000, 3),
        }
        if request_id is not None:
            line["request_id"] = request_id
        log.info("request finished", extra=line)
