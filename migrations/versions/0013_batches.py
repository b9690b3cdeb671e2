"""the Batch and Files APIs: uploaded files, batches, one row per batch line (its state and
result, so a restart loses no result and runs no line twice), a per-model batch discount in
the price book and a per-plan limit on enqueued batch tokens (issue 36)

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_NOW = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("tenant_id", sa.String(36), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("filename", sa.String(255), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("created_at", _NOW, nullable=False),
        sa.Column("deleted_at", _NOW),
    )
    op.create_index("ix_files_tenant_created", "files", ["tenant_id", "created_at"])
    op.create_table(
        "batches",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("tenant_id", sa.String(36), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("api_key_id", sa.String(36), sa.ForeignKey("api_keys.id"), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("input_file_id", sa.String(64), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("output_file_id", sa.String(64)),
        sa.Column("error_file_id", sa.String(64)),
        sa.Column("errors", sa.JSON),
        sa.Column("metadata", sa.JSON),
        sa.Column("total", sa.Integer, nullable=False),
        sa.Column("completed", sa.Integer, nullable=False, server_default="0"),
        sa.Column("failed", sa.Integer, nullable=False, server_default="0"),
        sa.Column("enqueued_tokens", sa.BigInteger, nullable=False),
        sa.Column("worst_case_micros", sa.BigInteger, nullable=False),
        sa.Column("created_at", _NOW, nullable=False),
        sa.Column("in_progress_at", _NOW),
        sa.Column("expires_at", _NOW, nullable=False),
        sa.Column("finalizing_at", _NOW),
        sa.Column("completed_at", _NOW),
        sa.Column("failed_at", _NOW),
        sa.Column("expired_at", _NOW),
        sa.Column("cancelling_at", _NOW),
        sa.Column("cancelled_at", _NOW),
    )
    op.create_index("ix_batches_tenant_created", "batches", ["tenant_id", "created_at"])
    op.create_index("ix_batches_status", "batches", ["status"])
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.String(64), sa.ForeignKey("batches.id"), primary_key=True),
        sa.Column("line", sa.Integer, primary_key=True),
        sa.Column("custom_id", sa.String(255), nullable=False),
        sa.Column("body", sa.JSON, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("claimed_at", _NOW),
        sa.Column("status_code", sa.Integer),
        sa.Column("request_id", sa.String(64)),
        sa.Column("result", sa.JSON),
        sa.UniqueConstraint("batch_id", "custom_id", name="uq_batch_lines_custom_id"),
    )
    op.create_index("ix_batch_lines_batch_status", "batch_lines", ["batch_id", "status"])
    with op.batch_alter_table("price_versions") as table:
        table.add_column(
            sa.Column("batch_discount_pct", sa.Integer, nullable=False, server_default="50")
        )
    with op.batch_alter_table("plans") as table:
        table.add_column(sa.Column("max_batch_tokens", sa.BigInteger))


def downgrade() -> None:
    with op.batch_alter_table("plans") as table:
        table.drop_column("max_batch_tokens")
    with op.batch_alter_table("price_versions") as table:
        table.drop_column("batch_discount_pct")
    op.drop_index("ix_batch_lines_batch_status", table_name="batch_lines")
    op.drop_table("batch_lines")
    op.drop_index("ix_batches_status", table_name="batches")
    op.drop_index("ix_batches_tenant_created", table_name="batches")
    op.drop_table("batches")
    op.drop_index("ix_files_tenant_created", table_name="files")
    op.drop_table("files")
