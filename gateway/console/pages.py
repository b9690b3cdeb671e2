"""Console pages (GET): overview, tenants, keys, plans, usage explorer, request detail."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta
from typing import Any

from litestar import Controller, MediaType, Response, get
from litestar.di import NamedDependency
from litestar.params import FromPath

from gateway.console.context import ConsolePage
from gateway.console.queries import (
    CSV_HEADER,
    CSV_LIMIT,
    csv_record,
    engine_time,
    inter_token_ms,
    rejections,
    replicas,
    tenant_series,
    traffic,
)
from gateway.console.render import csv_download
from gateway.http.deps import month_usage
from gateway.telemetry.request import workload_class
from tenants import audit
from tenants.admins import AdminService
from tenants.billing.ledger import (
    UsageFilter,
    batch_token_share,
    find_request,
    find_usage,
    known_models,
)
from tenants.billing.reports import Period, build_report
from tenants.limits import LIMIT_NAMES, PlanTerms
from tenants.models import UsageStatus, parse_utc
from tenants.quota import QuotaStore
from tenants.services import ApiKeyService, PlanService, TenantService, UsageService

RECENT_REQUESTS = 20
BATCH_SHARE_WINDOW = timedelta(hours=24)


def parse_moment(text: str | None) -> datetime | None:
    """A `datetime-local` field ("2026-11-29T14:05"), read as UTC; None if blank or bad."""
    if not text:
        return None
    try:
        return parse_utc(text)
    except ValueError:
        return None


def usage_filter(ctx: ConsolePage) -> UsageFilter:
    def text(name: str) -> str | None:
        return ctx.query(name) or None

    return UsageFilter(
        tenant=text("tenant"),
        key=text("key"),
        model=text("model"),
        status=text("status"),
        since=parse_moment(text("since")),
        until=parse_moment(text("until")),
    )


class PagesController(Controller):
    path = "/"

    @get("/")
    async def overview(self, ctx: NamedDependency[ConsolePage]) -> Response[str]:
        since = datetime.now(UTC) - BATCH_SHARE_WINDOW
        share = await batch_token_share(ctx.db, since)
        busy_s, batch_busy_s = engine_time(ctx.engine_client)
        return ctx.render(
            "overview.html",
            title="Overview",
            batch_share=share,
            busy_s=busy_s,
            batch_busy_s=batch_busy_s,
        )

    @get("/overview.json", media_type=MediaType.JSON)
    async def overview_data(self, ctx: NamedDependency[ConsolePage]) -> dict[str, Any]:
        data = await traffic(ctx.db)
        return {
            **data,
            "rejections": rejections(ctx.request.app.state.telemetry.metrics),
            "replicas": replicas(ctx.engine_client),
            "now": datetime.now(UTC).timestamp(),
        }

    @get("/tenants")
    async def tenants(self, ctx: NamedDependency[ConsolePage]) -> Response[str]:
        search = ctx.query("q").lower()
        plans = await PlanService(ctx.db).list()
        names = {plan.id: plan.name for plan in plans}
        tenants = [
            (tenant, names.get(tenant.plan_id or ""))
            for tenant in await TenantService(ctx.db).list()
            if search in tenant.name
        ]
        return ctx.render("tenants.html", title="Tenants", tenants=tenants, plans=plans, q=search)

    @get("/tenants/{name:str}")
    async def tenant(
        self,
        name: FromPath[str],
        quota_store: NamedDependency[QuotaStore],
        ctx: NamedDependency[ConsolePage],
    ) -> Response[str]:
        tenant = await TenantService(ctx.db).get(name)
        plans = await PlanService(ctx.db).list()
        plan = next((p for p in plans if p.id == tenant.plan_id), None)
        keys = [key for key, _ in await ApiKeyService(ctx.db).list(tenant)]
        recent = await UsageService(ctx.db).for_tenant(tenant.id, limit=20)
        series = await tenant_series(ctx.db, tenant.id)
        period, usage = await month_usage(quota_store, tenant.id)
        terms = PlanTerms.of(plan)
        budget = terms.limits.monthly_budget_micros
        left = None if budget is None else budget - usage.spent_micros - usage.reserved_micros
        return ctx.render(
            "tenant.html",
            title=f"Tenant {tenant.name}",
            tenant=tenant,
            plan=plan,
            plans=plans,
            terms=terms,
            limit_names=LIMIT_NAMES,
            keys=keys,
            recent=recent,
            series=series,
            period=period,
            usage=usage,
            budget=budget,
            budget_left=left,
        )

    @get("/keys")
    async def keys(self, ctx: NamedDependency[ConsolePage]) -> Response[str]:
        tenant_name = ctx.query("tenant")
        tenant = await TenantService(ctx.db).get(tenant_name) if tenant_name else None
        rows = await ApiKeyService(ctx.db).list(tenant)
        return ctx.render(
            "keys.html",
            title="API keys",
            keys=[key for key, _ in rows],
            key_tenants={key.id: name for key, name in rows},
            tenants=await TenantService(ctx.db).list(),
            tenant_name=tenant_name,
        )

    @get("/plans")
    async def plans(self, ctx: NamedDependency[ConsolePage]) -> Response[str]:
        plans = [(plan, PlanTerms.of(plan)) for plan in await PlanService(ctx.db).list()]
        return ctx.render("plans.html", title="Plans", plans=plans, limit_names=LIMIT_NAMES)

    @get("/usage")
    async def usage(self, ctx: NamedDependency[ConsolePage]) -> Response[str]:
        where = usage_filter(ctx)
        period, apart = Period.current(), None
        tenant = await TenantService(ctx.db).find(where.tenant) if where.tenant else None
        if tenant is not None:  # the month's usage report, batch spend apart
            apart = (await build_report(ctx.db, tenant, period)).apart()
        return ctx.render(
            "usage.html",
            title="Usage",
            rows=await find_usage(ctx.db, where),
            where=where,
            period=period,
            apart=apart,
            models=await known_models(ctx.db),
            tenants=await TenantService(ctx.db).list(),
            statuses=[status.value for status in UsageStatus],
        )

    @get("/usage.csv")
    async def usage_csv(self, ctx: NamedDependency[ConsolePage]) -> Response[str]:
        where = usage_filter(ctx)
        rows = await find_usage(ctx.db, where, limit=CSV_LIMIT)
        await audit.record(  # data leaving the system is accountable
            ctx.db,
            actor=ctx.actor.name,
            action="usage.export",
            target="usage",
            details={**where.as_query(), "rows": len(rows), "format": "csv"},
            context=ctx.actor.context,
        )
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(CSV_HEADER)
        writer.writerows(csv_record(row) for row in rows)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        return csv_download(out.getvalue(), f"usage-{stamp}.csv")

    @get("/admins")
    async def admins(self, ctx: NamedDependency[ConsolePage]) -> Response[str]:
        admins = await AdminService(ctx.db).list()
        return ctx.render("admins.html", title="Administrators", admins=admins)

    @get("/requests")
    async def request_search(self, ctx: NamedDependency[ConsolePage]) -> Response[str]:
        return await request_page(ctx, ctx.query("id"))

    @get("/requests/{request_id:str}")
    async def request_detail(
        self, request_id: FromPath[str], ctx: NamedDependency[ConsolePage]
    ) -> Response[str]:
        return await request_page(ctx, request_id)


async def request_page(ctx: ConsolePage, request_id: str) -> Response[str]:
    row, latest = None, []
    if request_id:
        row = await find_request(ctx.db, request_id)
    else:
        latest = await find_usage(ctx.db, UsageFilter(), limit=RECENT_REQUESTS)
    return ctx.render(
        "request.html",
        title=f"Request {request_id}" if request_id else "Request detail",
        request_id=request_id,
        row=row,
        latest=latest,
        itl=inter_token_ms(row.event) if row else None,
        workload=workload_class(row.event.endpoint, row.event.prompt_tokens) if row else None,
        status_code=404 if request_id and row is None else 200,
    )
