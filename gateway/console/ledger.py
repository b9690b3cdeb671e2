"""Console pages over money and accountability: the price book, billing (invoice preview
and Stripe export status) and the audit log with its chain verification. They call the
billing and audit services; nothing here prices or hashes anything itself."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from litestar import Controller, Response, get, post
from litestar.datastructures import FormMultiDict
from litestar.di import NamedDependency

from gateway.console.actions import micro_dollars
from gateway.console.context import ConsoleAction, ConsolePage
from gateway.console.pages import parse_moment
from gateway.console.render import csv_download, or_back_to
from tenants import audit
from tenants.billing.models import OutboxRow
from tenants.billing.outbox import OutboxService, export_status, unexported_rows
from tenants.billing.prices import ANY_MODEL, PriceService
from tenants.billing.reports import Period, build_report, export_csv
from tenants.errors import InvalidInputError
from tenants.models import as_utc, utcnow
from tenants.pricing import Price
from tenants.services import TenantService

AUDIT_PAGE = 100


def dollars_per_mtok(form: FormMultiDict, name: str) -> int:
    """A price in dollars per million tokens ("0.40") as integer micro-dollars."""
    return micro_dollars(str(form.get(name, "")).strip(), f"the {name.replace('_', ' ')} price")


def effective_from(raw: str) -> datetime:
    """When a new price starts: the given UTC time, or now when left blank."""
    if not raw:
        return utcnow()
    moment = parse_moment(raw)
    if moment is None:
        raise InvalidInputError(f"effective from must be a date and time, not {raw!r}")
    return moment


def price_from(form: FormMultiDict) -> Price:
    return Price(
        input_micros_per_mtok=dollars_per_mtok(form, "input"),
        cached_input_micros_per_mtok=dollars_per_mtok(form, "cached_input"),
        output_micros_per_mtok=dollars_per_mtok(form, "output"),
    )


class LedgerController(Controller):
    path = "/"

    @get("/prices")
    async def prices(self, ctx: NamedDependency[ConsolePage]) -> Response[str]:
        client = ctx.engine_client
        now = utcnow()
        versions = await PriceService(ctx.db).list()
        in_force: dict[str, str] = {}
        for version in versions:  # ordered by model, then effective date
            if as_utc(version.effective_from) <= now:
                in_force[version.model] = version.id
        return ctx.render(
            "prices.html",
            title="Prices",
            versions=versions,
            in_force=set(in_force.values()),
            any_model=ANY_MODEL,
            model=client.model_name if client else "",
        )

    @get("/billing")
    async def billing(self, ctx: NamedDependency[ConsolePage]) -> Response[str]:
        tenant_name, period = _tenant_and_period(ctx)
        report = status = None
        waiting: list[tuple[OutboxRow, str]] = []
        tenants = await TenantService(ctx.db).list()
        overall = await OutboxService(ctx.db).status()
        if tenant_name:
            tenant = await TenantService(ctx.db).get(tenant_name)
            report = await build_report(ctx.db, tenant, period)
            status = await export_status(ctx.db, tenant.id, period)
            waiting = await unexported_rows(ctx.db, tenant.id, period)
        return ctx.render(
            "billing.html",
            title="Billing",
            tenants=tenants,
            tenant_name=tenant_name,
            period=period,
            report=report.view() if report else None,
            apart=report.apart() if report else None,
            export=status,
            waiting=waiting,
            overall=overall,
            stripe_on=ctx.settings.stripe_api_key is not None,
        )

    @get("/billing.csv")
    async def billing_csv(self, ctx: NamedDependency[ConsolePage]) -> Response[str]:
        """The report's lines (day x model) as CSV; the export is audited."""
        tenant_name, period = _tenant_and_period(ctx)
        tenant = await TenantService(ctx.db).get(tenant_name)
        filename, text = await export_csv(ctx.db, ctx.actor, tenant, period)
        return csv_download(text, filename)

    @get("/audit")
    async def audit_log(self, ctx: NamedDependency[ConsolePage]) -> Response[str]:
        def text(name: str) -> str | None:
            return ctx.query(name) or None

        before = text("before")
        tenant = text("tenant")
        tenant_id = (await TenantService(ctx.db).get(tenant)).id if tenant else None
        events = await audit.list_events(
            ctx.db,
            tenant_id=tenant_id,
            action=text("action"),
            actor=text("actor"),
            since=parse_moment(text("since")),
            until=parse_moment(text("until")),
            before_id=int(before) if before and before.isdigit() else None,
            limit=AUDIT_PAGE,
        )
        tenants = await TenantService(ctx.db).list()
        filters = {k: v for k in ("tenant", "action", "actor", "since", "until") if (v := text(k))}
        return ctx.render(
            "audit.html",
            title="Audit log",
            events=events,
            tenants=tenants,
            filters=filters,
            older=events[-1].id if len(events) == AUDIT_PAGE else None,
        )

    @post("/prices")
    async def create_price(self, action: NamedDependency[ConsoleAction]) -> Response[Any]:
        model = action.field("model")
        with or_back_to("/admin/prices"):
            price = price_from(action.form)
            effective = effective_from(action.field("effective_from"))
            await PriceService(action.db, action.actor).create(model, price, effective)
        await action.db.commit()  # before the book is re-read
        action.prices.invalidate()  # this replica prices by it at once
        return action.back("/admin/prices", f"New price for {model} from {_when(effective)}.")

    @post("/billing/requeue")
    async def requeue_failed(self, action: NamedDependency[ConsoleAction]) -> Response[Any]:
        """Rows Stripe refused go back in the queue, once their cause is fixed (audited)."""
        count = await OutboxService(action.db, action.actor).requeue_failed()
        back = str(action.form.get("back", ""))
        here = back if back.startswith("/admin/billing") else "/admin/billing"
        return action.back(here, f"Requeued {count} refused row(s) for export.")

    @post("/audit/verify")
    async def verify_chain(self, viewer_action: NamedDependency[ConsoleAction]) -> Response[Any]:
        """Reading, not changing: viewers may verify too (the CSRF token is still checked)."""
        result = await audit.verify(viewer_action.db)
        return viewer_action.back("/admin/audit", result.describe(), "ok" if result.ok else "error")


def _tenant_and_period(ctx: ConsolePage) -> tuple[str, Period]:
    """The billing pages' tenant and period (this month unless given)."""
    period = ctx.query("period")
    return ctx.query("tenant"), Period.parse(period) if period else Period.current()


def _when(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%d %H:%M UTC")
