"""Durable idempotency records: the finished outcome of a keyed request, per tenant."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Protocol

from redis.asyncio import Redis
from sqlalchemy import delete
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from tenants.models import IdempotencyRecord, as_utc, utcnow


class IdempotencyService:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def find(
        self, tenant_id: str, key: str, now: datetime | None = None
    ) -> IdempotencyRecord | None:
        record = await self.session.get(IdempotencyRecord, (tenant_id, key))
        if record is None or as_utc(record.expires_at) <= (now or utcnow()):
            return None  # an expired record is as good as none; cleanup deletes it
        return record

    async def save(self, record: IdempotencyRecord, retention: timedelta) -> bool:
        """Store the outcome; False if a live record already holds this key."""
        now = utcnow()
        record.created_at = now
        record.expires_at = now + retention
        existing = await self.session.get(IdempotencyRecord, (record.tenant_id, record.key))
        if existing is not None:
            if as_utc(existing.expires_at) > now:
                return False
            await self.session.delete(existing)
            await self.session.flush()
        self.session.add(record)
        try:
            await self.session.flush()
        except IntegrityError:
            return False
        return True

    async def delete_expired(self, now: datetime | None = None) -> int:
        result = await self.session.execute(
            delete(IdempotencyRecord).where(IdempotencyRecord.expires_at <= (now or utcnow()))
        )
        return int(result.rowcount or 0)  # type: ignore[attr-defined]


class InFlightLocks(Protocol):
    """Who is running a keyed request right now. A lock expires on its own (a crashed
    gateway cannot hold a key forever); its value is the holder's body fingerprint."""

    async def acquire(self, name: str, fingerprint: str, ttl_s: float) -> str | Held:
        """A release token, or Held(the holder's fingerprint)."""
        ...

    async def release(self, name: str, token: str) -> None: ...


@dataclass(frozen=True)
class Held:
    fingerprint: str


class MemoryLocks:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._locks: dict[str, tuple[str, str, float]] = {}  # name -> token, fp, expiry
        self._clock = clock

    async def acquire(self, name: str, fingerprint: str, ttl_s: float) -> str | Held:
        now = self._clock()
        held = self._locks.get(name)
        if held is not None and held[2] > now:
            return Held(held[1])
        token = secrets.token_hex(8)
        self._locks[name] = (token, fingerprint, now + ttl_s)
        return token

    async def release(self, name: str, token: str) -> None:
        held = self._locks.get(name)
        if held is not None and held[0] == token:
            del self._locks[name]


# KEYS[1] = lock name; ARGV[1] = the holder's "token|fingerprint". Delete only our own lock.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisLocks:
    def __init__(self, redis: Redis, prefix: str = "tg:idem:") -> None:
        self.redis = redis
        self.prefix = prefix
        self._release = redis.register_script(_RELEASE)
        self._tokens: dict[str, str] = {}  # token -> full value, to release exactly ours

    async def acquire(self, name: str, fingerprint: str, ttl_s: float) -> str | Held:
        token = secrets.token_hex(8)
        value = f"{token}|{fingerprint}"
        key = self.prefix + name
        if await self.redis.set(key, value, nx=True, px=max(1, int(ttl_s * 1000))):
            self._tokens[token] = value
            return token
        holder = await self.redis.get(key)
        if holder is None:  # released between our SET and GET: try once more
            return await self.acquire(name, fingerprint, ttl_s)
        text = holder.decode() if isinstance(holder, bytes) else str(holder)
        return Held(text.partition("|")[2])

    async def release(self, name: str, token: str) -> None:
        value = self._tokens.pop(token, None)
        if value is not None:
            await self._release(keys=[self.prefix + name], args=[value])
