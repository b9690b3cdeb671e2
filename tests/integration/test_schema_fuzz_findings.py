"""What the schemathesis suite (test_schema_fuzz.py) found, each kept as a regression
test: integers past what a column holds were 500s on SQLite (OverflowError)."""

from __future__ import annotations

from typing import Any

import pytest
from litestar.testing import AsyncTestClient
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tenants.models import KeyRole
from tenants.services import ApiKeyService, TenantService

HUGE = 460352808163218882560  # past int64, as schemathesis sent it


async def _admin(sessions: async_sessionmaker[AsyncSession]) -> tuple[dict[str, str], str]:
    async with sessions.begin() as session:
        tenant = await TenantService(session).create("ops")
        created = await ApiKeyService(session).create(tenant, "root", KeyRole.ADMIN)
    return {"Authorization": f"Bearer {created.secret}"}, created.key.prefix


@pytest.mark.parametrize(
    "limits", [{"rpm": HUGE}, {"monthly_budget_micros": HUGE}, {"max_concurrent": 2**31}]
)
async def test_a_key_limit_past_its_column_is_a_400(
    client: AsyncTestClient[Any],
    sessions: async_sessionmaker[AsyncSession],
    limits: dict[str, int],
) -> None:
    admin, prefix = await _admin(sessions)
    response = await client.patch(f"/admin/api/keys/{prefix}/limits", json=limits, headers=admin)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == next(iter(limits))


async def test_a_plan_weight_past_its_column_is_a_400(
    client: AsyncTestClient[Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    admin, _ = await _admin(sessions)
    plan = {"name": "heavy", "weight": HUGE}
    response = await client.post("/admin/api/plans", json=plan, headers=admin)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "weight"


async def test_resolving_an_export_row_id_past_bigint_is_a_400(
    client: AsyncTestClient[Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    admin, _ = await _admin(sessions)
    body = {"in_stripe": True, "rows": [9999999999999999999]}
    response = await client.post("/admin/api/billing/export/resolve", json=body, headers=admin)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "rows[0]"
