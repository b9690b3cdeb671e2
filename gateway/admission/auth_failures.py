"""Failed authentications, counted in memory and written to the audit log once per window.

A flood of bad keys must not become a flood of database writes: each failure only bumps
a counter per (client IP, key prefix, reason); a background task appends one
`auth.failures` event per window with the counts. The presented secret is never kept,
only the visible prefix of a well-formed key ("-" otherwise).
"""

from __future__ import annotations

import logging
from collections import Counter
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.core.tasks import Periodic
from tenants import audit
from tenants.audit import AuditEvent
from tenants.models import utcnow

log = logging.getLogger(__name__)

WINDOW_S = 60.0
MAX_SOURCES = 1000  # distinct (ip, prefix, reason) kept per window; the rest count as "other"

Source = tuple[str, str, str]  # client IP, key prefix, reason


class AuthFailureLog:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        window_s: float = WINDOW_S,
        max_sources: int = MAX_SOURCES,
    ) -> None:
        self.sessions = sessions
        self.window_s = window_s
        self.max_sources = max_sources
        self._counts: Counter[Source] = Counter()
        self._other = 0
        self._since = utcnow()
        self._schedule = Periodic([(self.flush, window_s)])

    def note(self, ip: str | None, key_prefix: str | None, reason: str) -> None:
        """Count one failure ("missing_key", "invalid_key", "admin_required"…); no I/O, so
        it is cheap on the hot path."""
        source = (ip or "unknown", key_prefix or "-", reason)
        if source in self._counts or len(self._counts) < self.max_sources:
            self._counts[source] += 1
        else:
            self._other += 1

    async def flush(self) -> AuditEvent | None:
        """Write the window's counts as one audit event (none if nothing failed)."""
        counts, other, since = self._counts, self._other, self._since
        self._counts, self._other, self._since = Counter(), 0, utcnow()
        if not counts and not other:
            return None
        try:
            async with self.sessions.begin() as session:
                return await audit.record(
                    session,
                    actor="gateway",
                    action="auth.failures",
                    target="auth",
                    details=_details(counts, other, since, self._since),
                )
        except Exception:
            self._restore(counts, other, since)  # kept for the next window, not lost
            raise

    def _restore(self, counts: Counter[Source], other: int, since: datetime) -> None:
        counts.update(self._counts)
        self._counts, self._other, self._since = counts, other + self._other, since

    def start(self) -> None:
        self._schedule.start()

    async def close(self) -> None:
        """Stop the schedule and write what the last window counted."""
        await self._schedule.close()
        try:
            await self.flush()
        except Exception:
            log.exception("could not write authentication failures to the audit log")


def _details(
    counts: Counter[Source], other: int, since: datetime, until: datetime
) -> dict[str, object]:
    return {
        "since": since.isoformat(),
        "until": until.isoformat(),
        "total": sum(counts.values()) + other,
        "sources": [
            {"ip": ip, "key_prefix": prefix, "reason": reason, "count": count}
            for (ip, prefix, reason), count in counts.most_common()
        ],
        "other": other,
    }
