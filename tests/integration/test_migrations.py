from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

import tenants.adapters
import tenants.admins
import tenants.audit
import tenants.batches
import tenants.billing.models
import tenants.files
import tenants.registry
import tenants.sign_ins  # noqa: F401  (their tables join Base.metadata)
from tenants import db
from tenants.models import Base

HEAD = db.head_revision()
TABLES = {"tenants", "plans", "api_keys", "usage_events", "served_models", "lora_adapters"}


def _tables(url: str) -> set[str]:
    engine = create_engine(db.sync_url(url))
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_creates_the_schema(database_url: str) -> None:
    assert _tables(database_url) >= TABLES
    assert db.current_revision(database_url) == HEAD


def test_downgrade_and_upgrade_round_trip(database_url: str) -> None:
    db.downgrade(database_url, "base")
    assert not TABLES & _tables(database_url)
    assert db.current_revision(database_url) is None
    db.upgrade(database_url)
    assert _tables(database_url) >= TABLES


def test_upgrade_twice_is_a_no_op(database_url: str) -> None:
    db.upgrade(database_url)
    assert db.current_revision(database_url) == HEAD


def test_the_migrated_schema_matches_the_models(database_url: str) -> None:
    """Every table, column type, index and constraint the models declare is what the
    migrations built: autogenerate finds nothing to do."""
    engine = create_engine(db.sync_url(database_url))
    try:
        with engine.connect() as connection:
            assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
    finally:
        engine.dispose()
