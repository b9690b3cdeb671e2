"""usage ledger, outbox, rollups, price book, Stripe customers (issue 7)

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""

from collections.abc import Sequence

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    pass  # filled in by the work on this revision


def downgrade() -> None:
    pass
