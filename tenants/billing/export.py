"""What an export run needs from the domain, wherever it runs: a Celery task in the stack,
the gateway's own periodic job in the embedded default, or `tollgate billing export`.
Callers pass in what they read from their settings (gateway/billing/stripe.py)."""

from __future__ import annotations

from sqlalchemy import Engine, create_engine

from tenants import db
from tenants.billing.rollups import rebuild_recent


def sync_engine(database_url: str) -> Engine:
    url = db.sync_url(database_url)
    if url.get_backend_name() == "sqlite":
        return create_engine(url, connect_args={"timeout": 30})
    return create_engine(url, pool_size=2, max_overflow=2, pool_pre_ping=True)


def rollup_once(database_url: str) -> int:
    return db.run_once(database_url, rebuild_recent)
