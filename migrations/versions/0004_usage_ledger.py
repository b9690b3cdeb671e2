"""usage ledger, outbox, rollups, price book, Stripe customers (issue 7)

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Report queries read these next to (tenant_id, created_at): PostgreSQL answers a
# tenant's month from the index alone.
REPORT_COLUMNS = [
    "model",
    "status",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "cost_micros",
]
NEW_USAGE_COLUMNS = ("started_at", "itl_ms", "priority", "price_version_id")


def _timestamp(name: str, nullable: bool = False) -> sa.Column[object]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "price_versions",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("input_micros_per_mtok", sa.BigInteger, nullable=False),
        sa.Column("cached_input_micros_per_mtok", sa.BigInteger, nullable=False),
        sa.Column("output_micros_per_mtok", sa.BigInteger, nullable=False),
        _timestamp("effective_from"),
        sa.Column("created_by", sa.String(100), nullable=False, server_default=""),
        _timestamp("created_at"),
        sa.UniqueConstraint("model", "effective_from", name="uq_price_versions_model_effective"),
    )
    with op.batch_alter_table("usage_events") as usage:
        usage.add_column(_timestamp("started_at", nullable=True))
        usage.add_column(sa.Column("itl_ms", sa.Float, nullable=True))
        usage.add_column(sa.Column("priority", sa.Integer, nullable=True))
        usage.add_column(sa.Column("price_version_id", sa.String(36), nullable=True))
    op.drop_index("ix_usage_events_tenant_created", table_name="usage_events")
    op.create_index(
        "ix_usage_events_tenant_created",
        "usage_events",
        ["tenant_id", "created_at"],
        postgresql_include=REPORT_COLUMNS,
    )
    op.create_index("ix_usage_events_created_at", "usage_events", ["created_at"])
    op.create_table(
        "usage_outbox",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True),
        sa.Column(
            "usage_event_id",
            sa.String(36),
            sa.ForeignKey("usage_events.id"),
            nullable=False,
            unique=True,
        ),
        sa.Column("tenant_id", sa.String(36), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("value", sa.BigInteger, nullable=False),
        _timestamp("occurred_at"),
        sa.Column("status", sa.String(16), nullable=False, server_default="pending"),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        _timestamp("next_attempt_at", nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        _timestamp("exported_at", nullable=True),
        _timestamp("created_at"),
    )
    pending = sa.text("status = 'pending'")
    op.create_index(
        "ix_usage_outbox_pending",
        "usage_outbox",
        ["id"],
        postgresql_where=pending,
        sqlite_where=pending,
    )
    op.create_table(
        "usage_daily",
        sa.Column("day", sa.Date, primary_key=True),
        sa.Column("tenant_id", sa.String(36), sa.ForeignKey("tenants.id"), primary_key=True),
        sa.Column("model", sa.String(200), primary_key=True),
        sa.Column("requests", sa.BigInteger, nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger, nullable=False),
        sa.Column("cached_tokens", sa.BigInteger, nullable=False),
        sa.Column("completion_tokens", sa.BigInteger, nullable=False),
        sa.Column("cost_micros", sa.BigInteger, nullable=False),
        _timestamp("updated_at"),
    )
    op.create_index("ix_usage_daily_tenant_day", "usage_daily", ["tenant_id", "day"])
    op.create_table(
        "stripe_customers",
        sa.Column("tenant_id", sa.String(36), sa.ForeignKey("tenants.id"), primary_key=True),
        sa.Column("customer_id", sa.String(255), nullable=False, unique=True),
        _timestamp("created_at"),
    )


def downgrade() -> None:
    op.drop_table("stripe_customers")
    op.drop_index("ix_usage_daily_tenant_day", table_name="usage_daily")
    op.drop_table("usage_daily")
    op.drop_index("ix_usage_outbox_pending", table_name="usage_outbox")
    op.drop_table("usage_outbox")
    op.drop_index("ix_usage_events_created_at", table_name="usage_events")
    op.drop_index("ix_usage_events_tenant_created", table_name="usage_events")
    op.create_index("ix_usage_events_tenant_created", "usage_events", ["tenant_id", "created_at"])
    with op.batch_alter_table("usage_events") as usage:
        for name in NEW_USAGE_COLUMNS:
            usage.drop_column(name)
    op.drop_table("price_versions")
