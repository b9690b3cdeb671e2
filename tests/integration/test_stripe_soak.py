"""The Stripe export soak (bounded, in `make test`): thousands of ledger rows over three
tenants exported by a real Celery worker (with its embedded beat) on Redis and PostgreSQL
against the strict fake, while faults hit chosen rows and random requests, the worker is
SIGKILLed mid-batch twice, and both 24-hour windows pass (the fake's clock and the ledger's
timestamps moved together). At the end, per customer, Stripe's total equals the ledger's
exactly and no identifier was counted twice. And a worker relays as it starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine, update
from sqlalchemy.orm import Session

from tenants import db
from tenants.audit import Actor
from tenants.billing.export import sync_engine
from tenants.billing.models import OutboxRow, OutboxStatus, StripeCustomerRequest
from tenants.billing.outbox import OutboxService
from tests.conftest import POSTGRES_URL, eventually, migrated_postgres
from tests.integration.stripe_support import (
    add_usage,
    identifier_of,
    ledger_totals,
    outbox,
    statuses,
    stripe_totals,
)
from tests.support.fake_stripe import API_KEY, FakeStripe

ROOT = Path(__file__).resolve().parents[2]
# A Redis database of its own: the soak's queue never meets another test's.
REDIS_URL = os.environ.get("TOLLGATE_TEST_SOAK_REDIS_URL", "redis://127.0.0.1:6379/7")
ROWS = 3_000
BOTH_WINDOWS = timedelta(hours=25)
FOREVER = 10_000  # faults enough to outlast the soak


@pytest.fixture
def fake() -> Iterator[FakeStripe]:
    with FakeStripe(hang_s=1.3).serving() as server:
        yield server


def worker_env(fake: FakeStripe, **settings: str) -> dict[str, str]:
    """A worker's environment: the test database, the soak's Redis, a queue of its own,
    the fake Stripe, and `settings`."""
    return {
        **os.environ,
        "TOLLGATE_DATABASE_URL": POSTGRES_URL,
        "TOLLGATE_REDIS_URL": REDIS_URL,
        "TOLLGATE_CELERY_QUEUE": f"tollgate-soak-{uuid.uuid4().hex}",
        "TOLLGATE_STRIPE_API_KEY": API_KEY,
        "TOLLGATE_STRIPE_BASE_URL": fake.url,
        **settings,
    }


def start_worker(env: dict[str, str], schedule: Path) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "gateway.billing.worker",
        "worker",
        "-B",
        "-s",
        str(schedule),
        "-Q",
        env["TOLLGATE_CELERY_QUEUE"],
        "-P",
        "solo",
        "--loglevel",
        "WARNING",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]
    # Its own session: SIGKILL reaches the worker and its beat process together.
    return subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True)


def kill(worker: subprocess.Popen[bytes]) -> None:
    if worker.poll() is None:
        os.killpg(worker.pid, signal.SIGKILL)
    worker.wait(timeout=10)


def sent_but_unmarked(engine: Engine, fake: FakeStripe) -> int:
    unmarked = {identifier_of(r) for r in outbox(engine) if r.status == OutboxStatus.PENDING}
    return len(unmarked & set(fake.counted))


def travel(engine: Engine, fake: FakeStripe, delta: timedelta) -> None:
    """Time passes for both sides: the fake's clock on, every stored moment back."""
    fake.advance(delta.total_seconds())
    with Session(engine) as session, session.begin():
        session.execute(
            update(OutboxRow).values(
                occurred_at=OutboxRow.occurred_at - delta,
                created_at=OutboxRow.created_at - delta,
                maybe_sent_at=OutboxRow.maybe_sent_at - delta,
                next_attempt_at=OutboxRow.next_attempt_at - delta,
                exported_at=OutboxRow.exported_at - delta,
            )
        )
        session.execute(
            update(StripeCustomerRequest).values(
                next_attempt_at=StripeCustomerRequest.next_attempt_at - delta
            )
        )


async def kill_mid_batch(
    env: dict[str, str], schedule: Path, engine: Engine, fake: FakeStripe, recorded: int
) -> None:
    """A worker runs until `recorded` events are in and is SIGKILLed, leaving rows sent but
    not marked exported. Should the kill land between two batches (nothing unmarked, about
    one time in 200), the next worker is killed a little later instead."""
    for tries in range(3):
        fake.hold_at(recorded + 67 * tries)
        worker = start_worker(env, schedule.with_suffix(f".{tries}"))
        try:
            await eventually(lambda: fake.held > 0, timeout_s=90)
        finally:
            kill(worker)
        fake.release.set()
        if sent_but_unmarked(engine, fake) > 0:
            return
    raise AssertionError("no kill landed mid-batch")


@pytest.mark.slow
async def test_celery_soak_counts_every_row_once_through_kills_faults_and_both_windows(
    tmp_path: Path, fake: FakeStripe
) -> None:
    migrated_postgres()
    async_engine = db.create_engine(POSTGRES_URL)
    sessions = db.session_factory(async_engine)
    ledger = sync_engine(POSTGRES_URL)
    env = worker_env(
        fake,
        TOLLGATE_STRIPE_TIMEOUT_S="1",
        TOLLGATE_STRIPE_RETRY_BASE_MS="2",
        TOLLGATE_EXPORT_INTERVAL_S="1",
        TOLLGATE_EXPORT_RETRY_S="1",
    )
    worker: subprocess.Popen[bytes] | None = None
    try:
        await add_usage(sessions, tenants=3, rows=ROWS, seed=42, free_share=0)
        rows = outbox(ledger)
        assert len(rows) == ROWS
        chosen = {name: identifier_of(rows[i]) for name, i in [
            ("recorded_then_500s", 40), ("500s_for_a_while", 900), ("refused", 1500),
            ("dropped", 2100), ("hung", 2500),
            ("recorded_then_stuck", 2700), ("never_recorded_stuck", 2800),
        ]}  # fmt: skip
        fake.program(
            rates={"429": 0.01, "500": 0.01, "drop_after_commit": 0.01},
            rows={
                chosen["recorded_then_500s"]: ["commit_then_500"] + ["500"] * 7,
                chosen["500s_for_a_while"]: ["500"] * 8,
                chosen["refused"]: ["400"],
                chosen["dropped"]: ["drop_after_commit"],
                chosen["hung"]: ["hang"],
                chosen["recorded_then_stuck"]: ["commit_then_500"] + ["500"] * FOREVER,
                chosen["never_recorded_stuck"]: ["500"] * FOREVER,
            },
            customers=["500", "500"],
        )

        # Two workers SIGKILLed mid-batch, then one that runs to the end of what it can.
        await kill_mid_batch(env, tmp_path / "beat-1", ledger, fake, recorded=700)
        await kill_mid_batch(env, tmp_path / "beat-2", ledger, fake, recorded=1_800)
        worker = start_worker(env, tmp_path / "beat-3")
        stuck = {chosen["recorded_then_stuck"], chosen["never_recorded_stuck"]}
        await eventually(
            lambda: (
                statuses(ledger)
                == {
                    OutboxStatus.EXPORTED: ROWS - 3,
                    OutboxStatus.FAILED: 1,
                    OutboxStatus.PENDING: 2,
                }
            ),
            timeout_s=240,
        )
        assert {identifier_of(r) for r in outbox(ledger) if r.status == "pending"} == stuck
        assert all(fake.injected[f] > 0 for f in ("429", "500", "drop_after_commit", "hang"))

        # A day passes: both windows. The two stuck rows may be in Stripe: not resent.
        travel(ledger, fake, BOTH_WINDOWS)
        await eventually(lambda: statuses(ledger)[OutboxStatus.UNCONFIRMED] == 2, timeout_s=60)
        assert fake.counted[chosen["recorded_then_stuck"]] == 1
        assert fake.counted[chosen["never_recorded_stuck"]] == 0

        # The operator checks Stripe for each, and requeues the refused row.
        fake.program()
        by_identifier = {identifier_of(r): r.id for r in outbox(ledger)}
        async with sessions.begin() as session:
            service = OutboxService(session, Actor("cli:ops"))
            for identifier in stuck:
                in_stripe = fake.counted[identifier] > 0
                rows_ = [by_identifier[identifier]]
                assert await service.resolve_unconfirmed(in_stripe, rows_) == 1
            assert await service.requeue_failed() == 1
        await eventually(lambda: statuses(ledger) == {OutboxStatus.EXPORTED: ROWS}, timeout_s=60)

        assert stripe_totals(ledger, fake) == ledger_totals(ledger)
        assert fake.doubled() == {} and fake.accepted() == ROWS
    finally:
        if worker is not None:
            kill(worker)
        ledger.dispose()
        await async_engine.dispose()


async def test_a_worker_relays_as_it_starts_not_one_interval_later(
    tmp_path: Path, fake: FakeStripe
) -> None:
    """A worker restarted after a crash sends what is pending at once: with an hour's
    interval, its beat alone would send nothing within the test."""
    migrated_postgres()
    async_engine = db.create_engine(POSTGRES_URL)
    ledger = sync_engine(POSTGRES_URL)
    env = worker_env(fake, TOLLGATE_EXPORT_INTERVAL_S="3600")
    worker: subprocess.Popen[bytes] | None = None
    try:
        await add_usage(db.session_factory(async_engine), tenants=2, rows=20, free_share=0)
        worker = start_worker(env, tmp_path / "beat")
        await eventually(lambda: statuses(ledger) == {OutboxStatus.EXPORTED: 20}, timeout_s=60)
        assert stripe_totals(ledger, fake) == ledger_totals(ledger)
    finally:
        if worker is not None:
            kill(worker)
        ledger.dispose()
        await async_engine.dispose()
