"""The Stripe export under Stripe's real rules (issue 16), against the strict fake: keys that
never replay a saved failure, no double count past both 24-hour windows, a stuck row or a
stuck customer holding up nobody else."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from sqlalchemy import Engine, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session

from gateway.billing.jobs import BillingJobs, ExportGauges
from gateway.cli import commands as cli
from gateway.settings import Settings
from tenants import db
from tenants.audit import Actor
from tenants.billing.customers import StripeCustomerService
from tenants.billing.export import sync_engine
from tenants.billing.export_lock import STATE, ExportBusy
from tenants.billing.models import (
    CustomerRequestStatus,
    ExportState,
    OutboxStatus,
    StripeCustomerRequest,
)
from tenants.billing.outbox import OutboxService
from tenants.billing.relay import Relay
from tenants.billing.reports import Period, build_report
from tenants.models import utcnow
from tenants.services import TenantService
from tests.conftest import eventually
from tests.integration.billing_support import ledger_rows, owner
from tests.integration.stripe_support import (
    EVENT,
    Clock,
    add_usage,
    identifier_of,
    meters,
    outbox,
    statuses,
    stripe_totals,
)
from tests.support.fake_stripe import API_KEY, FakeStripe

BACKOFF_PASSED = timedelta(minutes=2)  # past a first-time deferral's backoff
BOTH_WINDOWS = timedelta(hours=25)  # past the identifier window and the key window


@pytest.fixture
def fake() -> Iterator[FakeStripe]:
    with FakeStripe(hang_s=1.3).serving() as server:
        yield server


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = sync_engine(database_url)
    yield engine
    engine.dispose()


async def test_saved_500s_are_not_replayed_and_nothing_counts_twice_past_both_windows(
    sessions: async_sessionmaker[AsyncSession], engine: Engine, fake: FakeStripe
) -> None:
    """A row recorded, then answered 500 on every try of a run: it backs off alone (the
    rest of its batch goes out), the next run's new keys get "already exists" instead of
    the saved 500s, and after both windows nothing is sent again."""
    spent = await add_usage(sessions, tenants=2, rows=12, seed=21, free_share=0)
    stuck = outbox(engine)[0]
    fake.program(rows={identifier_of(stuck): ["commit_then_500"] + ["500"] * 4})
    clock = Clock(fake)
    relay = Relay(engine, meters(fake, attempts=5), clock=clock)

    first = relay.run()
    assert (first.deferred, first.exported) == (1, len(outbox(engine)) - 1)
    rows = {row.id: row for row in outbox(engine)}
    assert rows.pop(stuck.id).maybe_sent_at is not None
    assert all(r.status == OutboxStatus.EXPORTED and r.last_error is None for r in rows.values())

    clock.advance(BACKOFF_PASSED)
    assert relay.run().exported == 1
    clock.advance(BOTH_WINDOWS)
    assert relay.run().claimed == 0
    assert fake.counted[identifier_of(stuck)] == 1 and fake.doubled() == {}
    assert stripe_totals(engine, fake) == spent


@pytest.mark.parametrize("recorded", [True, False])
async def test_a_row_maybe_in_stripe_is_not_resent_past_the_identifier_window(
    sessions: async_sessionmaker[AsyncSession], engine: Engine, fake: FakeStripe, recorded: bool
) -> None:
    """Stripe answers 500 for a day: past the window no key can make a resend safe, so the
    row turns `unconfirmed`; the operator checks Stripe and resolves it either way."""
    spent = await add_usage(sessions, tenants=1, rows=3, seed=22, free_share=0)
    stuck = outbox(engine)[0]
    faults = ["commit_then_500"] if recorded else []
    fake.program(rows={identifier_of(stuck): faults + ["500"] * 40})
    clock = Clock(fake)
    relay = Relay(engine, meters(fake, attempts=3), clock=clock)
    relay.run()
    clock.advance(BACKOFF_PASSED)
    assert relay.run().deferred == 1

    clock.advance(timedelta(hours=24))
    retired = relay.run()
    assert retired.unconfirmed == 1 and retired.claimed == 0
    assert statuses(engine)[OutboxStatus.UNCONFIRMED] == 1
    assert fake.counted[identifier_of(stuck)] == (1 if recorded else 0)  # not sent again
    fake.program()

    async with sessions.begin() as session:
        service = OutboxService(session, Actor("cli:ops"))
        status = await service.status(now=clock())
        assert status.unconfirmed == 1 and any("unconfirmed" in w for w in status.warnings())
        assert await service.resolve_unconfirmed(in_stripe=recorded) == 1
    relay.run()
    assert stripe_totals(engine, fake) == spent and fake.doubled() == {}
    assert statuses(engine) == {OutboxStatus.EXPORTED: 3}


async def test_a_row_that_only_got_definite_answers_has_no_time_limit(
    sessions: async_sessionmaker[AsyncSession], engine: Engine, fake: FakeStripe
) -> None:
    """429s are not executed: the row was never in Stripe and is sent whenever it is due."""
    spent = await add_usage(sessions, tenants=1, rows=2, seed=24, free_share=0)
    stuck = outbox(engine)[0]
    fake.program(rows={identifier_of(stuck): ["429"] * 3})
    clock = Clock(fake)
    relay = Relay(engine, meters(fake, attempts=3), clock=clock)
    assert relay.run().deferred == 1
    assert outbox(engine)[0].maybe_sent_at is None
    clock.advance(BOTH_WINDOWS)
    assert relay.run().exported == 1
    assert stripe_totals(engine, fake) == spent


async def test_a_failing_customer_creation_holds_up_only_its_tenant(
    sessions: async_sessionmaker[AsyncSession], engine: Engine, fake: FakeStripe
) -> None:
    spent = await add_usage(sessions, tenants=3, rows=30, seed=23, free_share=0)
    fake.program(customers=["500"] * 5)  # the first tenant's creation, every try
    clock = Clock(fake)
    relay = Relay(engine, meters(fake, attempts=5), clock=clock)

    relay.run()
    with Session(engine) as session:
        [request] = session.scalars(select(StripeCustomerRequest))
        blocked = request.tenant_id
        assert (request.attempts, request.status) == (1, CustomerRequestStatus.PENDING)
        assert request.key_seq == 5 and "500" in (request.last_error or "")
    exported = stripe_totals(engine, fake)
    assert exported == {t: total for t, total in spent.items() if t != blocked}
    waiting = [r for r in outbox(engine) if r.tenant_id == blocked]
    assert waiting and all(r.status == OutboxStatus.PENDING and r.attempts == 0 for r in waiting)

    clock.advance(BACKOFF_PASSED)  # the next try starts past the saved 500s' keys
    relay.run()
    assert stripe_totals(engine, fake) == spent
    assert len(fake.customers) == 3
    with Session(engine) as session:
        assert session.scalars(select(StripeCustomerRequest)).all() == []


async def test_a_refused_customer_waits_for_the_operator_then_requeue(
    sessions: async_sessionmaker[AsyncSession], engine: Engine, fake: FakeStripe
) -> None:
    spent = await add_usage(sessions, tenants=1, rows=5, seed=25, free_share=0)
    fake.program(customers=["400"])
    relay = Relay(engine, meters(fake))
    assert relay.run().claimed == 0
    assert relay.run().claimed == 0  # refused for good: not retried on its own
    async with sessions.begin() as session:
        service = OutboxService(session, Actor("cli:ops"))
        status = await service.status()
        assert status.customers_failed == 1 and any("customer" in w for w in status.warnings())
        await service.requeue_failed()
    relay.run()  # a new key: the saved 400 is not replayed
    assert stripe_totals(engine, fake) == spent


# One relay at a time per database, whoever starts it.


async def test_one_relay_at_a_time_per_database(
    sessions: async_sessionmaker[AsyncSession],
    engine: Engine,
    fake: FakeStripe,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A relay caught mid-batch holds the lock: a second relay, the CLI export and the
    gateway's periodic export all find it busy and send nothing; afterwards all is sent."""
    spent = await add_usage(sessions, tenants=2, rows=20, seed=31, free_share=0)
    fake.hold_after = 3  # the first relay's 4th event waits on the fake
    first = asyncio.create_task(asyncio.to_thread(Relay(engine, meters(fake, attempts=2)).run))
    await eventually(lambda: fake.held > 0)

    with pytest.raises(ExportBusy):
        Relay(engine, meters(fake)).run()
    settings = stripe_settings(database_url, fake)
    for name, value in {
        "TOLLGATE_DATABASE_URL": database_url,
        "TOLLGATE_STRIPE_API_KEY": API_KEY,
        "TOLLGATE_STRIPE_BASE_URL": fake.url,
    }.items():
        monkeypatch.setenv(name, value)
    assert await asyncio.to_thread(cli.main, ["billing", "export"]) == 2
    await BillingJobs(settings, sessions).export()  # logs and returns
    assert "another Stripe export is running" in capsys.readouterr().err
    assert fake.meter_event_requests == 3  # only the first relay's

    fake.release.set()
    await first
    Relay(engine, meters(fake)).run()
    assert stripe_totals(engine, fake) == spent and fake.doubled() == {}


def test_a_crashed_holders_lease_lapses_on_sqlite(tmp_path: Path, fake: FakeStripe) -> None:
    url = f"sqlite:///{tmp_path / 'lease.db'}"
    db.upgrade(url)
    engine = sync_engine(url)
    try:
        with Session(engine) as session, session.begin():
            session.add(ExportState(name=STATE, holder="dead:1", lease_until=utcnow()))
        Relay(engine, meters(fake)).run()  # the lapsed lease is taken over
        with Session(engine) as session, session.begin():
            state = session.get_one(ExportState, STATE)
            assert state.holder is None  # released after the run
            state.holder, state.lease_until = "alive:2", utcnow() + timedelta(minutes=1)
        with pytest.raises(ExportBusy):
            Relay(engine, meters(fake)).run()
    finally:
        engine.dispose()


def stripe_settings(database_url: str, fake: FakeStripe) -> Settings:
    base = Settings.from_env({})
    return replace(
        base,
        database_url=database_url,
        stripe_api_key=API_KEY,
        stripe_base_url=fake.url,
        stripe_retry_base_ms=1,
    )


# The meter: its status and every page of the list.


async def test_an_inactive_meter_stops_the_export_with_a_clear_warning(
    sessions: async_sessionmaker[AsyncSession],
    engine: Engine,
    fake: FakeStripe,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    spent = await add_usage(sessions, tenants=1, rows=6, seed=41, free_share=0)
    meter = fake.add_meter(EVENT, status="inactive")
    result = Relay(engine, meters(fake)).run()
    assert result.meter_error is not None and "inactive" in result.meter_error
    assert result.claimed == 0 and len(fake.meters) == 1  # not parked, no second meter
    assert all((r.status, r.attempts) == (OutboxStatus.PENDING, 0) for r in outbox(engine))

    monkeypatch.setenv("TOLLGATE_DATABASE_URL", database_url)
    assert await asyncio.to_thread(cli.main, ["billing", "status"]) == 0
    assert "warning: Stripe meter inactive" in capsys.readouterr().err

    meter["status"] = "active"  # reactivated in Stripe
    assert Relay(engine, meters(fake)).run().exported == len(outbox(engine))
    assert stripe_totals(engine, fake) == spent
    async with sessions() as session:
        assert (await OutboxService(session).status()).warnings() == []


async def test_the_meter_is_found_past_the_first_page(
    sessions: async_sessionmaker[AsyncSession], engine: Engine, fake: FakeStripe
) -> None:
    spent = await add_usage(sessions, tenants=1, rows=4, seed=42, free_share=0)
    for index in range(150):
        fake.add_meter(f"other_{index}")
    fake.add_meter(EVENT)
    Relay(engine, meters(fake)).run()  # a duplicate create would be refused: 400
    assert len(fake.meters) == 151 and stripe_totals(engine, fake) == spent


async def test_a_meter_that_cannot_be_created_is_reported_missing(
    sessions: async_sessionmaker[AsyncSession], engine: Engine, fake: FakeStripe
) -> None:
    await add_usage(sessions, tenants=1, rows=2, seed=43, free_share=0)
    sink = meters(fake)
    sink.event_name = "x" * 101  # Stripe refuses such an event name
    result = Relay(engine, sink).run()
    assert result.meter_error is not None and "creating it failed" in result.meter_error
    async with sessions() as session:
        status = await OutboxService(session).status()
    assert status.meter_status == "missing" and fake.meters == {}


# Stripe's 35 days: a warning with 7 days left, then too_old_for_stripe.


async def test_rows_near_the_35_day_limit_warn_and_rows_past_it_are_too_old(
    sessions: async_sessionmaker[AsyncSession],
    engine: Engine,
    fake: FakeStripe,
    caplog: pytest.LogCaptureFixture,
) -> None:
    who = await owner(sessions, "aged")
    now = utcnow()
    near, old = now - timedelta(days=30), now - timedelta(days=36)
    rows = await ledger_rows(sessions, who, [near, near, old, now, old], seed=44)
    cost = {m: sum(r.cost_micros for r in rows if r.created_at == m) for m in (near, old)}
    billable_old = [r for r in rows if r.created_at == old and r.cost_micros]

    async with sessions() as session:
        before = await OutboxService(session).status()
    assert before.near_limit == sum(1 for r in rows if r.created_at != now and r.cost_micros)
    assert any("less than 7 days left" in w for w in before.warnings())

    result = Relay(engine, meters(fake)).run()
    assert result.too_old == len(billable_old) and "bill them by hand" in caplog.text
    assert "less than 7 days left" in caplog.text
    assert sum(fake.customer_totals().values()) == sum(r.cost_micros for r in rows) - cost[old]
    async with sessions() as session:
        after = await OutboxService(session).status()
        [too_old] = await OutboxService(session).too_old()
        report = await build_report(
            session, await TenantService(session).get("aged"), Period.current(old)
        )
    assert after.too_old == len(billable_old) and after.near_limit == 0
    assert (too_old.tenant, too_old.rows, too_old.micros) == ("aged", len(billable_old), cost[old])
    assert any("too_old_for_stripe" in w for w in after.warnings())
    assert report.totals.cost_micros >= cost[old]  # still in the ledger and the invoice preview


async def test_linking_a_refused_tenant_to_an_existing_customer_unblocks_it(
    sessions: async_sessionmaker[AsyncSession], engine: Engine, fake: FakeStripe
) -> None:
    spent = await add_usage(sessions, tenants=1, rows=4, seed=45, free_share=0)
    fake.program(customers=["400"])
    relay = Relay(engine, meters(fake))
    relay.run()
    existing = fake.add_customer()
    async with sessions.begin() as session:
        [tenant_id] = spent
        tenant = await TenantService(session).get_by_id(tenant_id)
        await StripeCustomerService(session, Actor("cli:ops")).link(tenant, existing)
    relay.run()
    assert fake.customer_totals() == {existing: spent[tenant_id]}
    async with sessions() as session:
        assert (await OutboxService(session).status()).customers_failed == 0


async def test_export_health_is_exported_as_metrics(
    sessions: async_sessionmaker[AsyncSession],
    engine: Engine,
    fake: FakeStripe,
    database_url: str,
) -> None:
    who = await owner(sessions, "metered")
    now = utcnow()
    await ledger_rows(sessions, who, [now - timedelta(days=30)] * 4 + [now], seed=46)
    fake.add_meter(EVENT, status="inactive")
    Relay(engine, meters(fake)).run()  # records the meter's status
    registry = CollectorRegistry()
    gauges = ExportGauges(registry)
    status = await BillingJobs(stripe_settings(database_url, fake), sessions).refresh_health(gauges)
    assert status.near_limit > 0
    text = generate_latest(registry).decode()
    assert f'tollgate_stripe_export_rows{{state="near_limit"}} {float(status.near_limit)}' in text
    assert "tollgate_stripe_meter_active 0.0" in text


async def test_keys_move_on_after_a_5xx_and_every_run_but_not_after_a_drop(
    sessions: async_sessionmaker[AsyncSession], engine: Engine, fake: FakeStripe
) -> None:
    await add_usage(sessions, tenants=1, rows=3, seed=47, free_share=0)
    first, second, third = (identifier_of(row) for row in outbox(engine))
    fake.program(rows={first: ["500", "500"], second: ["drop_after_commit"], third: ["429"] * 3})
    clock = Clock(fake)
    relay = Relay(engine, meters(fake, attempts=3), clock=clock)
    relay.run()
    clock.advance(BACKOFF_PASSED)
    relay.run()

    def keys(identifier: str) -> list[str]:
        return sorted(key.removeprefix(identifier) for key in fake.saved if identifier in key)

    assert keys(first) == ["-1.0", "-1.1", "-1.2"]  # a new key after each 500
    assert keys(second) == ["-1.0"]  # the drop's retry replays the recorded event's answer
    assert keys(third) == ["-2.0"]  # 429s save nothing; the next run has a key of its own
    assert fake.doubled() == {} and fake.accepted() == 3
