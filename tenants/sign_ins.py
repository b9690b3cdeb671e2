"""Console sign-in throttling, counted in the database so every gateway replica shares it.

An attempt is counted by one atomic upsert *before* its password is checked, so concurrent
guesses cannot all read a count under the limit and all be tried. The account limit is per
source address: someone guessing at an account cannot lock its owner out of it from
elsewhere; the address limit stops one address from trying many accounts. Known and unknown
accounts are counted alike, so the answer does not reveal which accounts exist.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import DateTime, Integer, String, case, delete, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Mapped, mapped_column

from tenants.models import Base, utcnow


class SignInAttempts(Base):
    """Attempts within the current window, for one address or one (account, address)."""

    __tablename__ = "console_sign_in_attempts"

    key_hash: Mapped[str] = mapped_column(String(64), primary_key=True)  # SHA-256 of the key
    window_start: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    attempts: Mapped[int] = mapped_column(Integer)


@dataclass(frozen=True)
class SignInThrottle:
    per_account: int = 10  # attempts at one account from one address, per window
    per_address: int = 50  # attempts from one address at any accounts, per window
    window: timedelta = timedelta(minutes=15)

    async def admit(
        self, session: AsyncSession, email: str, address: str | None, now: datetime | None = None
    ) -> bool:
        """Count one attempt; False when its address or its account from that address has
        used up this window's attempts (then its password must not be checked)."""
        now = now or utcnow()
        if await self._count(session, _address_key(address), now) > self.per_address:
            return False
        return await self._count(session, _account_key(email, address), now) <= self.per_account

    async def succeeded(self, session: AsyncSession, email: str, address: str | None) -> None:
        """The right password clears its account's count from its address, and takes back
        its own attempt from the address's count: only failures add up there (clearing that
        count instead would let a guesser reset it by signing in to an account of its own)."""
        await session.execute(
            delete(SignInAttempts).where(SignInAttempts.key_hash == _account_key(email, address))
        )
        await session.execute(
            update(SignInAttempts)
            .where(SignInAttempts.key_hash == _address_key(address), SignInAttempts.attempts > 0)
            .values(attempts=SignInAttempts.attempts - 1)
        )

    async def purge(self, session: AsyncSession, now: datetime | None = None) -> int:
        """Delete the counts of windows that have ended; returns how many."""
        cutoff = (now or utcnow()) - self.window
        result = await session.execute(
            delete(SignInAttempts).where(SignInAttempts.window_start < cutoff)
        )
        return int(result.rowcount or 0)  # type: ignore[attr-defined]

    async def _count(self, session: AsyncSession, key_hash: str, now: datetime) -> int:
        """Add one attempt to `key_hash`'s window (a new window once the old one ended)."""
        table = SignInAttempts.__table__
        current = table.c.window_start >= now - self.window
        insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
        statement = (
            insert(SignInAttempts)
            .values(key_hash=key_hash, window_start=now, attempts=1)
            .on_conflict_do_update(
                index_elements=["key_hash"],
                set_={
                    "attempts": case((current, table.c.attempts + 1), else_=1),
                    "window_start": case((current, table.c.window_start), else_=now),
                },
            )
            .returning(table.c.attempts)
        )
        return int((await session.execute(statement)).scalar_one())


def _address_key(address: str | None) -> str:
    return _digest("address", address or "unknown")


def _account_key(email: str, address: str | None) -> str:
    return _digest("account", email, address or "unknown")


def _digest(*parts: str) -> str:
    """Hashed: fixed length, and any text (NUL included) is a valid key."""
    return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogatepass")).hexdigest()
