"""The price book: versions with effective dates; a request is priced by the version in
force when it started; changes are audited."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import AsyncTestClient
from sqlalchemy import select

from gateway.cli import commands as cli
from gateway.core.usage import Charge, RequestUsage
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.runtime import Runtime
from tenants import audit
from tenants.billing.models import PriceVersion
from tenants.billing.prices import ANY_MODEL, PriceService, quote
from tenants.errors import ConflictError, InvalidInputError
from tenants.limits import LimitSet, PlanTerms
from tenants.models import KeyRole, UsageEvent, utcnow
from tenants.pricing import DEFAULT_PRICE, Price
from tenants.services import ApiKeyService, PlanService, TenantService
from tests.integration.billing_support import Sessions, owner

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def version(model: str, effective: datetime, output: int) -> PriceVersion:
    return PriceVersion(
        id=str(uuid.uuid4()),
        model=model,
        input_micros_per_mtok=1,
        cached_input_micros_per_mtok=1,
        output_micros_per_mtok=output,
        effective_from=effective,
    )


def test_the_version_in_force_at_the_start_applies() -> None:
    book = [
        version(ANY_MODEL, T0, output=10),
        version("tiny", T0 + timedelta(days=10), output=20),
        version("tiny", T0 + timedelta(days=20), output=30),
    ]
    assert quote(book, "tiny", T0 - timedelta(seconds=1)).version_id is None
    assert quote(book, "tiny", T0 - timedelta(seconds=1)).price == DEFAULT_PRICE
    assert quote(book, "tiny", T0).price.output_micros_per_mtok == 10  # '*' until its own
    assert quote(book, "tiny", T0 + timedelta(days=10)).price.output_micros_per_mtok == 20
    assert quote(book, "tiny", T0 + timedelta(days=19)).price.output_micros_per_mtok == 20
    assert quote(book, "tiny", T0 + timedelta(days=25)).version_id == book[2].id
    assert quote(book, "other", T0 + timedelta(days=25)).version_id == book[0].id


async def test_versions_are_checked(sessions: Sessions) -> None:
    price = Price(100, 50, 400)
    async with sessions.begin() as session:
        service = PriceService(session)
        with pytest.raises(InvalidInputError, match="past"):
            await service.create("tiny", price, utcnow() - timedelta(days=1), "test")
        with pytest.raises(InvalidInputError, match="output"):
            await service.create("tiny", Price(1, 1, -1), utcnow(), "test")
        with pytest.raises(InvalidInputError, match="model"):
            await service.create("", price, utcnow(), "test")
        later = utcnow() + timedelta(days=1)
        await service.create("tiny", price, later, "test")
        with pytest.raises(ConflictError):
            await service.create("tiny", price, later, "test")


async def test_a_request_is_priced_by_the_version_in_force_when_it_started(
    client: AsyncTestClient[Litestar], sessions: Sessions
) -> None:
    acme = await owner(sessions, "acme")
    now = utcnow()
    async with sessions.begin() as session:
        service = PriceService(session)
        old = await service.create("tiny", Price(1_000_000, 0, 2_000_000), now, "test")
        new = await service.create(
            "tiny", Price(5_000_000, 0, 9_000_000), now + timedelta(hours=1), "test"
        )
        principal = await ApiKeyService(session).authenticate(acme.secret)
    assert principal is not None
    runtime: Runtime = client.app.state.runtime
    runtime.recorder.prices.invalidate()

    # Both settle now; one started before the change, one after it.
    for started, request_id in (
        (now + timedelta(minutes=59), "req_old"),
        (now + timedelta(hours=2), "req_new"),
    ):
        charge = Charge(request_id, principal, "tiny", "completions", started_at=started)
        await runtime.recorder.settle(
            charge, RequestUsage(prompt_tokens=1000, completion_tokens=500)
        )

    async with sessions() as session:
        rows = {
            row.request_id: row
            for row in await session.scalars(select(UsageEvent).where(UsageEvent.model == "tiny"))
        }
    assert rows["req_old"].price_version_id == old.id
    assert rows["req_old"].cost_micros == Price(1_000_000, 0, 2_000_000).cost_micros(1000, 0, 500)
    assert rows["req_new"].price_version_id == new.id
    assert rows["req_new"].cost_micros == Price(5_000_000, 0, 9_000_000).cost_micros(1000, 0, 500)


async def test_admin_api_sets_prices_that_new_requests_use_and_audits_them(
    client: AsyncTestClient[Any], sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    ops = await owner(sessions, "ops", KeyRole.ADMIN)
    model = engine_client.model_name
    body = {
        "model": model,
        "input_micros_per_mtok": 3_000_000,
        "cached_input_micros_per_mtok": 1_000_000,
        "output_micros_per_mtok": 7_000_000,
    }
    created = await client.post("/admin/api/prices", json=body, headers=ops.headers)
    assert created.status_code == 201, created.text
    version_id = created.json()["id"]
    listed = await client.get("/admin/api/prices", headers=ops.headers)
    assert [v["id"] for v in listed.json()] == [version_id]

    completion = await client.post(
        "/v1/completions",
        json={"model": model, "prompt": "The", "max_tokens": 3},
        headers=ops.headers,
    )
    usage = completion.json()["usage"]
    row = await client.get(
        f"/v1/usage/requests/{completion.headers['x-request-id']}", headers=ops.headers
    )
    assert row.json()["price_version_id"] == version_id
    assert row.json()["cost_micros"] == Price(3_000_000, 1_000_000, 7_000_000).cost_micros(
        usage["prompt_tokens"],
        usage["prompt_tokens_details"]["cached_tokens"],
        usage["completion_tokens"],
    )

    async with sessions() as session:
        events = await audit.list_events(session, action="price.create")
    assert len(events) == 1 and events[0].details["version_id"] == version_id
    assert events[0].actor.startswith("key:")

    past = {**body, "effective_from": "2020-01-01"}
    refused = await client.post("/admin/api/prices", json=past, headers=ops.headers)
    assert refused.status_code == 400
    negative = {**body, "output_micros_per_mtok": -1}
    refused = await client.post("/admin/api/prices", json=negative, headers=ops.headers)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "output_micros_per_mtok"


def test_cli_prices_set_and_list(
    database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TOLLGATE_DATABASE_URL", database_url)
    args = ["prices", "set", "--model", "tiny", "--input", "0.10", "--cached-input", "0.05"]
    assert cli.main([*args, "--output", "0.40", "--effective", "2031-01-01"]) == 0
    assert "tiny" in capsys.readouterr().out
    assert cli.main(["prices", "list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[1].split("\t")[:5] == [
        "tiny",
        "2031-01-01T00:00:00+00:00",
        "0.100000",
        "0.050000",
        "0.400000",
    ]
    assert cli.main([*args, "--output", "0.40", "--effective", "2020-01-01"]) == 2
    assert "past" in capsys.readouterr().err


async def test_admission_reserves_at_the_price_book_price(
    client: AsyncTestClient[Any], sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    """A budget that the built-in price would let a request through is enough to refuse it
    at the book's (much higher) price: the worst case is reserved at the real price."""
    model = engine_client.model_name
    async with sessions.begin() as session:
        await PlanService(session).create(
            "small", PlanTerms(limits=LimitSet(monthly_budget_micros=1_000_000))
        )
    acme = await owner(sessions, "acme")
    async with sessions.begin() as session:
        await TenantService(session).set_plan("acme", "small")
    body = {"model": model, "prompt": "The", "max_tokens": 16}
    allowed = await client.post("/v1/completions", json=body, headers=acme.headers)
    assert allowed.status_code == 200, allowed.text  # 16 tokens at $0.40/Mtok: fits

    async with sessions.begin() as session:
        await PriceService(session).create(
            model, Price(1_000_000, 1_000_000, 100_000_000_000), utcnow(), "test"
        )
    runtime: Runtime = client.app.state.runtime
    runtime.recorder.prices.invalidate()
    refused = await client.post("/v1/completions", json=body, headers=acme.headers)
    assert refused.status_code == 429  # 16 tokens at $100,000/Mtok: $1.60 > the $1 budget
    assert refused.json()["error"]["code"] == "insufficient_quota"
