"""The key generation on SQLite, read on the event loop's own connection: every read sees
what was committed before it, anywhere, and a read that cannot be made at once gives None
(the caller then reads through the pool) instead of waiting."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway.admission.key_generation import SqliteGeneration
from tenants.db import sqlite_path


def _database(path: Path, wal: bool) -> sqlite3.Connection:
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute(f"PRAGMA journal_mode = {'WAL' if wal else 'DELETE'}")
    writer.execute("CREATE TABLE key_generation (id INTEGER PRIMARY KEY, value INTEGER)")
    writer.execute("INSERT INTO key_generation VALUES (1, 7)")
    return writer


@pytest.fixture
async def reader(tmp_path: Path) -> AsyncIterator[SqliteGeneration]:
    generation = SqliteGeneration(str(tmp_path / "gateway.db"))
    yield generation
    await generation.close()


async def test_each_read_sees_what_another_connection_committed(
    tmp_path: Path, reader: SqliteGeneration
) -> None:
    writer = _database(tmp_path / "gateway.db", wal=True)
    reader.start()
    assert reader.current() == 7
    writer.execute("UPDATE key_generation SET value = 8 WHERE id = 1")  # autocommit
    assert reader.current() == 8
    writer.execute("BEGIN")
    writer.execute("UPDATE key_generation SET value = 9 WHERE id = 1")
    assert reader.current() == 8  # not committed: not seen, and not waited for (WAL)
    writer.execute("COMMIT")
    assert reader.current() == 9
    connection = reader._connection
    assert connection is not None
    with pytest.raises(sqlite3.OperationalError):  # it only reads
        connection.execute("UPDATE key_generation SET value = 0")
    await reader.close()
    assert reader.current() is None
    writer.close()


async def test_a_database_it_cannot_read_at_once_gives_none(
    tmp_path: Path, reader: SqliteGeneration
) -> None:
    writer = _database(tmp_path / "gateway.db", wal=False)  # a rollback journal: writers lock
    reader.start()
    writer.execute("BEGIN EXCLUSIVE")
    assert reader.current() is None  # locked: the caller reads through the pool instead
    writer.execute("ROLLBACK")
    assert reader.current() == 7
    writer.execute("DELETE FROM key_generation")
    assert reader.current() is None  # no row: nothing is remembered
    writer.execute("DROP TABLE key_generation")
    assert reader.current() is None
    writer.close()


def test_only_a_database_file_gets_one() -> None:
    assert sqlite_path("sqlite:////var/lib/tollgate/gateway.db") == "/var/lib/tollgate/gateway.db"
    assert sqlite_path("sqlite+aiosqlite:///data/gateway.db") == "data/gateway.db"
    assert sqlite_path("sqlite:///:memory:") is None
    assert sqlite_path("sqlite://") is None
    assert sqlite_path("postgresql://127.0.0.1/tollgate") is None
