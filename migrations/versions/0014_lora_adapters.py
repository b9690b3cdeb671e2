"""LoRA adapters as product objects (issue 34 item 3): a tenant's fine-tune of a served
base model, addressed by its name in `model` by that tenant alone

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "lora_adapters",
        sa.Column("id", sa.String(36), primary_key=True),
        # Unique across tenants: the engine, the price book and replica affinity know an
        # adapter by its name alone.
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("tenant_id", sa.String(36), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("base_model", sa.String(128), nullable=False),
        sa.Column("path", sa.Text, nullable=False),  # a PEFT folder on the engines' hosts
        sa.Column("rank", sa.Integer, nullable=False),
        sa.Column("target_modules", sa.JSON, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_lora_adapters_tenant_id", "lora_adapters", ["tenant_id"])


def downgrade() -> None:
    op.drop_index("ix_lora_adapters_tenant_id", table_name="lora_adapters")
    op.drop_table("lora_adapters")
