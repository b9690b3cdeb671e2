"""Billing tables. The schema itself is owned by the Alembic migrations (0004, 0008)."""

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
    batch_discount_pct: Mapped[int] = mapped_column(Integer, default=50)  # the Batch API's
    effective_from: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    created_by: Mapped[str] = mapped_column(String(100), default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class OutboxStatus(enum.StrEnum):
    PENDING = "pending"
    EXPORTED = "exported"
    FAILED = "failed"  # rejected by Stripe for good: an operator must look
    # Sent once with its outcome unknown, and Stripe's 24 h identifier guard has passed:
    # a resend could count twice, so an operator checks Stripe and resolves it.
    UNCONFIRMED = "unconfirmed"
    # Older than Stripe accepts (35 days): kept in the ledger and the invoice preview,
    # billed by hand (see README, "Usage and billing").
    TOO_OLD = "too_old_for_stripe"


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
    status: Mapped[str] = mapped_column(String(24), default=OutboxStatus.PENDING)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_error: Mapped[str | None] = mapped_column(Text)
    exported_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # Bumped (and committed) before each run sends the row: every run's idempotency
    # keys are new (tenants/billing/relay.py has the argument).
    key_seq: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Since when Stripe may have recorded this row without our knowing; None: it has not.
    maybe_sent_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


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


class CustomerRequestStatus(enum.StrEnum):
    PENDING = "pending"
    FAILED = "failed"  # Stripe refused to create it: an operator must look (then requeue)


class StripeCustomerRequest(Base):
    """A tenant whose Stripe customer is still to be created, with its own retry state:
    one tenant's failing creation never holds up another's export."""

    __tablename__ = "stripe_customer_requests"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    status: Mapped[str] = mapped_column(
        String(16), default=CustomerRequestStatus.PENDING, server_default="pending"
    )
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    key_seq: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    next_attempt_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_error: Mapped[str | None] = mapped_column(Text)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ExportState(Base):
    """One row per exporter ("stripe"): the lease that keeps relays from overlapping on
    SQLite (PostgreSQL uses an advisory lock) and the meter's status at the last check."""

    __tablename__ = "stripe_export_state"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    holder: Mapped[str | None] = mapped_column(String(200))
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    meter_status: Mapped[str | None] = mapped_column(String(16))
    meter_checked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    meter_error: Mapped[str | None] = mapped_column(Text)
