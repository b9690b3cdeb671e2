"""Idempotency-Key, with the IETF draft's semantics: 400 for a malformed key, 409 while
the first request is in flight, 422 for the same key with another body, and a replay of
the stored outcome (a stream replays its event sequence) without running or billing again.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from datetime import timedelta

import msgspec
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.core.errors import ApiError, Conflict, InvalidRequest
from tenants.idempotency import Held, IdempotencyService, InFlightLocks
from tenants.models import IdempotencyRecord
from tenants.services import Principal

HEADER = "idempotency-key"
_KEY = re.compile(r'^"?([\x21\x23-\x7e]{1,255})"?$')  # printable ASCII, quotes optional


class FingerprintMismatch(ApiError):
    status = 422
    type = "invalid_request_error"
    default_code = "idempotency_key_reused"


@dataclass(frozen=True)
class Claim:
    """This request holds the key; it must finish() or abandon()."""

    tenant_id: str
    key: str
    fingerprint: str
    token: str

    @property
    def lock_name(self) -> str:
        return f"{self.tenant_id}:{self.key}"


@dataclass(frozen=True)
class Replay:
    record: IdempotencyRecord


def parse_key(raw: str) -> str:
    match = _KEY.match(raw.strip())
    if match is None:
        raise InvalidRequest(
            "Idempotency-Key must be 1-255 printable ASCII characters",
            param="Idempotency-Key",
            code="invalid_idempotency_key",
        )
    return match.group(1)


def fingerprint(endpoint: str, body: bytes) -> str:
    """The same request however its JSON is spelled: keys sorted, whitespace dropped."""
    canonical = msgspec.json.encode(msgspec.json.decode(body), order="sorted")
    return hashlib.sha256(endpoint.encode() + b"\n" + canonical).hexdigest()


class Idempotency:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        locks: InFlightLocks,
        retention: timedelta,
        lock_ttl_s: float,
    ) -> None:
        self._sessions = sessions
        self.locks = locks
        self.retention = retention
        self.lock_ttl_s = lock_ttl_s

    async def begin(
        self, principal: Principal, raw_key: str, endpoint: str, body: bytes
    ) -> Claim | Replay:
        key = parse_key(raw_key)
        fp = fingerprint(endpoint, body)
        replay = await self._stored(principal.tenant_id, key, fp)
        if replay is not None:
            return replay
        name = f"{principal.tenant_id}:{key}"
        token = await self.locks.acquire(name, fp, self.lock_ttl_s)
        if isinstance(token, Held):
            _check_same(token.fingerprint, fp)
            raise Conflict(
                "a request with this Idempotency-Key is still in flight; retry later",
                code="idempotency_key_in_flight",
                headers={"Retry-After": "1"},
            )
        claim = Claim(principal.tenant_id, key, fp, token)
        # It may have finished between our first look and taking the lock.
        try:
            replay = await self._stored(principal.tenant_id, key, fp)
        except ApiError:
            await self.abandon(claim)
            raise
        if replay is not None:
            await self.abandon(claim)
            return replay
        return claim

    async def _stored(self, tenant_id: str, key: str, fp: str) -> Replay | None:
        async with self._sessions() as session:
            record = await IdempotencyService(session).find(tenant_id, key)
        if record is None:
            return None
        _check_same(record.fingerprint, fp)
        return Replay(record)

    async def finish(
        self, claim: Claim, request_id: str, status_code: int, media_type: str, body: bytes
    ) -> None:
        record = IdempotencyRecord(
            tenant_id=claim.tenant_id,
            key=claim.key,
            fingerprint=claim.fingerprint,
            request_id=request_id,
            status_code=status_code,
            media_type=media_type,
            body=body,
        )
        try:
            async with self._sessions.begin() as session:
                await IdempotencyService(session).save(record, self.retention)
        finally:
            await self.abandon(claim)

    async def abandon(self, claim: Claim) -> None:
        await self.locks.release(claim.lock_name, claim.token)


def _check_same(stored: str, given: str) -> None:
    if stored != given:
        raise FingerprintMismatch(
            "this Idempotency-Key was used with a different request body",
            param="Idempotency-Key",
        )
