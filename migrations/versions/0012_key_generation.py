"""the key generation: one counter every change to a key's standing bumps, so gateways may
remember authenticated keys for a few seconds and still refuse a revoked one at once
(issue 19)

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    table = op.create_table(
        "key_generation",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("value", sa.BigInteger, nullable=False),
    )
    op.bulk_insert(table, [{"id": 1, "value": 0}])


def downgrade() -> None:
    op.drop_table("key_generation")
