"""SQLAlchemy models. The schema itself is owned by the Alembic migrations."""

from __future__ import annotations

import enum
import uuid
from datetime import UTC, datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(moment: datetime) -> datetime:
    """A stored or parsed time in UTC: SQLite hands back naive datetimes (every stored time
    is UTC), and a time that names no zone is taken as UTC."""
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def parse_utc(text: str) -> datetime:
    """An ISO 8601 time, in UTC (taken as UTC when it names no zone). ValueError when it is
    none, or when it leaves the calendar once moved to UTC (9999-12-31T23:59:59-14:00)."""
    moment = datetime.fromisoformat(text)
    try:
        return as_utc(moment)
    except OverflowError:
        raise ValueError(f"{text!r} is outside the calendar in UTC") from None


def new_id() -> str:
    return str(uuid.uuid4())


class Base(DeclarativeBase):
    pass


class KeyStatus(enum.StrEnum):
    ACTIVE = "active"
    REVOKED = "revoked"


class KeyRole(enum.StrEnum):
    TENANT = "tenant"  # inference only
    ADMIN = "admin"  # inference and administration


class UsageStatus(enum.StrEnum):
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"
    REJECTED = "rejected"


class LimitColumns:
    """Limits a plan sets and a key may override. None means unlimited (or: inherit)."""

    rpm: Mapped[int | None] = mapped_column(Integer)
    tpm: Mapped[int | None] = mapped_column(Integer)
    max_concurrent: Mapped[int | None] = mapped_column(Integer)
    monthly_budget_micros: Mapped[int | None] = mapped_column(BigInteger)
    max_tokens_per_request: Mapped[int | None] = mapped_column(Integer)


class Plan(LimitColumns, Base):
    __tablename__ = "plans"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    allowed_models: Mapped[list[str] | None] = mapped_column(JSON)  # None: every model
    default_priority: Mapped[int] = mapped_column(Integer, default=4)
    max_priority: Mapped[int] = mapped_column(Integer, default=0)  # most urgent allowed
    weight: Mapped[int] = mapped_column(Integer, default=1)  # share under contention
    max_batch_tokens: Mapped[int | None] = mapped_column(BigInteger)  # enqueued (Batch API)
    max_file_bytes: Mapped[int | None] = mapped_column(BigInteger)  # stored; None: default
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    plan_id: Mapped[str | None] = mapped_column(ForeignKey("plans.id"))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    plan: Mapped[Plan | None] = relationship(lazy="raise")


class ApiKey(LimitColumns, Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    key_hash: Mapped[str] = mapped_column(String(64))
    name: Mapped[str] = mapped_column(String(100), default="")
    role: Mapped[str] = mapped_column(String(16), default=KeyRole.TENANT)
    status: Mapped[str] = mapped_column(String(16), default=KeyStatus.ACTIVE)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class KeyGeneration(Base):
    """One row, bumped in the same transaction as every change to a key's standing
    (revocation, its limits, its tenant's plan): a gateway's remembered keys are good only
    while it is unchanged (gateway.admission.key_cache)."""

    __tablename__ = "key_generation"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger)


BATCH_ENDPOINT_PREFIX = "batch."  # a batch line's endpoint in the ledger: batch spend apart


class UsageEvent(Base):
    """The ledger: one row per request, whatever its outcome."""

    __tablename__ = "usage_events"
    __table_args__ = (
        Index(
            "ix_usage_events_tenant_created",
            "tenant_id",
            "created_at",
            postgresql_include=[
                "model",
                "status",
                "prompt_tokens",
                "cached_tokens",
                "completion_tokens",
                "cost_micros",
            ],
        ),
        Index("ix_usage_events_created_at", "created_at"),
        # One row per Idempotency-Key: a rerun of a request whose answer was lost is not
        # billed again (tenants.billing.ledger). NULLs are distinct: unkeyed rows pass.
        Index(
            "uq_usage_events_tenant_idempotency_key", "tenant_id", "idempotency_key", unique=True
        ),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    request_id: Mapped[str] = mapped_column(String(64), unique=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    api_key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id"))
    model: Mapped[str] = mapped_column(String(200))
    endpoint: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cost_micros: Mapped[int] = mapped_column(BigInteger, default=0)
    queue_ms: Mapped[float | None] = mapped_column(Float)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    e2e_ms: Mapped[float | None] = mapped_column(Float)
    itl_ms: Mapped[float | None] = mapped_column(Float)  # mean time between output tokens
    priority: Mapped[int | None] = mapped_column(Integer)
    price_version_id: Mapped[str | None] = mapped_column(String(36))  # None: built-in price
    error: Mapped[str | None] = mapped_column(Text)
    trace_id: Mapped[str | None] = mapped_column(String(32))  # W3C trace id, 32 hex digits
    replica: Mapped[str | None] = mapped_column(String(255))  # the backend that served it
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))  # priced at
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    idempotency_key: Mapped[str | None] = mapped_column(String(255))  # the request's, if any


class UsageCheckpoint(Base):
    """A running stream's delivered tokens, rewritten every few seconds by its gateway and
    deleted with the ledger write; one left stale is a dead gateway's, billed by another
    (gateway.metering.recorder.bill_orphans)."""

    __tablename__ = "usage_checkpoints"

    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    api_key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id"))
    model: Mapped[str] = mapped_column(String(200))
    endpoint: Mapped[str] = mapped_column(String(64))
    priority: Mapped[int | None] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    cached_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)  # delivered to the client
    trace_id: Mapped[str | None] = mapped_column(String(32))
    replica: Mapped[str | None] = mapped_column(String(255))
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    idempotency_key: Mapped[str | None] = mapped_column(String(255))  # its row's (UsageEvent)


class IdempotencyRecord(Base):
    """The stored outcome of a request sent with an Idempotency-Key, replayed on repeats."""

    __tablename__ = "idempotency_records"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(64))
    request_id: Mapped[str] = mapped_column(String(64))
    status_code: Mapped[int] = mapped_column(Integer)
    media_type: Mapped[str] = mapped_column(String(64))
    body: Mapped[bytes] = mapped_column(LargeBinary)  # the JSON body, or the SSE event stream
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
