"""Two admins adding the same name at once (found on a live gateway: six concurrent
POSTs of one tenant, plan, model or adapter gave one 201 and five 500s). The service's
check sees no row for both; the unique index refuses the second write, which answers the
409 the check gives when the two do not overlap. The overlap is made certain here by
blinding the check, on SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest
from litestar.testing import AsyncTestClient
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tenants.models import KeyRole
from tenants.services import ApiKeyService, PlanService, TenantService

Sessions = async_sessionmaker[AsyncSession]


async def _admin(sessions: Sessions) -> dict[str, str]:
    async with sessions.begin() as session:
        tenant = await TenantService(session).create("ops")
        secret = (await ApiKeyService(session).create(tenant, "root", KeyRole.ADMIN)).secret
    return {"Authorization": f"Bearer {secret}"}


@pytest.mark.parametrize(
    ("path", "service"), [("/admin/api/plans", PlanService), ("/admin/api/tenants", TenantService)]
)
async def test_a_name_taken_between_check_and_write_is_a_409(
    client: AsyncTestClient[Any],
    sessions: Sessions,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
    service: Any,
) -> None:
    admin = await _admin(sessions)
    first = await client.post(path, json={"name": "twin"}, headers=admin)
    assert first.status_code == 201, first.text

    async def sees_nothing(self: Any, name: str) -> None:
        return None  # as for the second of two requests that both checked first

    monkeypatch.setattr(service, "find", sees_nothing)
    second = await client.post(path, json={"name": "twin"}, headers=admin)
    assert second.status_code == 409, second.text
    assert second.json()["error"]["type"] == "conflict_error"
