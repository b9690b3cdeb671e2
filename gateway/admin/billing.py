"""Usage and billing routes.

/v1/usage is the calling tenant's own usage and spend (any API key; never another
tenant's: a request id of another tenant is simply not found). The admin routes under
/admin/api/billing and /admin/api/prices need an admin key, like the rest of /admin/api.
"""

from __future__ import annotations

import asyncio
from typing import Any

from litestar import Controller, Response, get, post, put
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath, FromQuery, RawBody
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.admin.controllers import admin_dependencies
from gateway.api.schemas import decode
from gateway.billing.schemas import CustomerBody, PriceBody, ResolveBody, period_of
from gateway.billing.stripe import export_once
from gateway.core.errors import Conflict, InvalidRequest, NotFound
from gateway.http.auth import authenticate
from gateway.openapi import ADMIN, ADMIN_WRITE, AUTHENTICATED, route, shaped
from gateway.openapi.shapes import (
    ExportRun,
    ExportStatus,
    PriceVersion,
    Report,
    Requeued,
    Resolved,
    StripeCustomer,
    TenantUsageReport,
    UsageRow,
)
from gateway.settings import Settings
from tenants.audit import Actor
from tenants.billing import ledger
from tenants.billing.customers import StripeCustomerService
from tenants.billing.export_lock import ExportBusy
from tenants.billing.models import PriceVersion as PriceRow
from tenants.billing.outbox import OutboxService
from tenants.billing.prices import PriceBook, PriceService
from tenants.billing.reports import build_report, export_csv
from tenants.models import UsageEvent, as_utc
from tenants.pricing import Price
from tenants.services import Principal, TenantService


def price_view(version: PriceRow) -> dict[str, Any]:
    return shaped(
        PriceVersion,
        version,
        effective_from=as_utc(version.effective_from).isoformat(),
        created_at=as_utc(version.created_at).isoformat(),
    )


def usage_row_view(event: UsageEvent) -> dict[str, Any]:
    """One ledger row as its tenant may see it (no internal error text, no key secret)."""
    return shaped(
        UsageRow,
        event,
        started_at=as_utc(event.started_at).isoformat() if event.started_at else None,
        created_at=as_utc(event.created_at).isoformat(),
    )


class UsageController(Controller):
    path = "/v1/usage"
    tags = ["Usage"]
    dependencies = {"principal": Provide(authenticate)}

    @route(get, "/", TenantUsageReport, errors=AUTHENTICATED)
    async def usage(
        self,
        db_session: NamedDependency[AsyncSession],
        principal: NamedDependency[Principal],
        period: FromQuery[str | None] = None,
    ) -> dict[str, Any]:
        """This tenant's usage and spend for a month (YYYY-MM, UTC; default: this one)."""
        tenant = await TenantService(db_session).get_by_id(principal.tenant_id)
        report = await build_report(db_session, tenant, period_of(period))
        return {"object": "usage", **report.view()}

    @route(get, "/requests/{request_id:str}", UsageRow, errors=(*AUTHENTICATED, 404))
    async def request_usage(
        self,
        request_id: FromPath[str],
        db_session: NamedDependency[AsyncSession],
        principal: NamedDependency[Principal],
    ) -> dict[str, Any]:
        event = None
        # Stored ids are short and printable (PostgreSQL text cannot even hold a NUL).
        if len(request_id) <= 64 and request_id.isprintable():
            event = await ledger.tenant_row(db_session, principal.tenant_id, request_id)
        if event is None:  # another tenant's request looks exactly like a missing one
            raise NotFound(f"no request {request_id!r}", param="request_id")
        return usage_row_view(event)


class BillingAdminController(Controller):
    path = "/admin/api"
    tags = ["Billing"]
    dependencies = admin_dependencies()

    @route(get, "/billing/reports/{tenant:str}/{period:str}", Report, errors=ADMIN)
    async def report(
        self,
        tenant: FromPath[str],
        period: FromPath[str],
        db_session: NamedDependency[AsyncSession],
        admin: NamedDependency[Principal],
    ) -> dict[str, Any]:
        found = await TenantService(db_session).get(tenant)
        return (await build_report(db_session, found, period_of(period))).view()

    @route(
        get,
        "/billing/reports/{tenant:str}/{period:str}/csv",
        str,
        media_type="text/csv",
        errors=ADMIN,
    )
    async def report_csv(
        self,
        tenant: FromPath[str],
        period: FromPath[str],
        db_session: NamedDependency[AsyncSession],
        actor: NamedDependency[Actor],
    ) -> Response[str]:
        """The report's lines as CSV; exporting billing data is audited."""
        found = await TenantService(db_session).get(tenant)
        filename, text = await export_csv(db_session, actor, found, period_of(period))
        return Response(
            text,
            media_type="text/csv; charset=utf-8",
            headers={"Content-Disposition": f'attachment; filename="{filename}"'},
        )

    @route(get, "/billing/customers/{tenant:str}", StripeCustomer, errors=ADMIN)
    async def stripe_customer(
        self,
        tenant: FromPath[str],
        db_session: NamedDependency[AsyncSession],
        admin: NamedDependency[Principal],
    ) -> dict[str, Any]:
        found = await TenantService(db_session).get(tenant)
        customer_id = await StripeCustomerService(db_session).find(found)
        return {"tenant": found.name, "customer_id": customer_id}

    @route(
        put,
        "/billing/customers/{tenant:str}",
        StripeCustomer,
        body=CustomerBody,
        errors=ADMIN_WRITE,
    )
    async def link_stripe_customer(
        self,
        tenant: FromPath[str],
        body: RawBody,
        db_session: NamedDependency[AsyncSession],
        actor: NamedDependency[Actor],
    ) -> dict[str, Any]:
        """Bill this tenant as an existing Stripe customer (audited)."""
        link = decode(body, CustomerBody)
        found = await TenantService(db_session).get(tenant)
        await StripeCustomerService(db_session, actor).link(found, link.customer_id)
        return {"tenant": found.name, "customer_id": link.customer_id}

    @route(get, "/prices", list[PriceVersion], errors=ADMIN)
    async def list_prices(
        self,
        db_session: NamedDependency[AsyncSession],
        admin: NamedDependency[Principal],
        model: FromQuery[str | None] = None,
    ) -> list[dict[str, Any]]:
        return [price_view(v) for v in await PriceService(db_session).list(model)]

    @route(post, "/prices", PriceVersion, body=PriceBody, status=201, errors=ADMIN_WRITE)
    async def create_price(
        self,
        body: RawBody,
        prices: NamedDependency[PriceBook],
        db_session: NamedDependency[AsyncSession],
        actor: NamedDependency[Actor],
    ) -> dict[str, Any]:
        price = decode(body, PriceBody)
        version = await PriceService(db_session, actor).create(
            price.model,
            Price(
                price.input_micros_per_mtok,
                price.cached_input_micros_per_mtok,
                price.output_micros_per_mtok,
                price.batch_discount_pct,
            ),
            price.effective(),
        )
        await db_session.commit()  # before the book is re-read
        prices.invalidate()  # this process sees it at once, others soon
        return price_view(version)

    @route(get, "/billing/export", ExportStatus, errors=ADMIN)
    async def export_status(
        self,
        settings: NamedDependency[Settings],
        db_session: NamedDependency[AsyncSession],
        admin: NamedDependency[Principal],
    ) -> dict[str, Any]:
        status = (await OutboxService(db_session).status()).view()
        return {"stripe": settings.stripe_api_key is not None, **status}

    @route(post, "/billing/export/requeue", Requeued, errors=ADMIN_WRITE)
    async def requeue(
        self, db_session: NamedDependency[AsyncSession], actor: NamedDependency[Actor]
    ) -> dict[str, Any]:
        """Put the rows Stripe rejected back in the queue (audited)."""
        return {"requeued": await OutboxService(db_session, actor).requeue_failed()}

    @route(post, "/billing/export/resolve", Resolved, body=ResolveBody, errors=ADMIN_WRITE)
    async def resolve(
        self,
        body: RawBody,
        db_session: NamedDependency[AsyncSession],
        actor: NamedDependency[Actor],
    ) -> dict[str, Any]:
        """Settle `unconfirmed` rows once they were checked in Stripe (audited)."""
        checked = decode(body, ResolveBody)
        service = OutboxService(db_session, actor)
        count = await service.resolve_unconfirmed(checked.in_stripe, checked.rows)
        return {"resolved": count, "in_stripe": checked.in_stripe}

    @route(post, "/billing/export", ExportRun, errors=ADMIN_WRITE)
    async def export(
        self,
        settings: NamedDependency[Settings],
        db_session: NamedDependency[AsyncSession],
        actor: NamedDependency[Actor],
    ) -> dict[str, Any]:
        """Run the Stripe relay once, now (it also runs on its schedule); 409 while
        another run holds the export lock."""
        if settings.stripe_api_key is None:
            raise InvalidRequest(
                "Stripe export is off: set TOLLGATE_STRIPE_API_KEY", code="stripe_disabled"
            )
        try:
            result = await asyncio.to_thread(export_once, settings)
        except ExportBusy as exc:
            raise Conflict(str(exc), code="export_running") from None
        assert result is not None  # Stripe is configured
        counts = await OutboxService(db_session, actor).record_export(result)
        return {**counts, "meter_error": result.meter_error}
