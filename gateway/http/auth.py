"""API key authentication: `Authorization: Bearer tg-…`, looked up by prefix, hash compared
in constant time."""

from __future__ import annotations

import re
import uuid
from typing import Any

from litestar import Request
from litestar.datastructures import Headers, MutableScopeHeaders
from litestar.di import NamedDependency
from litestar.types import Message, Scope

from gateway.admission.key_cache import read_key_generation
from gateway.core.errors import AuthenticationFailed
from gateway.runtime import Runtime
from gateway.telemetry import current_request
from gateway.telemetry.request import client_request_id
from tenants import keys
from tenants.audit import AuditContext, client_address
from tenants.services import ApiKeyService, Principal

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
_AUDIT_CONTEXT = "audit_context"  # where a request keeps its context, in its scope state


def new_request_id() -> str:
    return "req_" + uuid.uuid4().hex


def audit_context(request: Request[Any, Any, Any]) -> AuditContext:
    """Request id (the caller's X-Request-Id if it is sane, else a new one), client IP and
    user agent, for the audit log. One per request, so all its events share the id that
    `echo_request_id` sends back."""
    known = request.state.get(_AUDIT_CONTEXT)
    if isinstance(known, AuditContext):
        return known
    given = request.headers.get("x-request-id", "")
    request_id = given if _REQUEST_ID.match(given) else new_request_id()
    user_agent = request.headers.get("user-agent")
    context = AuditContext(
        request_id=request_id,
        ip=request.client.host if request.client else None,
        user_agent=user_agent[:400] if user_agent else None,
    )
    request.state[_AUDIT_CONTEXT] = context
    return context


async def echo_request_id(message: Message, scope: Scope) -> None:
    """A `before_send` hook: every answer, errors included, carries the request's one id.
    A generation request's is the one its ledger row carries (an error answer may have a
    row too); any other's, the one its audit events recorded, or a new one. The request's
    span and its "request finished" log line take the same id. A caller that sent its own
    well-formed x-request-id gets it back (its log lines and span carry it as
    client_request_id), with the gateway's id in x-tollgate-request-id."""
    if message["type"] != "http.response.start":
        return
    headers = MutableScopeHeaders.from_message(message)
    request = current_request()
    context = scope.get("state", {}).get(_AUDIT_CONTEXT)
    audit_id = context.request_id if isinstance(context, AuditContext) else None
    request_id = headers.get("x-request-id") or request.request_id or audit_id or new_request_id()
    request.assign_id(request_id)
    given = client_request_id(Headers.from_scope(scope))
    if given is not None and given != request_id:  # the caller's id back; ours beside it
        headers["x-tollgate-request-id"] = request_id
    headers["x-request-id"] = given or request_id


def bearer_token(request: Request[Any, Any, Any]) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


async def authenticate(
    request: Request[Any, Any, Any], runtime: NamedDependency[Runtime]
) -> Principal:
    token = bearer_token(request)
    if token is None:
        note_failure(request, runtime, None, "missing_key")
        raise AuthenticationFailed(
            "missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key"
        )
    scope = current_request()
    with scope.span("authenticate"):
        principal = await _principal(request, runtime, token)
    if principal is None:
        note_failure(request, runtime, keys.key_prefix(token), "invalid_key")
        # The same answer for unknown, malformed and revoked keys: no oracle for attackers.
        raise AuthenticationFailed("invalid or revoked API key")
    scope.identify(principal)
    return principal


async def _principal(
    request: Request[Any, Any, Any], runtime: Runtime, token: str
) -> Principal | None:
    """The caller remembered under the current key generation (gateway/admission/key_cache),
    else the key's lookup. The generation is the listener's while it is live (PostgreSQL),
    read on the loop's own connection (SQLite), else read through the pool."""
    known = runtime.generations or runtime.sqlite_generation
    generation = known.current() if known is not None else None
    if generation is None:
        generation = await read_key_generation(runtime.direct)
    principal = runtime.keys.get(token, generation)
    if principal is not None:
        return principal
    async with runtime.sessions.begin() as session:
        principal = await ApiKeyService(session).authenticate(token, context=audit_context(request))
    if principal is not None:
        runtime.keys.put(token, principal, generation)
    return principal


def note_failure(
    request: Request[Any, Any, Any], runtime: Runtime, key_prefix: str | None, reason: str
) -> None:
    """Count a refused caller for the aggregated `auth.failures` audit event."""
    if runtime.auth_failures is not None:
        ip = client_address(request.client.host if request.client else None)
        runtime.auth_failures.note(ip, key_prefix, reason)
