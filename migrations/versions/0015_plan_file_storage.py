"""A plan's cap on its tenants' stored files (issue 36): total bytes of a tenant's files,
None for the gateway's default (TOLLGATE_FILES_MAX_BYTES_PER_TENANT)

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("plans") as table:
        table.add_column(sa.Column("max_file_bytes", sa.BigInteger))


def downgrade() -> None:
    with op.batch_alter_table("plans") as table:
        table.drop_column("max_file_bytes")
