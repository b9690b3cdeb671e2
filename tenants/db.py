"""Database engines, sessions and migrations for both modes (SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import sqlalchemy
from sqlalchemy import event, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import Session

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"

_ASYNC_DRIVERS = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+psycopg"}
_SYNC_DRIVERS = {"sqlite": "sqlite", "postgresql": "postgresql+psycopg"}
T = TypeVar("T")
DIRECT_APPLICATION_NAME = "tollgate-direct"  # the direct pool's connections, in pg_stat_activity


def _with_driver(url: str, drivers: dict[str, str]) -> URL:
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend not in drivers:
        raise ValueError(f"unsupported database {backend!r}: use sqlite or postgresql")
    return parsed.set(drivername=drivers[backend])


def async_url(url: str) -> URL:
    """`postgresql://…` or `sqlite:///…` as the async driver URL the app uses."""
    return _with_driver(url, _ASYNC_DRIVERS)


def sync_url(url: str) -> URL:
    """The same database through a synchronous driver, for Alembic."""
    return _with_driver(url, _SYNC_DRIVERS)


def _ensure_sqlite_dir(url: URL) -> None:
    """The embedded database holds password hashes and stored completions: its folder is
    made owner-only (0700), and the file too (0600; SQLite gives its -wal and -shm files
    the database's mode) when they are created here."""
    if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
        path = Path(url.database)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # an empty file is an empty database
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


# SQLite connections kept open: each new aiosqlite connection starts a thread (the event
# loop blocks until it runs) and opens the file; a batch's lines (half the engine's slots)
# and the interactive requests beside them need more at once than SQLAlchemy's 5.
SQLITE_POOL = 32


def _sqlite_pool(url: URL) -> dict[str, int]:
    """A file database's pool sizes (an in-memory one has a single, static connection)."""
    if url.database in (None, "", ":memory:"):
        return {}
    return {"pool_size": SQLITE_POOL, "max_overflow": SQLITE_POOL}


def create_engine(url: str) -> AsyncEngine:
    parsed = async_url(url)
    _ensure_sqlite_dir(parsed)
    if parsed.get_backend_name() == "sqlite":
        engine = create_async_engine(parsed, connect_args={"timeout": 30}, **_sqlite_pool(parsed))
        event.listen(engine.sync_engine, "connect", sqlite_pragmas)
        return engine
    return create_async_engine(parsed, pool_size=10, max_overflow=20, pool_pre_ping=True)


def create_direct_engine(url: str) -> AsyncEngine:
    """A small pool for what is on every request's path and fits one round trip: each
    connection in autocommit (no BEGIN, no ROLLBACK on its return) and not pinged before
    use (another round trip). A read found dead is replaced by its caller's one retry
    (gateway.admission.key_cache); the ledger's commit is one pipeline, an implicit
    transaction, retried after a lost connection only for what it had not written
    (gateway.metering.recorder)."""
    parsed = async_url(url)
    if parsed.get_backend_name() == "sqlite":
        return create_async_engine(
            parsed,
            connect_args={"timeout": 30},
            isolation_level="AUTOCOMMIT",
            **_sqlite_pool(parsed),
        )
    return create_async_engine(
        parsed,
        pool_size=4,
        max_overflow=16,
        isolation_level="AUTOCOMMIT",
        connect_args={"application_name": DIRECT_APPLICATION_NAME},
    )


def is_postgres(url: str) -> bool:
    return make_url(url).get_backend_name() == "postgresql"


def sqlite_path(url: str) -> str | None:
    """The file of an SQLite database URL; None for another database or an in-memory one."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return parsed.database


def libpq_url(url: str, database: str | None = None) -> str:
    """A PostgreSQL URL as libpq (psycopg's own connect) takes it; `database`: another
    database on the same server."""
    parsed = make_url(url).set(drivername="postgresql")
    if database is not None:
        parsed = parsed.set(database=database)
    return parsed.render_as_string(hide_password=False)


def sqlite_pragmas(dbapi_connection: object, _record: object = None) -> None:
    """Every connection to an SQLite database: WAL, foreign keys, a 30 s busy timeout."""
    cursor = dbapi_connection.cursor()  # type: ignore[attr-defined]
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def session_factory(
    engine: AsyncEngine, sync_session_class: type[Session] = Session
) -> async_sessionmaker[AsyncSession]:
    """`sync_session_class`: a Session subclass of the caller's, to hear only its own
    sessions' events."""
    return async_sessionmaker(engine, expire_on_commit=False, sync_session_class=sync_session_class)


def run_once(url: str, work: Callable[[AsyncSession], Awaitable[T]]) -> T:
    """Run `work` in one transaction on an engine opened for it and disposed of after (a
    CLI command, a worker's task): committed when it returns, rolled back when it raises."""

    async def run() -> T:
        engine = create_engine(url)
        try:
            async with session_factory(engine).begin() as session:
                return await work(session)
        finally:
            await engine.dispose()

    return asyncio.run(run())


def alembic_config(url: str) -> Config:
    config = _migrations_config()
    parsed = sync_url(url)
    _ensure_sqlite_dir(parsed)
    # Alembic's config is an ini parser: escape % so passwords survive interpolation.
    rendered = parsed.render_as_string(hide_password=False).replace("%", "%%")
    config.set_main_option("sqlalchemy.url", rendered)
    return config


def reset_schema(url: str) -> None:
    """PostgreSQL: an empty public schema (tests and benches start from the migrations)."""
    engine = sqlalchemy.create_engine(sync_url(url), isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            connection.execute(text("DROP SCHEMA public CASCADE"))
            connection.execute(text("CREATE SCHEMA public"))
    finally:
        engine.dispose()


def upgrade(url: str, revision: str = "head") -> None:
    from alembic import command

    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    from alembic import command

    command.downgrade(alembic_config(url), revision)


def _migrations_config() -> Config:
    # Alembic is imported only where migrations run: a process that never migrates (the
    # Celery worker, a backend) starts ~0.5 s sooner without it.
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(_migrations_config()).get_current_head()
    if head is None:
        raise RuntimeError(f"no migrations in {MIGRATIONS_DIR}")
    return head


def current_revision(url: str) -> str | None:
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy import create_engine as create_sync_engine

    engine = create_sync_engine(sync_url(url))
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()
