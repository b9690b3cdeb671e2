"""usage_checkpoints, its one owner: each running stream's delivered tokens, upserted
every checkpoint interval (gateway/metering/recorder.py) and deleted with the stream's
ledger row; a dead gateway's stale checkpoints, claimed by the orphan sweep."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, cast

from sqlalchemy import Table, delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from tenants.models import UsageCheckpoint

Executor = AsyncSession | AsyncConnection


async def upsert(executor: Executor, dialect: str, rows: list[dict[str, Any]]) -> None:
    """Each stream's checkpoint, written or rewritten (one statement for all)."""
    await executor.execute(_CHECKPOINT_UPSERTS[dialect], rows)


async def remove(executor: Executor, request_ids: Sequence[str]) -> None:
    """The checkpoints of streams whose ledger rows are written."""
    await executor.execute(
        delete(UsageCheckpoint).where(UsageCheckpoint.request_id.in_(request_ids))
    )


def upsert_sqlite(connection: sqlite3.Connection, rows: list[dict[str, Any]]) -> None:
    """upsert on SQLite, straight through the stdlib driver in the caller's transaction,
    each value bound as SQLAlchemy binds it."""
    connection.executemany(_SQLITE_UPSERT, [_sqlite_checkpoint(row) for row in rows])


def remove_sqlite(connection: sqlite3.Connection, request_ids: Sequence[str]) -> None:
    connection.executemany(_SQLITE_DELETE, [(request_id,) for request_id in request_ids])


async def stale(session: AsyncSession, before: datetime, limit: int) -> Sequence[UsageCheckpoint]:
    """Checkpoints not refreshed since `before`: their gateways died."""
    query = select(UsageCheckpoint).where(UsageCheckpoint.updated_at < before).limit(limit)
    return (await session.scalars(query)).all()


async def claim(session: AsyncSession, checkpoint: UsageCheckpoint) -> bool:
    """Delete the checkpoint as it was read; False when it is gone or was refreshed (its
    gateway is alive, or another gateway's sweep claimed it first)."""
    claimed = await session.execute(
        delete(UsageCheckpoint).where(
            UsageCheckpoint.request_id == checkpoint.request_id,
            UsageCheckpoint.updated_at == checkpoint.updated_at,
        )
    )
    return getattr(claimed, "rowcount", 0) == 1


# What a checkpoint of a stream already checkpointed rewrites.
CHECKPOINT_CHANGES = (
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "replica",
    "updated_at",
)


def _checkpoint_upsert(insert: Callable[[type[UsageCheckpoint]], Any]) -> Any:
    """The checkpoint upsert, built once per dialect (rows are its parameters): building
    the ON CONFLICT clause per write was a measurable share of a stream's cost."""
    statement = insert(UsageCheckpoint)
    return statement.on_conflict_do_update(
        index_elements=["request_id"],
        set_={name: statement.excluded[name] for name in CHECKPOINT_CHANGES},
    )


_CHECKPOINT_UPSERTS = {
    "postgresql": _checkpoint_upsert(postgresql.insert),
    "sqlite": _checkpoint_upsert(sqlite.insert),
}


def _sqlite_checkpoint(row: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(
        row[name] if bind is None else bind(row[name]) for name, bind in _SQLITE_CHECKPOINT_BINDS
    )


_SQLITE_DIALECT = sqlite.dialect()
_CHECKPOINTS = cast(Table, UsageCheckpoint.__table__)
# Each column's name and its bind processor for SQLite (None: the value as it is).
_SQLITE_CHECKPOINT_BINDS = [
    (column.name, column.type.dialect_impl(_SQLITE_DIALECT).bind_processor(_SQLITE_DIALECT))
    for column in _CHECKPOINTS.columns
]
_SQLITE_UPSERT = (
    'INSERT INTO "{}" ({}) VALUES ({}) ON CONFLICT ("request_id") DO UPDATE SET {}'.format(
        _CHECKPOINTS.name,
        ", ".join(f'"{name}"' for name, _ in _SQLITE_CHECKPOINT_BINDS),
        ", ".join("?" for _ in _SQLITE_CHECKPOINT_BINDS),
        ", ".join(f'"{name}" = excluded."{name}"' for name in CHECKPOINT_CHANGES),
    )
)
_SQLITE_DELETE = f'DELETE FROM "{_CHECKPOINTS.name}" WHERE "request_id" = ?'
