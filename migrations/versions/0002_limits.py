"""plan limits, priorities and weights; per-key limit overrides

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LIMITS = ("rpm", "tpm", "max_concurrent", "monthly_budget_micros", "max_tokens_per_request")


def _limit_columns() -> list[sa.Column[object]]:
    return [
        sa.Column(name, sa.BigInteger if name.endswith("micros") else sa.Integer, nullable=True)
        for name in LIMITS
    ]


def upgrade() -> None:
    with op.batch_alter_table("plans") as plans:
        for column in _limit_columns():
            plans.add_column(column)
        plans.add_column(sa.Column("allowed_models", sa.JSON, nullable=True))
        plans.add_column(
            sa.Column("default_priority", sa.Integer, nullable=False, server_default="4")
        )
        plans.add_column(sa.Column("max_priority", sa.Integer, nullable=False, server_default="0"))
        plans.add_column(sa.Column("weight", sa.Integer, nullable=False, server_default="1"))
    with op.batch_alter_table("api_keys") as keys:
        for column in _limit_columns():
            keys.add_column(column)


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as keys:
        for name in LIMITS:
            keys.drop_column(name)
    with op.batch_alter_table("plans") as plans:
        for name in (*LIMITS, "allowed_models", "default_priority", "max_priority", "weight"):
            plans.drop_column(name)
