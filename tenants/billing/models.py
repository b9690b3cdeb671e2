"""Billing tables. The schema itself is owned by the Alembic migrations (revision 0004)."""

from __future__ import annotations

import enum
from datetime import date, datetime

from sqlalchemy import (
    BigInteger,
    Date,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from tenants.models import Base, new_id, utcnow


class PriceVersion(Base):
    """Prices of one model (or '*': every model without its own) from `effective_from` on."""

    __tablename__ = "price_versions"
    __table_args__ = (
        UniqueConstraint("model", "effective_from", name="uq_price_versions_model_effective"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    model: Mapped[str] = mapped_column(String(200))
    input_micros_per_mtok: Mapped[int] = mapped_column(BigInteger)
    cached_input_micros_per_mtok: Mapped[int] = mapped_column(BigInteger)
    output_micros_per_mtok: Mapped[int] = mapped_column(BigInteger)
    effective_from: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    created_by: Mapped[str] = mapped_column(String(100), default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class OutboxStatus(enum.StrEnum):
    PENDING = "pending"
    EXPORTED = "exported"
    FAILED = "failed"  # rejected by Stripe for good: an operator must look


class OutboxRow(Base):
    """A usage row waiting to be sent to Stripe; written in the ledger row's transaction."""

    __tablename__ = "usage_outbox"
    __table_args__ = (
        Index(
            "ix_usage_outbox_pending",
            "id",
            postgresql_where=text("status = 'pending'"),
            sqlite_where=text("status = 'pending'"),
        ),
    )

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    usage_event_id: Mapped[str] = mapped_column(ForeignKey("usage_events.id"), unique=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    value: Mapped[int] = mapped_column(BigInteger)  # cost in micro-units
    occurred_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    status: Mapped[str] = mapped_column(String(16), default=OutboxStatus.PENDING)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_error: Mapped[str | None] = mapped_column(Text)
    exported_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class DailyUsage(Base):
    """Per tenant, model and UTC day: the ledger summed, rebuilt by the rollup job."""

    __tablename__ = "usage_daily"
    __table_args__ = (Index("ix_usage_daily_tenant_day", "tenant_id", "day"),)

    day: Mapped[date] = mapped_column(Date, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    model: Mapped[str] = mapped_column(String(200), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    cost_micros: Mapped[int] = mapped_column(BigInteger)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class StripeCustomer(Base):
    __tablename__ = "stripe_customers"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    customer_id: Mapped[str] = mapped_column(String(255), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
