"""Helpers shared by the billing tests: tenants with keys, and ledger rows."""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tenants.models import KeyRole, UsageEvent, UsageStatus
from tenants.services import ApiKeyService, TenantService, UsageService

Sessions = async_sessionmaker[AsyncSession]
STATUSES = list(UsageStatus)


@dataclass(frozen=True)
class Owner:
    tenant_id: str
    name: str
    key_id: str
    secret: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secret}"}


async def owner(sessions: Sessions, name: str, role: KeyRole = KeyRole.TENANT) -> Owner:
    async with sessions.begin() as session:
        tenant = await TenantService(session).create(name)
        created = await ApiKeyService(session).create(tenant, "k", role)
    return Owner(tenant.id, tenant.name, created.key.id, created.secret)


async def ledger_rows(
    sessions: Sessions, who: Owner, moments: list[datetime], seed: int = 1
) -> list[UsageEvent]:
    """One row per moment, with random models, statuses, tokens and costs."""
    rng = random.Random(seed)
    rows = []
    async with sessions.begin() as session:
        for moment in moments:
            prompt = rng.randint(1, 2000)
            event = UsageEvent(
                request_id="req_" + uuid.uuid4().hex,
                tenant_id=who.tenant_id,
                api_key_id=who.key_id,
                model=rng.choice(["tiny", "small"]),
                endpoint="chat.completions",
                status=rng.choice(STATUSES),
                prompt_tokens=prompt,
                cached_tokens=rng.randint(0, prompt),
                completion_tokens=rng.randint(0, 500),
                cost_micros=rng.choice([0, rng.randint(1, 10_000)]),  # some free rows
                created_at=moment,
            )
            await UsageService(session).record(event)
            rows.append(event)
    return rows
