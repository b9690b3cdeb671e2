"""Stripe export: the relay against the fake Stripe through the real `stripe` SDK, fault by
fault (the Celery soak, with SIGKILLs, is tests/integration/test_stripe_soak.py)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session

from gateway.billing.jobs import BillingJobs
from gateway.cli import commands as cli
from gateway.settings import Settings
from tenants import audit, db
from tenants.audit import Actor
from tenants.billing.customers import StripeCustomerService
from tenants.billing.export import sync_engine
from tenants.billing.models import OutboxRow, OutboxStatus
from tenants.billing.outbox import OutboxService
from tenants.billing.relay import OUTAGE_STREAK, Relay
from tenants.billing.stripe_meters import IdempotencyKeys, MeterEvent
from tenants.errors import ConflictError, InvalidInputError
from tenants.models import Tenant
from tests.conftest import REDIS_URL
from tests.integration.stripe_support import (
    add_usage,
    meters,
    outbox,
    pending,
    stripe_totals,
)
from tests.support.fake_stripe import FakeStripe


@pytest.fixture
def fake() -> Iterator[FakeStripe]:
    with FakeStripe(hang_s=1.3).serving() as server:
        yield server


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = sync_engine(database_url)
    yield engine
    engine.dispose()


async def test_export_equals_ledger_and_a_second_run_sends_nothing(
    sessions: async_sessionmaker[AsyncSession], engine: Engine, fake: FakeStripe
) -> None:
    spent = await add_usage(sessions, tenants=3, rows=120)
    relay = Relay(engine, meters(fake), batch=50)

    first = relay.run()
    assert first.exported == first.claimed > 0
    assert pending(engine) == 0
    assert stripe_totals(engine, fake) == spent
    requests = fake.meter_event_requests

    assert relay.run().claimed == 0
    assert fake.meter_event_requests == requests
    assert len(fake.meters) == 1  # created once, found afterwards


@pytest.mark.parametrize("fault", ["429", "500", "hang", "drop_after_commit"])
async def test_a_transient_fault_is_retried_and_counted_once(
    sessions: async_sessionmaker[AsyncSession], engine: Engine, fake: FakeStripe, fault: str
) -> None:
    spent = await add_usage(sessions, tenants=1, rows=6, seed=3)
    fake.program(script=[fault, fault])
    # After a hang the same key meets 409 (in use) until the server gives up on it.
    sink = meters(fake, attempts=6, pause_s=0.2) if fault == "hang" else meters(fake)
    result = Relay(engine, sink).run()
    assert fake.injected[fault] == 2
    assert result.deferred == 0 and result.rejected == 0
    assert stripe_totals(engine, fake) == spent
    assert pending(engine) == 0


async def test_a_resend_after_a_crash_mid_batch_counts_once(
    sessions: async_sessionmaker[AsyncSession], engine: Engine, fake: FakeStripe
) -> None:
    """Events sent, then the relay dies before its commit: the next run resends them all
    with the same identifiers (new idempotency keys too, as after a key expiry)."""
    spent = await add_usage(sessions, tenants=2, rows=40, seed=5)

    class Crash(Exception):
        pass

    sink = meters(fake)
    sent = 0

    class CrashingSink:
        def ensure_meter(self) -> str:
            return sink.ensure_meter()

        def create_customer(self, tenant_id: str, tenant_name: str, keys: IdempotencyKeys) -> str:
            return sink.create_customer(tenant_id, tenant_name, keys)

        def send(self, event: MeterEvent) -> None:
            nonlocal sent
            if sent == 8:
                raise Crash
            sink.send(event)
            sent += 1

    with pytest.raises(Crash):
        Relay(engine, CrashingSink()).run()
    assert fake.accepted() == 8 and pending(engine) > 8  # sent, but none marked
    fake.saved.clear()  # idempotency keys forgotten: only the identifier dedups now

    Relay(engine, meters(fake)).run()
    assert stripe_totals(engine, fake) == spent
    assert pending(engine) == 0


async def test_an_outage_defers_rows_without_marking_them(
    sessions: async_sessionmaker[AsyncSession], engine: Engine, fake: FakeStripe
) -> None:
    """Stripe down: OUTAGE_STREAK rows are tried and wait (maybe in Stripe: a 500), the
    run ends, and the rows after them are left as they were, not penalised."""
    await add_usage(sessions, tenants=1, rows=20, seed=9, free_share=0)
    fake.program(rates={"500": 1.0})
    result = Relay(engine, meters(fake, attempts=3)).run()
    assert result.outage and result.exported == 0 and result.deferred == OUTAGE_STREAK
    assert fake.accepted() == 0
    rows = outbox(engine)
    tried, untouched = rows[:OUTAGE_STREAK], rows[OUTAGE_STREAK:]
    assert all(r.status == OutboxStatus.PENDING and r.next_attempt_at is not None for r in tried)
    assert all(r.attempts == 1 and "APIError (500)" in (r.last_error or "") for r in tried)
    assert all(r.maybe_sent_at is not None for r in tried)  # a 500 may have been recorded
    assert all(
        (r.attempts, r.next_attempt_at, r.last_error, r.maybe_sent_at) == (0, None, None, None)
        for r in untouched
    )
    fake.program()
    again = Relay(engine, meters(fake)).run()
    assert again.claimed == again.exported == len(untouched)  # the tried ones are not due yet


async def test_a_rejected_event_is_parked_as_failed(
    sessions: async_sessionmaker[AsyncSession], engine: Engine, fake: FakeStripe
) -> None:
    await add_usage(sessions, tenants=1, rows=5, seed=11)
    fake.program(script=["400"])
    result = Relay(engine, meters(fake)).run()
    assert result.rejected == 1 and result.exported == result.claimed - 1
    with Session(engine) as session:
        statuses = Counter(session.scalars(select(OutboxRow.status)))
    assert statuses == {OutboxStatus.FAILED: 1, OutboxStatus.EXPORTED: result.claimed - 1}

    async with sessions.begin() as session:  # the cause fixed, an operator requeues it
        outbox = OutboxService(session, Actor("cli:ops"))
        assert (await outbox.status()).failed == 1
        assert await outbox.requeue_failed() == 1
    assert Relay(engine, meters(fake)).run().exported == 1
    async with sessions() as session:
        status = await OutboxService(session).status()
        [event] = await audit.list_events(session, action="billing.export.requeue")
    assert (status.pending, status.failed, status.exported) == (0, 0, result.claimed)
    assert status.oldest_pending is None and event.details == {"rows": 1}


def stripe_settings(database_url: str, fake: FakeStripe, **changes: Any) -> Settings:
    base = Settings.from_env({})
    return replace(
        base,
        database_url=database_url,
        stripe_api_key="sk_test_fake",
        stripe_base_url=fake.url,
        stripe_retry_base_ms=1,
        **changes,
    )


async def test_the_embedded_gateway_runs_the_same_relay(
    database_url: str, sessions: async_sessionmaker[AsyncSession], engine: Engine, fake: FakeStripe
) -> None:
    spent = await add_usage(sessions, tenants=2, rows=30, seed=13)
    settings = stripe_settings(database_url, fake)
    assert BillingJobs.wanted(settings)
    assert not BillingJobs.wanted(replace(settings, redis_url=REDIS_URL))
    await BillingJobs(settings, sessions).export()
    assert stripe_totals(engine, fake) == spent


def test_cli_billing_export_is_audited(
    database_url: str,
    fake: FakeStripe,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    async def seed() -> dict[str, int]:
        async_engine = db.create_engine(database_url)
        try:
            return await add_usage(db.session_factory(async_engine), tenants=1, rows=12, seed=17)
        finally:
            await async_engine.dispose()

    async def exports() -> list[dict[str, Any]]:
        async_engine = db.create_engine(database_url)
        try:
            async with db.session_factory(async_engine)() as session:
                events = await audit.list_events(session, action="billing.export")
                return [dict(event.details or {}) for event in events]
        finally:
            await async_engine.dispose()

    spent = asyncio.run(seed())
    for name, value in {
        "TOLLGATE_DATABASE_URL": database_url,
        "TOLLGATE_STRIPE_API_KEY": "sk_test_fake",
        "TOLLGATE_STRIPE_BASE_URL": fake.url,
    }.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["billing", "export"]) == 0
    exported = sum(1 for _ in fake.events)
    assert f"exported={exported}" in capsys.readouterr().out
    assert sum(fake.customer_totals().values()) == sum(spent.values())
    assert asyncio.run(exports()) == [{"exported": exported, "deferred": 0, "rejected": 0}]

    monkeypatch.delenv("TOLLGATE_STRIPE_API_KEY")
    assert cli.main(["billing", "export"]) == 2
    assert "TOLLGATE_STRIPE_API_KEY" in capsys.readouterr().err


async def test_a_tenant_linked_to_an_existing_customer_is_billed_as_it(
    sessions: async_sessionmaker[AsyncSession], engine: Engine, fake: FakeStripe
) -> None:
    spent = await add_usage(sessions, tenants=2, rows=20, seed=19, free_share=0)
    linked, created = sorted(spent)
    existing = fake.add_customer()
    async with sessions.begin() as session:
        tenant = await session.get_one(Tenant, linked)
        service = StripeCustomerService(session, Actor("cli:ops"))
        await service.link(tenant, existing)
        with pytest.raises(InvalidInputError):
            await service.link(tenant, "acct_123")
        with pytest.raises(ConflictError):
            await service.link(await session.get_one(Tenant, created), existing)

    Relay(engine, meters(fake)).run()
    totals = fake.customer_totals()
    assert totals.pop(existing) == spent[linked]
    assert list(totals.values()) == [spent[created]]
    assert len(fake.customers) == 2  # only the unlinked tenant got a new customer
    async with sessions() as session:
        [event] = await audit.list_events(session, action="billing.customer.link")
    assert (event.actor, event.tenant_id) == ("cli:ops", linked)
    assert event.details == {"customer_id": existing, "previous": None}
