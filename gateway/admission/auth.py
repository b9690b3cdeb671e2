"""API key authentication: `Authorization: Bearer tg-…`, looked up by prefix, hash compared
in constant time."""

from __future__ import annotations

from typing import Any

from litestar import Request
from litestar.di import NamedDependency

from gateway.errors import AuthenticationFailed
from gateway.runtime import Runtime
from tenants.services import ApiKeyService, Principal


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
        raise AuthenticationFailed(
            "missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key"
        )
    async with runtime.sessions.begin() as session:
        principal = await ApiKeyService(session).authenticate(token)
    if principal is None:
        # The same answer for unknown, malformed and revoked keys: no oracle for attackers.
        raise AuthenticationFailed("invalid or revoked API key")
    return principal
