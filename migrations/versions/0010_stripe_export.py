"""Stripe export that holds under Stripe's rules (issue 16): per-row idempotency-key
sequence and "may be in Stripe since", wider outbox states (unconfirmed,
too_old_for_stripe), customer creation with its own retry state, and one row of export
state (the SQLite relay lock and the meter's last known status)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _timestamp(name: str, nullable: bool = True) -> sa.Column[object]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    with op.batch_alter_table("usage_outbox") as outbox:
        outbox.alter_column("status", type_=sa.String(24), existing_type=sa.String(16))
        outbox.add_column(sa.Column("key_seq", sa.Integer, nullable=False, server_default="0"))
        outbox.add_column(_timestamp("maybe_sent_at"))
    op.create_table(
        "stripe_customer_requests",
        sa.Column("tenant_id", sa.String(36), sa.ForeignKey("tenants.id"), primary_key=True),
        sa.Column("status", sa.String(16), nullable=False, server_default="pending"),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("key_seq", sa.Integer, nullable=False, server_default="0"),
        _timestamp("next_attempt_at"),
        sa.Column("last_error", sa.Text, nullable=True),
        _timestamp("updated_at", nullable=False),
    )
    op.create_table(
        "stripe_export_state",
        sa.Column("name", sa.String(32), primary_key=True),
        sa.Column("holder", sa.String(200), nullable=True),
        _timestamp("lease_until"),
        sa.Column("meter_status", sa.String(16), nullable=True),
        _timestamp("meter_checked_at"),
        sa.Column("meter_error", sa.Text, nullable=True),
    )


def downgrade() -> None:
    op.drop_table("stripe_export_state")
    op.drop_table("stripe_customer_requests")
    op.execute(
        "UPDATE usage_outbox SET status = 'failed' "
        "WHERE status IN ('unconfirmed', 'too_old_for_stripe')"
    )
    with op.batch_alter_table("usage_outbox") as outbox:
        outbox.drop_column("maybe_sent_at")
        outbox.drop_column("key_seq")
        outbox.alter_column("status", type_=sa.String(16), existing_type=sa.String(24))
