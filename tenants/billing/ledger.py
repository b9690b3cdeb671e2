"""The usage ledger (usage_events), its one owner: the usage rows and their outbox rows,
written in the caller's transaction, so a row is exported to Stripe exactly when it exists
in the ledger; and every read of the table (the recorder's look-ups, usage pages, billing
reports, daily rollups, the console's batch share).

A row carries its request's Idempotency-Key (unique per tenant): a request run again under
a key whose answer was lost (the process died between the ledger write and storing the
answer) is a rerun, and its row is not written (`reruns`, given the keys `billed_keys*`
finds in the writer's transaction). The unique index refuses a rerun that raced past the
look-up (its writer then looks again)."""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

import psycopg
from sqlalchemy import (
    Column,
    ColumnDefault,
    ColumnElement,
    Date,
    Row,
    Select,
    Table,
    and_,
    case,
    func,
    insert,
    inspect,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy import cast as sql_cast
from sqlalchemy.dialects import sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncResult, AsyncSession
from sqlalchemy.orm import InstrumentedAttribute

from tenants.billing.models import OutboxRow
from tenants.models import BATCH_ENDPOINT_PREFIX, ApiKey, Tenant, UsageEvent, new_id, utcnow


async def row_ids(session: AsyncSession, request_ids: Collection[str]) -> dict[str, str]:
    """The ledger rows of these requests, by request id: their rows' ids."""
    query = select(UsageEvent.request_id, UsageEvent.id).where(
        UsageEvent.request_id.in_(request_ids)
    )
    return dict((await session.execute(query)).all())


async def tenant_row(session: AsyncSession, tenant_id: str, request_id: str) -> UsageEvent | None:
    """A request's row, if it is the tenant's (another tenant's is not found)."""
    query = select(UsageEvent).where(
        UsageEvent.request_id == request_id, UsageEvent.tenant_id == tenant_id
    )
    return await session.scalar(query)


async def tenant_rows(session: AsyncSession, tenant_id: str, limit: int) -> list[UsageEvent]:
    """The tenant's newest rows."""
    query = (
        select(UsageEvent)
        .where(UsageEvent.tenant_id == tenant_id)
        .order_by(UsageEvent.created_at.desc())
        .limit(limit)
    )
    return list(await session.scalars(query))


async def any_since(session: AsyncSession, since: datetime) -> bool:
    """Whether any request ended since `since`."""
    query = select(UsageEvent.id).where(UsageEvent.created_at >= since).limit(1)
    return await session.scalar(query) is not None


async def cost_by_key(
    session: AsyncSession, since: datetime, until: datetime
) -> Sequence[Row[str, str, int]]:
    """(tenant id, key id, cost) of the rows of [since, until) that cost something."""
    query = (
        select(UsageEvent.tenant_id, UsageEvent.api_key_id, func.sum(UsageEvent.cost_micros))
        .where(UsageEvent.created_at >= since, UsageEvent.created_at < until)
        .where(UsageEvent.cost_micros > 0)
        .group_by(UsageEvent.tenant_id, UsageEvent.api_key_id)
    )
    return (await session.execute(query)).all()


async def costed_rows(
    session: AsyncSession, since: datetime, until: datetime, batch: int
) -> AsyncResult[str, str, str, int, datetime]:
    """The rows of [since, until) that cost something (request, tenant and key ids, cost,
    time), streamed `batch` at a time."""
    query = (
        select(
            UsageEvent.request_id,
            UsageEvent.tenant_id,
            UsageEvent.api_key_id,
            UsageEvent.cost_micros,
            UsageEvent.created_at,
        )
        .where(UsageEvent.created_at >= since, UsageEvent.created_at < until)
        .where(UsageEvent.cost_micros > 0)
        .execution_options(yield_per=batch)
    )
    return await session.stream(query)


async def record(session: AsyncSession, event: UsageEvent) -> None:
    await record_all(session, [event])


async def record_all(session: AsyncSession | AsyncConnection, events: Sequence[UsageEvent]) -> None:
    """Several requests' rows, one INSERT per table (a gateway commits settles in groups).
    Core inserts, not the ORM's unit of work (nor its bulk path): that flush was most of
    a settle's CPU, and the rows are not read back here. The events stay transient."""
    _stamp(events)
    by_columns: dict[frozenset[str], list[dict[str, Any]]] = {}
    for event in events:  # one executemany per set of columns given (the rest: defaults)
        values = _values(event)
        by_columns.setdefault(frozenset(values), []).append(values)
    for rows in by_columns.values():
        await session.execute(_INSERT_USAGE, rows)
    billed = _billed(events)
    if billed:
        await session.execute(_INSERT_OUTBOX, billed)


async def record_all_direct(
    connection: psycopg.AsyncConnection[Any], events: Sequence[UsageEvent]
) -> None:
    """record_all's rows on PostgreSQL, straight through psycopg (gateway.metering.recorder): one
    statement per DIRECT_BATCH events, their usage rows and, in a data-modifying WITH, their
    outbox rows, so on an autocommit connection a group of up to DIRECT_BATCH is one
    statement and one implicit transaction. Rows as parameters, every column that the
    server does not fill given its value, else its Python-side default (as SQLAlchemy's
    insert fills it), else NULL. SQLAlchemy's execution of the same Core inserts cost
    about 0.4 ms of CPU per group, and an executemany per table in a pipeline ~0.3 ms more
    than one statement."""
    _stamp(events)
    cursor = connection.cursor()
    for start in range(0, len(events), DIRECT_BATCH):
        batch = events[start : start + DIRECT_BATCH]
        usage = [_direct_row(_USAGE_TABLE.name, _values(event)) for event in batch]
        outbox = [_direct_row(_OUTBOX_TABLE.name, row) for row in _billed(batch)]
        params = [value for row in (*usage, *outbox) for value in row]
        await cursor.execute(_direct_sql(len(usage), len(outbox)), params)


def record_all_sqlite(connection: sqlite3.Connection, events: Sequence[UsageEvent]) -> None:
    """record_all's rows on SQLite, straight through the stdlib driver, in the caller's
    transaction (ledger_writes.SqliteLedger): one executemany per table, every
    column that the database does not fill given its value, else its Python-side default,
    else NULL, each bound as SQLAlchemy binds it for SQLite (its type's bind processor:
    times, enums). Through aiosqlite and SQLAlchemy a one-row group cost ~0.9 ms of CPU."""
    _stamp(events)
    usage = [_sqlite_row(_USAGE_TABLE.name, _values(event)) for event in events]
    connection.executemany(_sqlite_sql(_USAGE_TABLE.name), usage)
    outbox = [_sqlite_row(_OUTBOX_TABLE.name, row) for row in _billed(events)]
    if outbox:
        connection.executemany(_sqlite_sql(_OUTBOX_TABLE.name), outbox)


BilledKey = tuple[str, str]  # (tenant id, Idempotency-Key)


def reruns(events: Sequence[UsageEvent], billed: set[BilledKey]) -> list[UsageEvent]:
    """The events whose key has a row already (`billed`) or an earlier event here: not to
    be written, nor billed."""
    seen = set(billed)
    found = []
    for event in events:
        key = _billed_key(event)
        if key is None:
            continue
        if key in seen:
            found.append(event)
        seen.add(key)
    return found


async def billed_keys(
    session: AsyncSession | AsyncConnection, events: Sequence[UsageEvent], since: datetime
) -> set[BilledKey]:
    """The events' keys that have a usage row created at `since` or later (the retention
    of Idempotency-Keys); an older row's key is cleared, free for the reuse. No query when
    no event has a key."""
    billed: set[BilledKey] = set()
    for keys in _key_batches(events):
        found = await session.execute(
            select(
                UsageEvent.tenant_id, UsageEvent.idempotency_key, UsageEvent.created_at >= since
            ).where(_pairs(keys))
        )
        stale = _split(found, billed)
        if stale:
            await session.execute(
                update(UsageEvent).where(_pairs(stale)).values(idempotency_key=None)
            )
    return billed


async def billed_keys_direct(
    connection: psycopg.AsyncConnection[Any], events: Sequence[UsageEvent], since: datetime
) -> set[BilledKey]:
    """billed_keys through psycopg: one round trip (another to clear a stale key)."""
    billed: set[BilledKey] = set()
    for keys in _key_batches(events):
        cursor = await connection.execute(_keys_sql(len(keys), "%s"), [since, *_flat(keys)])
        stale = _split(await cursor.fetchall(), billed)
        if stale:
            await connection.execute(_clear_sql(len(stale), "%s"), _flat(stale))
    return billed


def billed_keys_sqlite(
    connection: sqlite3.Connection, events: Sequence[UsageEvent], since: datetime
) -> set[BilledKey]:
    """billed_keys through the stdlib driver, in the caller's transaction."""
    billed: set[BilledKey] = set()
    for keys in _key_batches(events):
        found = connection.execute(_keys_sql(len(keys), "?"), [_SQLITE_TIME(since), *_flat(keys)])
        stale = _split(found, billed)
        if stale:
            connection.execute(_clear_sql(len(stale), "?"), _flat(stale))
    return billed


def _split(found: Iterable[Any], billed: set[BilledKey]) -> list[BilledKey]:
    """Adds the recent rows' keys to `billed`; returns the stale ones."""
    stale = []
    for tenant, key, recent in found:
        if recent:
            billed.add((tenant, key))
        else:
            stale.append((tenant, key))
    return stale


def _pairs(keys: list[BilledKey]) -> ColumnElement[bool]:
    return or_(
        *(
            and_(UsageEvent.tenant_id == tenant, UsageEvent.idempotency_key == key)
            for tenant, key in keys
        )
    )


def _billed_key(event: UsageEvent) -> BilledKey | None:
    key = event.__dict__.get("idempotency_key")
    return None if key is None else (event.tenant_id, key)


def _key_batches(events: Sequence[UsageEvent]) -> list[list[BilledKey]]:
    """The events' keys, KEYS_BATCH a query (SQLite parses an OR chain a level deep per
    term, at most 1000); none when no event has a key."""
    keys = sorted({key for event in events if (key := _billed_key(event)) is not None})
    return [keys[start : start + KEYS_BATCH] for start in range(0, len(keys), KEYS_BATCH)]


def _flat(keys: list[BilledKey]) -> list[str]:
    return [value for key in keys for value in key]


@functools.lru_cache(maxsize=64)
def _keys_sql(count: int, placeholder: str) -> str:
    """The look-up of `count` (tenant, key) pairs, each row said recent or not (the first
    parameter, the retention's start): an OR of equalities, each one probe of the unique
    index on both databases."""
    return (
        f'SELECT "tenant_id", "idempotency_key", "created_at" >= {placeholder} '
        f'FROM "{_USAGE_TABLE.name}" WHERE {_pairs_sql(count, placeholder)}'
    )


@functools.lru_cache(maxsize=64)
def _clear_sql(count: int, placeholder: str) -> str:
    return (
        f'UPDATE "{_USAGE_TABLE.name}" SET "idempotency_key" = NULL '
        f"WHERE {_pairs_sql(count, placeholder)}"
    )


def _pairs_sql(count: int, placeholder: str) -> str:
    pair = f'("tenant_id" = {placeholder} AND "idempotency_key" = {placeholder})'
    return " OR ".join([pair] * count)


def _sqlite_row(table: str, given: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(
        value if bind is None else bind(value)
        for value, bind in zip(_direct_row(table, given), _SQLITE_BINDS[table], strict=True)
    )


@functools.cache
def _sqlite_sql(table: str) -> str:
    names = [name for name, _ in _DIRECT_COLUMNS[table]]
    columns = ", ".join(f'"{name}"' for name in names)
    return f'INSERT INTO "{table}" ({columns}) VALUES ({", ".join(["?"] * len(names))})'


def _stamp(events: Sequence[UsageEvent]) -> None:
    for event in events:
        event.id = event.id or new_id()
        event.created_at = event.created_at or utcnow()


def _billed(events: Sequence[UsageEvent]) -> list[dict[str, Any]]:
    """The outbox rows: nothing to bill, nothing to export; after the usage rows they
    refer to."""
    return [
        {
            "usage_event_id": event.id,
            "tenant_id": event.tenant_id,
            "value": event.cost_micros,
            "occurred_at": event.created_at,
        }
        for event in events
        if event.cost_micros > 0
    ]


def _direct_row(table: str, given: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(
        given[name] if name in given else default() if default is not None else None
        for name, default in _DIRECT_COLUMNS[table]
    )


@functools.lru_cache(maxsize=256)
def _direct_sql(usage_rows: int, outbox_rows: int) -> str:
    """One INSERT of `usage_rows` rows and, when there are outbox rows, theirs in the same
    statement (foreign keys are checked at its end, the usage rows in by then)."""
    usage = _values_sql(_USAGE_TABLE.name, usage_rows)
    if not outbox_rows:
        return usage
    return f'WITH "usage" AS ({usage}) {_values_sql(_OUTBOX_TABLE.name, outbox_rows)}'


def _values_sql(table: str, rows: int) -> str:
    names = [name for name, _ in _DIRECT_COLUMNS[table]]
    columns = ", ".join(f'"{name}"' for name in names)
    row = "(" + ", ".join(["%s"] * len(names)) + ")"
    return f'INSERT INTO "{table}" ({columns}) VALUES {", ".join([row] * rows)}'


def _python_default(column: Column[Any]) -> Callable[[], Any]:
    """A zero-argument function giving the column's Python-side default."""
    default = column.default
    assert isinstance(default, ColumnDefault) and not default.is_clause_element
    arg = default.arg
    if default.is_callable:
        return lambda: arg(None)  # SQLAlchemy's wrapper of the function takes a context
    return lambda: arg


def _values(event: UsageEvent) -> dict[str, Any]:
    """The event's values by column name: those it was given; the others get their
    column defaults."""
    given = event.__dict__
    return {column: given[key] for key, column in _USAGE_COLUMNS if key in given}


# (attribute, column) of every mapped column
_USAGE_COLUMNS = tuple(
    (attr.key, attr.columns[0].name) for attr in inspect(UsageEvent).column_attrs
)
_USAGE_TABLE = cast(Table, UsageEvent.__table__)
_OUTBOX_TABLE = cast(Table, OutboxRow.__table__)
# inline: nothing read back (no RETURNING of generated keys), so on PostgreSQL the rows can
# go in a pipeline that waits for no answer before its Sync (gateway.metering.recorder)
_INSERT_USAGE = insert(_USAGE_TABLE).inline()
_INSERT_OUTBOX = insert(_OUTBOX_TABLE).inline()
# Events per statement on PostgreSQL: a usage row takes a parameter a column (and its
# outbox row a few more), and a statement at most 65,535.
DIRECT_BATCH = 1000
KEYS_BATCH = 200  # (tenant, key) pairs looked up a query
# Per table, the columns a direct insert gives, each with its Python-side default (None: it
# has none, so NULL when not given): all but those the server fills (the serial id; a
# server default with no Python-side one), as SQLAlchemy's insert leaves those out.
_DIRECT_COLUMNS = {
    table.name: [
        (c.name, None if c.default is None else _python_default(c))
        for c in table.columns
        if c.default is not None
        or (c.server_default is None and c is not table.autoincrement_column)
    ]
    for table in (_USAGE_TABLE, _OUTBOX_TABLE)
}
_SQLITE = sqlite.dialect()
# Per table, each direct column's bind processor for SQLite (None: the value as it is).
_SQLITE_BINDS = {
    table.name: [
        table.columns[name].type.dialect_impl(_SQLITE).bind_processor(_SQLITE)
        for name, _ in _DIRECT_COLUMNS[table.name]
    ]
    for table in (_USAGE_TABLE, _OUTBOX_TABLE)
}
# How SQLite stores a time (created_at's bind processor): what a look-up compares with.
_SQLITE_TIME = cast(
    Callable[[datetime], Any],
    _USAGE_TABLE.c.created_at.type.dialect_impl(_SQLITE).bind_processor(_SQLITE),
)


# Reads: what the console shows of the ledger (gateway/console/queries.py, pages.py).

USAGE_PAGE = 200
# The outcome columns of a row, for the console's overview: created_at, endpoint, status,
# error, finish_reason, prompt_tokens, completion_tokens, ttft_ms, e2e_ms, itl_ms.
OutcomeRow = Row[
    datetime, str, str, str | None, str | None, int, int, float | None, float | None, float | None
]


@dataclass(frozen=True)
class UsageFilter:
    tenant: str | None = None  # tenant name
    key: str | None = None  # key prefix
    model: str | None = None
    status: str | None = None
    since: datetime | None = None
    until: datetime | None = None

    def as_query(self) -> dict[str, str]:
        given = {
            "tenant": self.tenant,
            "key": self.key,
            "model": self.model,
            "status": self.status,
            "since": self.since.strftime("%Y-%m-%dT%H:%M") if self.since else None,
            "until": self.until.strftime("%Y-%m-%dT%H:%M") if self.until else None,
        }
        return {name: value for name, value in given.items() if value}


@dataclass(frozen=True)
class UsageRow:
    event: UsageEvent
    tenant: str
    key_prefix: str


def _rows_query(where: UsageFilter) -> Select[UsageEvent, str, str]:
    query = (
        select(UsageEvent, Tenant.name, ApiKey.prefix)
        .join(Tenant, Tenant.id == UsageEvent.tenant_id)
        .join(ApiKey, ApiKey.id == UsageEvent.api_key_id)
        .order_by(UsageEvent.created_at.desc())
    )
    if where.tenant:
        query = query.where(Tenant.name == where.tenant)
    if where.key:
        query = query.where(ApiKey.prefix == where.key)
    if where.model:
        query = query.where(UsageEvent.model == where.model)
    if where.status:
        query = query.where(UsageEvent.status == where.status)
    if where.since:
        query = query.where(UsageEvent.created_at >= where.since)
    if where.until:
        query = query.where(UsageEvent.created_at < where.until)
    return query


async def find_usage(
    session: AsyncSession, where: UsageFilter, limit: int = USAGE_PAGE
) -> list[UsageRow]:
    """The newest rows the filter takes, with their tenants' names and keys' prefixes."""
    result = await session.execute(_rows_query(where).limit(limit))
    return [UsageRow(event, tenant, prefix) for event, tenant, prefix in result.all()]


async def find_request(session: AsyncSession, request_id: str) -> UsageRow | None:
    row = (
        await session.execute(_rows_query(UsageFilter()).where(UsageEvent.request_id == request_id))
    ).one_or_none()
    return None if row is None else UsageRow(*row)


async def known_models(session: AsyncSession) -> list[str]:
    result = await session.execute(select(UsageEvent.model).distinct().order_by(UsageEvent.model))
    return list(result.scalars())


async def latest_outcomes(
    session: AsyncSession, since: datetime, limit: int
) -> Sequence[OutcomeRow]:
    """The outcome columns of the newest rows since `since` (at most `limit`): only what
    the overview charts, which asks every 2 s for each open page."""
    query = (
        select(
            UsageEvent.created_at,
            UsageEvent.endpoint,
            UsageEvent.status,
            UsageEvent.error,
            UsageEvent.finish_reason,
            UsageEvent.prompt_tokens,
            UsageEvent.completion_tokens,
            UsageEvent.ttft_ms,
            UsageEvent.e2e_ms,
            UsageEvent.itl_ms,
        )
        .where(UsageEvent.created_at >= since)
        .order_by(UsageEvent.created_at.desc())
        .limit(limit)
    )
    return (await session.execute(query)).all()


async def tenant_usage_since(
    session: AsyncSession, tenant_id: str, since: datetime
) -> Sequence[Row[datetime, int, int, int]]:
    """(time, prompt tokens, completion tokens, cost) of each of the tenant's rows since
    `since`."""
    query = select(
        UsageEvent.created_at,
        UsageEvent.prompt_tokens,
        UsageEvent.completion_tokens,
        UsageEvent.cost_micros,
    ).where(UsageEvent.tenant_id == tenant_id, UsageEvent.created_at >= since)
    return (await session.execute(query)).all()


def utc_day(column: InstrumentedAttribute[datetime], dialect: str) -> ColumnElement[Any]:
    """The UTC calendar day of a timestamp column, on PostgreSQL (whatever the session's
    time zone) and on SQLite (which stores UTC text)."""
    if dialect == "postgresql":
        return sql_cast(func.timezone("UTC", column), Date)
    return func.date(column)


async def tenant_days(
    session: AsyncSession, tenant_id: str, start: datetime, end: datetime
) -> Sequence[Any]:
    """The tenant's rows in [start, end) summed by UTC day, model, status and batch or
    not: (day, model, status, batch, requests, prompt, cached, completion, cost). Reads
    (tenant_id, created_at) and the columns the PostgreSQL index includes."""
    day = utc_day(UsageEvent.created_at, session.get_bind().dialect.name).label("day")
    batch = UsageEvent.endpoint.startswith(BATCH_ENDPOINT_PREFIX).label("batch")
    query = (
        select(
            day,
            UsageEvent.model,
            UsageEvent.status,
            batch,
            func.count().label("requests"),
            func.coalesce(func.sum(UsageEvent.prompt_tokens), 0).label("prompt"),
            func.coalesce(func.sum(UsageEvent.cached_tokens), 0).label("cached"),
            func.coalesce(func.sum(UsageEvent.completion_tokens), 0).label("completion"),
            func.coalesce(func.sum(UsageEvent.cost_micros), 0).label("cost"),
        )
        .where(UsageEvent.tenant_id == tenant_id)
        .where(UsageEvent.created_at >= start, UsageEvent.created_at < end)
        .group_by(day, UsageEvent.model, UsageEvent.status, batch)
    )
    return (await session.execute(query)).all()


def daily_sums(dialect: str, start: datetime, end: datetime) -> Select[Any]:
    """Every row in [start, end) summed by UTC day, tenant and model, as the daily
    rollups' columns: (day, tenant, model, requests, prompt, cached, completion, cost,
    now), for an INSERT ... SELECT."""
    day = utc_day(UsageEvent.created_at, dialect)
    return (
        select(
            day,
            UsageEvent.tenant_id,
            UsageEvent.model,
            func.count(),
            func.sum(UsageEvent.prompt_tokens),
            func.sum(UsageEvent.cached_tokens),
            func.sum(UsageEvent.completion_tokens),
            func.sum(UsageEvent.cost_micros),
            literal(utcnow()),
        )
        .where(UsageEvent.created_at >= start, UsageEvent.created_at < end)
        .group_by(day, UsageEvent.tenant_id, UsageEvent.model)
    )


async def batch_token_share(session: AsyncSession, since: datetime) -> float | None:
    """The share of the tokens the engine computed since `since` (prompt tokens not
    served from the prefix cache, and output tokens) that went to batch lines: the
    batch share of engine time, as the ledger sees it. None: no tokens at all."""
    computed = UsageEvent.prompt_tokens - UsageEvent.cached_tokens + UsageEvent.completion_tokens
    is_batch = UsageEvent.endpoint.startswith(BATCH_ENDPOINT_PREFIX)
    row = (
        await session.execute(
            select(
                func.coalesce(func.sum(computed), 0),
                func.coalesce(func.sum(case((is_batch, computed), else_=0)), 0),
            ).where(UsageEvent.created_at >= since)
        )
    ).one()
    total, batch = int(row[0]), int(row[1])
    return None if total == 0 else batch / total
