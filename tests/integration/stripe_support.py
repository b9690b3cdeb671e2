"""Helpers shared by the Stripe export tests: the fake's sink, ledger rows, totals on
both sides, and one clock for the relay and the fake together."""

from __future__ import annotations

import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import Engine, func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session

from tenants.billing.models import OutboxRow, OutboxStatus, StripeCustomer
from tenants.billing.stripe_meters import Retry, StripeMeters
from tenants.models import KeyRole, UsageEvent, UsageStatus, utcnow
from tenants.services import ApiKeyService, TenantService, UsageService
from tests.support.fake_stripe import API_KEY, FakeStripe

EVENT = "tollgate_usage_micros"


def meters(fake: FakeStripe, attempts: int = 4, pause_s: float | None = None) -> StripeMeters:
    """The real sink against the fake; `pause_s`: a fixed pause between a call's tries
    (long enough to outlast a hang on the server) instead of the jittered one."""
    return StripeMeters(
        API_KEY,
        EVENT,
        base_url=fake.url,
        timeout_s=1.0,
        retry=Retry(attempts=attempts, base_s=0.001, cap_s=0.01),
        sleep=time.sleep if pause_s is None else lambda _: time.sleep(pause_s),
    )


@dataclass
class Clock:
    """The relay's clock, moved on together with the fake's: both 24-hour windows pass
    for both sides at once."""

    fake: FakeStripe
    offset: timedelta = field(default_factory=timedelta)

    def __call__(self) -> datetime:
        return utcnow() + self.offset

    def advance(self, delta: timedelta) -> None:
        self.offset += delta
        self.fake.advance(delta.total_seconds())


async def add_usage(
    sessions: async_sessionmaker[AsyncSession],
    tenants: int,
    rows: int,
    seed: int = 1,
    free_share: float = 0.5,
    names: str = "t",
) -> dict[str, int]:
    """`rows` ledger rows spread over `tenants` tenants, about `free_share` of them free;
    returns cost per tenant id."""
    rng = random.Random(seed)
    spent: Counter[str] = Counter()
    async with sessions.begin() as session:
        owners = []
        for index in range(tenants):
            name = f"{names}{index}-{uuid.uuid4().hex[:6]}"
            tenant = await TenantService(session).create(name)
            key = await ApiKeyService(session).create(tenant, "k", KeyRole.TENANT)
            owners.append((tenant.id, key.key.id))
        for _ in range(rows):
            tenant_id, key_id = rng.choice(owners)
            cost = 0 if rng.random() < free_share else rng.randint(1, 5000)
            await UsageService(session).record(
                UsageEvent(
                    request_id="req_" + uuid.uuid4().hex,
                    tenant_id=tenant_id,
                    api_key_id=key_id,
                    model="tollgate-tiny",
                    endpoint="chat.completions",
                    status=UsageStatus.COMPLETED,
                    prompt_tokens=rng.randint(1, 900),
                    completion_tokens=rng.randint(0, 300),
                    cost_micros=cost,
                )
            )
            spent[tenant_id] += cost
    return {tenant_id: cost for tenant_id, cost in spent.items() if cost}


def stripe_totals(engine: Engine, fake: FakeStripe) -> dict[str, int]:
    """The fake's totals per customer, keyed by our tenant ids."""
    with Session(engine) as session:
        rows = session.execute(select(StripeCustomer.customer_id, StripeCustomer.tenant_id))
        customers = {row.customer_id: row.tenant_id for row in rows}
    return {customers[c]: total for c, total in fake.customer_totals().items()}


def ledger_totals(engine: Engine) -> dict[str, int]:
    with Session(engine) as session:
        rows = session.execute(
            select(UsageEvent.tenant_id, func.sum(UsageEvent.cost_micros))
            .where(UsageEvent.cost_micros > 0)
            .group_by(UsageEvent.tenant_id)
        )
        return {tenant_id: int(total) for tenant_id, total in rows}


def outbox(engine: Engine) -> list[OutboxRow]:
    with Session(engine) as session:
        return list(session.scalars(select(OutboxRow).order_by(OutboxRow.id)))


def statuses(engine: Engine) -> Counter[str]:
    return Counter(row.status for row in outbox(engine))


def pending(engine: Engine) -> int:
    return statuses(engine)[OutboxStatus.PENDING]


def identifier_of(row: OutboxRow) -> str:
    return f"tg-usage-{row.usage_event_id}"
