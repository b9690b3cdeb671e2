"""usage rows name the trace and the replica that served the request (issue 9)

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("usage_events") as usage:
        usage.add_column(sa.Column("trace_id", sa.String(32), nullable=True))
        usage.add_column(sa.Column("replica", sa.String(255), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage_events") as usage:
        usage.drop_column("replica")
        usage.drop_column("trace_id")
