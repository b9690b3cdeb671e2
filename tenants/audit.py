"""The audit log: append-only, hash-chained events for administrative and security actions.

Each event stores the SHA-256 of a canonical serialization of its fields and of its
predecessor's hash, so editing, deleting or reordering any stored event breaks the chain
at that point, and `verify` names the first event where it breaks. Events are numbered
1, 2, 3… without gaps (the number is part of the hash), so a missing number is a deletion.
Triggers created by migration 0005 reject UPDATE, DELETE and TRUNCATE (PostgreSQL; on
SQLite UPDATE and DELETE); `app_role_grants` keeps the gateway's role from disabling them.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import JSON, BigInteger, DateTime, Index, String, select, text
from sqlalchemy import create_engine as create_sync_engine
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Mapped, mapped_column

from tenants import db
from tenants.errors import InvalidInputError
from tenants.models import Base, as_utc, utcnow

GENESIS_HASH = "0" * 64  # the predecessor of event 1
CHAIN_LOCK_ID = 0x70_6C_67_61_75_64  # pg_advisory_xact_lock key that serializes appends
_VERIFY_BATCH = 1000


class AuditEvent(Base):
    __tablename__ = "audit_events"
    __table_args__ = (
        Index("ix_audit_events_tenant_id", "tenant_id"),
        Index("ix_audit_events_action_target", "action", "target"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    occurred_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    actor: Mapped[str] = mapped_column(String(320))  # "console:" + an e-mail address
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(320))
    tenant_id: Mapped[str | None] = mapped_column(String(36))
    request_id: Mapped[str | None] = mapped_column(String(64))
    ip: Mapped[str | None] = mapped_column(String(64))
    user_agent: Mapped[str | None] = mapped_column(String(400))
    details: Mapped[dict[str, Any]] = mapped_column(JSON)
    prev_hash: Mapped[str] = mapped_column(String(64))
    hash: Mapped[str] = mapped_column(String(64))


@dataclass(frozen=True)
class AuditContext:
    """Where an action came from: the HTTP request, or nothing for the CLI."""

    request_id: str | None = None
    ip: str | None = None
    user_agent: str | None = None


@dataclass(frozen=True)
class Actor:
    """Who acts ("key:tg-AbCd1234", "cli:alice", "system") and from where."""

    name: str
    context: AuditContext = AuditContext()


SYSTEM = Actor("system")
MAX_ADDRESS_LENGTH = 64  # the `ip` column


def client_address(host: str | None) -> str | None:
    """A client's address as the audit log and sign-in throttling keep it: an IP in its
    normal form; anything else (an X-Forwarded-For entry that names no IP, a test client's
    name) as given. Cut to the column's length; None unless printable ASCII."""
    if not host:
        return None
    with contextlib.suppress(ValueError):
        host = str(ipaddress.ip_address(host))
    cut = host[:MAX_ADDRESS_LENGTH]
    return cut if cut.isascii() and cut.isprintable() else None


def _utc_text(moment: datetime) -> str:
    return as_utc(moment).isoformat(timespec="microseconds")


def event_hash(event: AuditEvent) -> str:
    """SHA-256 over sorted-key JSON of every field but the hash itself."""
    fields = _fields(event)
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


async def _lock_chain(session: AsyncSession) -> None:
    """Serialize appends until the caller's transaction ends, so the chain never forks."""
    if session.get_bind().dialect.name == "postgresql":
        await session.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": CHAIN_LOCK_ID})
    else:
        # SQLite has one writer at a time: a write that touches nothing takes that lock now,
        # before the head is read, instead of at the insert.
        await session.execute(text("UPDATE audit_events SET id = id WHERE 0 = 1"))


async def _head(session: AsyncSession) -> tuple[int, str]:
    row = (
        await session.execute(
            select(AuditEvent.id, AuditEvent.hash).order_by(AuditEvent.id.desc()).limit(1)
        )
    ).one_or_none()
    return (0, GENESIS_HASH) if row is None else (row[0], row[1])


async def record(
    session: AsyncSession,
    *,
    actor: str,
    action: str,
    target: str,
    tenant_id: str | None = None,
    details: Mapping[str, object] | None = None,
    context: AuditContext | None = None,
    unless_within: timedelta | None = None,
) -> AuditEvent | None:
    """Append an event in the caller's transaction: it commits with the change it records,
    or not at all. Never put secrets in `details`. `unless_within`: append nothing (None)
    while an event with this action and target is younger than that (rate-limits noisy
    security events, e.g. one per revoked key per minute)."""
    await _lock_chain(session)
    if unless_within is not None:
        recent = await session.scalar(
            select(AuditEvent.id)
            .where(
                AuditEvent.action == action,
                AuditEvent.target == target,
                AuditEvent.occurred_at > utcnow() - unless_within,
            )
            .limit(1)
        )
        if recent is not None:
            return None
    return await _append(session, actor, action, target, tenant_id, details, context)


class Audited:
    """A service whose changes are written to the audit log, in the caller's transaction."""

    def __init__(self, session: AsyncSession, actor: Actor = SYSTEM) -> None:
        self.session = session
        self.actor = actor

    async def _audit(
        self, action: str, target: str, tenant_id: str | None, **details: object
    ) -> None:
        await record(
            self.session,
            actor=self.actor.name,
            action=action,
            target=target,
            tenant_id=tenant_id,
            details=details,
            context=self.actor.context,
        )


async def _append(
    session: AsyncSession,
    actor: str,
    action: str,
    target: str,
    tenant_id: str | None,
    details: Mapping[str, object] | None,
    context: AuditContext | None,
) -> AuditEvent:
    context = context or AuditContext()
    last_id, last_hash = await _head(session)
    event = AuditEvent(
        id=last_id + 1,
        occurred_at=utcnow(),
        actor=actor,
        action=action,
        target=target,
        tenant_id=tenant_id,
        request_id=context.request_id,
        ip=client_address(context.ip),
        user_agent=context.user_agent,
        # Through JSON and back, so the hash covers exactly what the database returns.
        details=json.loads(json.dumps(dict(details or {}), default=str)),
        prev_hash=last_hash,
    )
    event.hash = event_hash(event)
    session.add(event)
    await session.flush()
    return event


@dataclass(frozen=True)
class Anchor:
    """An event's id and hash kept outside the database (`id:hash`, as verify prints it):
    the chain alone cannot show that its newest events were deleted, an anchor can."""

    id: int
    hash: str

    @classmethod
    def parse(cls, text: str) -> Anchor:
        number, _, digest = text.partition(":")
        if not number.isdigit() or int(number) < 1 or len(digest) != 64:
            raise InvalidInputError(f"an anchor is ID:SHA256 as verify prints it, not {text!r}")
        return cls(int(number), digest.lower())

    def __str__(self) -> str:
        return f"{self.id}:{self.hash}"


@dataclass(frozen=True)
class Verification:
    """The result of checking the chain: intact, or the first bad event and why."""

    events: int  # events checked (up to the first bad one)
    first_bad_id: int | None = None
    reason: str | None = None
    head_hash: str = GENESIS_HASH  # hash of the last good event

    @property
    def ok(self) -> bool:
        return self.first_bad_id is None

    @property
    def anchor(self) -> Anchor | None:
        """Keep this to detect later deletion of the newest events (`verify --anchor`)."""
        return Anchor(self.events, self.head_hash) if self.ok and self.events else None

    def describe(self) -> str:
        if self.ok:
            anchor = f" (anchor {self.anchor})" if self.anchor else ""
            return f"chain intact: {self.events} events{anchor}"
        return f"chain broken at event {self.first_bad_id}: {self.reason}"


async def verify(session: AsyncSession, anchor: Anchor | None = None) -> Verification:
    """Walk the chain in order of id and name the first event that does not fit, including
    a difference from `anchor`, an event known from an earlier verification."""
    expected_id, prev_hash, checked = 1, GENESIS_HASH, 0
    while True:
        batch = list(
            (
                await session.execute(
                    select(AuditEvent)
                    .where(AuditEvent.id >= expected_id)
                    .order_by(AuditEvent.id)
                    .limit(_VERIFY_BATCH)
                )
            ).scalars()
        )
        if not batch:
            break
        for event in batch:
            reason = _fault(event, expected_id, prev_hash) or _unlike(event, anchor)
            if reason is not None:
                return Verification(checked, event.id, reason, prev_hash)
            expected_id, prev_hash, checked = event.id + 1, event.hash, checked + 1
        session.expunge_all()  # bounded memory on long chains
    if anchor is not None and anchor.id > checked:
        reason = f"events {checked + 1} to {anchor.id} are missing (the newest were deleted)"
        return Verification(checked, checked + 1, reason, prev_hash)
    return Verification(events=checked, head_hash=prev_hash)


def _unlike(event: AuditEvent, anchor: Anchor | None) -> str | None:
    if anchor is None or event.id != anchor.id or event.hash == anchor.hash:
        return None
    return "hash differs from the anchor kept earlier (the chain was rewritten)"


def _fault(event: AuditEvent, expected_id: int, prev_hash: str) -> str | None:
    if event.id != expected_id:
        return f"sequence gap: events {expected_id} to {event.id - 1} are missing (deleted)"
    if event.prev_hash != prev_hash:
        return "broken link: prev_hash is not the previous event's hash (deleted or reordered)"
    if event_hash(event) != event.hash:
        return "hash mismatch: the event's contents were edited"
    return None


async def list_events(
    session: AsyncSession,
    *,
    tenant_id: str | None = None,
    action: str | None = None,
    actor: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    before_id: int | None = None,
    limit: int = 100,
) -> list[AuditEvent]:
    """Newest first; pass the last id seen as `before_id` for the next page."""
    query = select(AuditEvent).order_by(AuditEvent.id.desc()).limit(limit)
    if tenant_id is not None:
        query = query.where(AuditEvent.tenant_id == tenant_id)
    if action is not None:
        query = query.where(AuditEvent.action == action)
    if actor is not None:
        query = query.where(AuditEvent.actor == actor)
    if since is not None:
        query = query.where(AuditEvent.occurred_at >= since)
    if until is not None:
        query = query.where(AuditEvent.occurred_at < until)
    if before_id is not None:
        query = query.where(AuditEvent.id < before_id)
    return list((await session.execute(query)).scalars())


def event_view(event: AuditEvent) -> dict[str, Any]:
    return {**_fields(event), "hash": event.hash}


def _fields(event: AuditEvent) -> dict[str, Any]:
    """What an event says, as the hash covers it (and as the API shows it)."""
    return {
        "id": event.id,
        "time": _utc_text(event.occurred_at),
        "actor": event.actor,
        "action": event.action,
        "target": event.target,
        "tenant_id": event.tenant_id,
        "request_id": event.request_id,
        "ip": event.ip,
        "user_agent": event.user_agent,
        "details": event.details,
        "prev_hash": event.prev_hash,
    }


def app_role_grants(role: str, schema: str = "public") -> list[str]:
    """SQL that lets `role` run the gateway without owning anything: read and write the
    tables, but only SELECT and INSERT the audit log. Not being the owner, it can neither
    drop nor disable the append-only triggers."""
    who, where = _quoted(role), _quoted(schema)
    return [
        f"GRANT USAGE ON SCHEMA {where} TO {who}",
        f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {where} TO {who}",
        f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA {where} TO {who}",
        f"REVOKE UPDATE, DELETE, TRUNCATE ON {where}.audit_events FROM {who}",
        f"REVOKE INSERT, UPDATE, DELETE ON {where}.alembic_version FROM {who}",
    ]


def _quoted(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


def grant_app_role(url: str, role: str) -> list[str]:
    """Apply `app_role_grants` on PostgreSQL as the migrating role; returns the SQL run."""
    if db.sync_url(url).get_backend_name() != "postgresql":
        raise InvalidInputError("application roles need PostgreSQL (SQLite has no roles)")
    engine = create_sync_engine(db.sync_url(url))
    try:
        with engine.begin() as connection:
            exists = connection.scalar(
                text("SELECT 1 FROM pg_roles WHERE rolname = :role"), {"role": role}
            )
            if exists is None:
                raise InvalidInputError(
                    f"no role {role!r}: create it first, e.g. "
                    f"CREATE ROLE {role} LOGIN PASSWORD '...'"
                )
            schema = str(connection.scalar(text("SELECT current_schema()")))
            statements = app_role_grants(role, schema)
            for statement in statements:
                connection.execute(text(statement))
        return statements
    finally:
        engine.dispose()
