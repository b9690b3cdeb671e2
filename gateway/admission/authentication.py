"""Who an API key is: the principal remembered under the current key generation
(gateway/admission/key_cache.py), else the key's lookup; and refused callers, counted
for the aggregated `auth.failures` audit event."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from gateway.admission.auth_failures import AuthFailureLog
from gateway.admission.key_cache import KeyCache, read_key_generation
from tenants.audit import AuditContext
from tenants.services import ApiKeyService, Principal


class KnownGeneration(Protocol):
    """The key generation as a listener (PostgreSQL) or the loop's connection (SQLite)
    knows it; None while it cannot tell."""

    def current(self) -> int | None: ...


@dataclass(frozen=True)
class KeyAuthentication:
    sessions: async_sessionmaker[AsyncSession]
    direct: AsyncEngine  # a read of the generation through the pool, when nothing knows it
    keys: KeyCache
    known: KnownGeneration | None
    failures: AuthFailureLog | None

    async def principal(self, token: str, context: Callable[[], AuditContext]) -> Principal | None:
        """The caller remembered under the current key generation, else the key's lookup
        (audited in `context()`). The generation is the listener's while it is live
        (PostgreSQL), read on the loop's own connection (SQLite), else read through the
        pool."""
        generation = self.known.current() if self.known is not None else None
        if generation is None:
            generation = await read_key_generation(self.direct)
        principal = self.keys.get(token, generation)
        if principal is not None:
            return principal
        async with self.sessions.begin() as session:
            principal = await ApiKeyService(session).authenticate(token, context=context())
        if principal is not None:
            self.keys.put(token, principal, generation)
        return principal

    def note_failure(self, ip: str | None, key_prefix: str | None, reason: str) -> None:
        if self.failures is not None:
            self.failures.note(ip, key_prefix, reason)
