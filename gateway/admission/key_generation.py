"""The key generation, kept in memory on PostgreSQL: LISTEN/NOTIFY instead of a read per
request; on SQLite, read per request on a connection of the event loop's own.

Every change to a key's standing bumps the generation and, in the same statement, sends
`NOTIFY tollgate_key_generation, '<new value>'` (tenants.services.keys_changed), which
PostgreSQL delivers to every listener when, and only if, the change commits: whoever
made it (a gateway replica, the console, the CLI). A listener holds one connection of its
own in autocommit: it LISTENs first, then reads the generation, so nothing committed in
between is missed, then takes each notified value. Every HEARTBEAT_S it reads the
generation again on that connection, which proves the connection alive; a value not
confirmed for two heartbeats is not trusted (a connection that hangs without closing).
While it has no live connection (dropped, not yet made) it is blind: `current()` is None,
and the caller reads the generation itself as before, until the listener has listened and
read again. A bump this process commits itself is learnt at once (`learns_commits_of`),
not when its notification comes back: a key revoked on a replica is refused by its very
next request there.

SQLite has no notifications, so each request reads the row (`SqliteGeneration`): a
primary-key read of a database in WAL mode, on a plain sqlite3 connection the event loop
owns, takes microseconds, where the async pool's read costs about 0.5 ms of CPU (a hop to
aiosqlite's thread and back through SQLAlchemy; bench/README.md). WAL readers do not wait
for writers, and this one never waits at all: with no busy timeout a read that cannot be
made at once (the database locked, being recovered) gives None, and the caller reads
through the pool instead, as it does on PostgreSQL while the listener is blind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections.abc import Callable

import psycopg
from psycopg import sql
from sqlalchemy import event
from sqlalchemy.orm import Session

from tenants.services import KEY_GENERATION_BUMPED, KEY_GENERATION_CHANNEL

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0  # how often the listener re-reads the generation on its connection
RETRY_S = 1.0  # how long a blind listener waits before it connects again
APPLICATION_NAME = "tollgate-key-generation"  # its connection, as pg_stat_activity shows it

_LISTEN = sql.SQL("LISTEN {}").format(sql.Identifier(KEY_GENERATION_CHANNEL))
_READ = "SELECT value FROM key_generation WHERE id = 1"


class GenerationListener:
    def __init__(
        self, conninfo: str, heartbeat_s: float = HEARTBEAT_S, retry_s: float = RETRY_S
    ) -> None:
        self.conninfo = conninfo
        self.heartbeat_s = heartbeat_s
        self.retry_s = retry_s
        self._value: int | None = None  # None: blind
        self._trusted_until = 0.0
        self._moved = asyncio.Event()  # set, and replaced, at every change of current()
        self._task: asyncio.Task[None] | None = None

    def current(self) -> int | None:
        """The generation, while the listener is live; None while it is blind."""
        if self._value is None or time.monotonic() >= self._trusted_until:
            return None
        return self._value

    async def until(self, check: Callable[[int | None], bool]) -> None:
        """Wait until `check(current())` holds (it is tried at every change)."""
        while not check(self.current()):
            await self._moved.wait()

    def learn(self, committed: int) -> None:
        """A generation this process has committed: the database holds it or a later one,
        so the live value may move up to it (never past what is committed)."""
        if self._value is not None and committed > self._value:
            self._value = committed
            self._wake_waiters()

    def learns_commits_of(self, session_class: type[Session]) -> None:
        """Learn each bump committed through sessions of `session_class`."""

        def committed(session: Session) -> None:
            value = session.info.pop(KEY_GENERATION_BUMPED, None)
            if value is not None:
                self.learn(value)

        def rolled_back(session: Session) -> None:
            session.info.pop(KEY_GENERATION_BUMPED, None)

        event.listen(session_class, "after_commit", committed)
        event.listen(session_class, "after_rollback", rolled_back)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._listen_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._set(None)  # closed is blind: callers read the generation themselves

    async def _listen_forever(self) -> None:
        while True:
            try:
                await self._listen()
            except Exception as exc:  # whatever it was, blind until it has listened again
                log.warning("key generation listener lost (%r): reading per request", exc)
            self._set(None)
            await asyncio.sleep(self.retry_s)  # a pause before reconnecting, not a wait

    async def _listen(self) -> None:
        async with asyncio.timeout(self.heartbeat_s):
            connection = await psycopg.AsyncConnection.connect(
                self.conninfo, autocommit=True, application_name=APPLICATION_NAME
            )
        async with connection:
            await connection.execute(_LISTEN)  # before the read: nothing slips in between
            while True:
                async with asyncio.timeout(self.heartbeat_s):
                    row = await (await connection.execute(_READ)).fetchone()
                self._set(None if row is None else int(row[0]))
                async for notice in connection.notifies(timeout=self.heartbeat_s):
                    self._set(max(int(notice.payload), self._value or 0))

    def _set(self, value: int | None) -> None:
        self._value = value
        self._trusted_until = time.monotonic() + 2 * self.heartbeat_s
        self._wake_waiters()

    def _wake_waiters(self) -> None:
        """current() changed: every `until` tries its check again."""
        self._moved.set()
        self._moved = asyncio.Event()


class SqliteGeneration:
    """The key generation read on demand from an SQLite database file (see above)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._connection: sqlite3.Connection | None = None

    def start(self) -> None:
        # Autocommit (each read its own snapshot, so a change committed anywhere is seen by
        # the next read); used on the event loop's thread only; reads only.
        connection = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        connection.execute("PRAGMA busy_timeout = 0")
        connection.execute("PRAGMA query_only = ON")
        self._connection = connection

    def current(self) -> int | None:
        """The generation; None where it cannot be read at once (or the row is missing)."""
        if self._connection is None:
            return None
        try:
            row = self._connection.execute(_READ).fetchone()
        except sqlite3.Error as exc:
            log.debug("key generation not read on the loop's connection: %s", exc)
            return None
        return None if row is None else int(row[0])

    async def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
