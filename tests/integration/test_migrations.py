from __future__ import annotations

from sqlalchemy import create_engine, inspect

from tenants import db

HEAD = db.head_revision()
TABLES = {"tenants", "plans", "api_keys", "usage_events"}


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
