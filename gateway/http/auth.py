"""API key authentication: `Authorization: Bearer tg-…`, looked up by prefix, hash compared
in constant time."""

from __future__ import annotations

import re
import uuid
from functools import partial
from typing import Any

from litestar import Request
from litestar.datastructures import Headers, MutableScopeHeaders
from litestar.di import NamedDependency
from litestar.types import Message, Scope

from gateway.admission.authentication import KeyAuthentication
from gateway.core.errors import AuthenticationFailed
from gateway.telemetry import current_request
from gateway.telemetry.request import client_request_id
from tenants import keys
from tenants.audit import AuditContext, client_address
from tenants.services import Principal

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
    request: Request[Any, Any, Any], authentication: NamedDependency[KeyAuthentication]
) -> Principal:
    token = bearer_token(request)
    if token is None:
        note_failure(request, authentication, None, "missing_key")
        raise AuthenticationFailed(
            "missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key"
        )
    scope = current_request()
    with scope.span("authenticate"):
        principal = await authentication.principal(token, partial(audit_context, request))
    if principal is None:
        note_failure(request, authentication, keys.key_prefix(token), "invalid_key")
        # The same answer for unknown, malformed and revoked keys: no oracle for attackers.
        raise AuthenticationFailed("invalid or revoked API key")
    scope.identify(principal)
    return principal


def note_failure(
    request: Request[Any, Any, Any],
    authentication: KeyAuthentication,
    key_prefix: str | None,
    reason: str,
) -> None:
    """Count a refused caller for the aggregated `auth.failures` audit event."""
    ip = client_address(request.client.host if request.client else None)
    authentication.note_failure(ip, key_prefix, reason)
