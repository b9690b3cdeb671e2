"""A usage row carries its request's Idempotency-Key (a batch line's too), unique per
tenant: a request run again because its answer was lost (a crash between the ledger write
and the stored answer) is not billed again. A stream's checkpoint carries it, so the row
billed from a dead gateway's checkpoint holds the key as well.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("usage_events", sa.Column("idempotency_key", sa.String(255), nullable=True))
    # NULLs are distinct (both databases): rows without a key are never refused.
    op.create_index(
        "uq_usage_events_tenant_idempotency_key",
        "usage_events",
        ["tenant_id", "idempotency_key"],
        unique=True,
    )
    op.add_column("usage_checkpoints", sa.Column("idempotency_key", sa.String(255), nullable=True))


def downgrade() -> None:
    op.drop_column("usage_checkpoints", "idempotency_key")
    op.drop_index("uq_usage_events_tenant_idempotency_key", table_name="usage_events")
    op.drop_column("usage_events", "idempotency_key")
