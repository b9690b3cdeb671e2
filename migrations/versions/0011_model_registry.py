"""The model registry (issue 19): each served model name, its kind (Tollgate replicas or
an OpenAI-compatible upstream), its targets and what the gateway needs to front it

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "served_models",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("targets", sa.JSON, nullable=False),  # [{"url": ..., "weight": n}, ...]
        sa.Column("tokenizer", sa.Text, nullable=True),  # a local folder; None: the target's
        sa.Column("upstream_model", sa.String(256), nullable=True),
        sa.Column("api_key_env", sa.String(128), nullable=True),  # a variable's name only
        sa.Column("context_length", sa.Integer, nullable=True),  # None: learnt from a target
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("served_models")
