"""One Stripe relay at a time per database, whoever runs it (the Celery worker, the gateway's
periodic job, `tollgate billing export`, the admin API's "export now").

Two relays side by side would send the same customer's events concurrently, and Stripe
takes one call per customer per meter at a time (the rest get 429). PostgreSQL: a
session-level advisory lock on a connection held for the run (it ends with the
connection, so a SIGKILLed worker releases it). SQLite: a lease in the
`stripe_export_state` row, renewed per batch, that a crashed holder loses when it lapses.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

from sqlalchemy import Connection, Engine, func, or_, select, update
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from tenants.billing.models import ExportState
from tenants.errors import ConflictError
from tenants.models import utcnow

STATE = "stripe"
ADVISORY_KEY = 0x546F6C6C53747270  # "TollStrp": this lock's id among the database's locks
LEASE = timedelta(minutes=5)  # SQLite: a crashed holder's lease lapses after this


class ExportBusy(ConflictError):
    """Another Stripe export is running against this database."""

    def __init__(self) -> None:
        super().__init__("another Stripe export is running; try again when it is done")


class ExportLock:
    def __init__(self, engine: Engine, lease: timedelta = LEASE) -> None:
        self.engine = engine
        self.lease = lease
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Held for the block, or ExportBusy at once (never waits)."""
        if self.engine.dialect.name == "postgresql":
            with self.engine.connect() as connection:
                yield from _advisory(connection)
            return
        self._take_lease()
        try:
            yield
        finally:
            self._release_lease()

    def renew(self) -> None:
        """Extend the SQLite lease (a no-op on PostgreSQL); ExportBusy if it was lost."""
        if self.engine.dialect.name == "postgresql":
            return
        with self.engine.begin() as connection:
            renewed = connection.execute(
                update(ExportState)
                .where(ExportState.name == STATE, ExportState.holder == self.holder)
                .values(lease_until=utcnow() + self.lease)
            )
        if renewed.rowcount != 1:
            raise ExportBusy()

    def _take_lease(self) -> None:
        now = utcnow()
        with self.engine.begin() as connection:
            connection.execute(
                sqlite_insert(ExportState).values(name=STATE).on_conflict_do_nothing()
            )
            taken = connection.execute(
                update(ExportState)
                .where(
                    ExportState.name == STATE,
                    or_(ExportState.holder.is_(None), ExportState.lease_until < now),
                )
                .values(holder=self.holder, lease_until=now + self.lease)
            )
        if taken.rowcount != 1:
            raise ExportBusy()

    def _release_lease(self) -> None:
        with self.engine.begin() as connection:
            connection.execute(
                update(ExportState)
                .where(ExportState.name == STATE, ExportState.holder == self.holder)
                .values(holder=None, lease_until=None)
            )


def _advisory(connection: Connection) -> Iterator[None]:
    if not connection.scalar(select(func.pg_try_advisory_lock(ADVISORY_KEY))):
        raise ExportBusy()
    connection.commit()  # the lock is the session's, not the transaction's
    try:
        yield
    finally:
        try:
            connection.scalar(select(func.pg_advisory_unlock(ADVISORY_KEY)))
            connection.commit()
        except Exception:
            connection.invalidate()  # closing the connection releases the lock anyway
            raise
