"""Console pages (GET): overview, tenants, keys, plans, usage explorer, request detail."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime
from typing import Any

from litestar import Controller, MediaType, Request, Response, get
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.console.auth import Console, provide_console
from gateway.console.queries import (
    CSV_HEADER,
    CSV_LIMIT,
    UsageFilter,
    csv_record,
    find_request,
    find_usage,
    inter_token_ms,
    known_models,
    rejections,
    replicas,
    tenant_series,
    traffic,
)
from gateway.console.render import csv_download, page, query_text
from gateway.deps import month_usage
from gateway.runtime import Runtime
from gateway.telemetry.request import workload_class
from tenants import audit
from tenants.admins import AdminService
from tenants.limits import LIMIT_NAMES, PlanTerms
from tenants.models import UsageStatus, parse_utc
from tenants.quota import QuotaStore
from tenants.services import ApiKeyService, PlanService, TenantService, UsageService

RECENT_REQUESTS = 20


def parse_moment(text: str | None) -> datetime | None:
    """A `datetime-local` field ("2026-11-29T14:05"), read as UTC; None if blank or bad."""
    if not text:
        return None
    try:
        return parse_utc(text)
    except ValueError:
        return None


def usage_filter(request: Request[Any, Any, Any]) -> UsageFilter:
    def text(name: str) -> str | None:
        return query_text(request, name) or None

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
    dependencies = {"console": Provide(provide_console)}

    @get("/")
    async def overview(
        self, request: Request[Any, Any, Any], console: NamedDependency[Console]
    ) -> Response[str]:
        return page(request, console, "overview.html", title="Overview")

    @get("/overview.json", media_type=MediaType.JSON)
    async def overview_data(
        self,
        request: Request[Any, Any, Any],
        runtime: NamedDependency[Runtime],
        db_session: NamedDependency[AsyncSession],
        console: NamedDependency[Console],
    ) -> dict[str, Any]:
        data = await traffic(db_session)
        return {
            **data,
            "rejections": rejections(request.app.state.telemetry.metrics),
            "replicas": replicas(runtime.engine_client),
            "now": datetime.now(UTC).timestamp(),
        }

    @get("/tenants")
    async def tenants(
        self,
        request: Request[Any, Any, Any],
        db_session: NamedDependency[AsyncSession],
        console: NamedDependency[Console],
    ) -> Response[str]:
        search = query_text(request, "q").lower()
        plans = await PlanService(db_session).list()
        names = {plan.id: plan.name for plan in plans}
        tenants = [
            (tenant, names.get(tenant.plan_id or ""))
            for tenant in await TenantService(db_session).list()
            if search in tenant.name
        ]
        return page(
            request,
            console,
            "tenants.html",
            title="Tenants",
            tenants=tenants,
            plans=plans,
            q=search,
        )

    @get("/tenants/{name:str}")
    async def tenant(
        self,
        name: FromPath[str],
        request: Request[Any, Any, Any],
        db_session: NamedDependency[AsyncSession],
        quota_store: NamedDependency[QuotaStore],
        console: NamedDependency[Console],
    ) -> Response[str]:
        tenant = await TenantService(db_session).get(name)
        plans = await PlanService(db_session).list()
        plan = next((p for p in plans if p.id == tenant.plan_id), None)
        keys = [key for key, _ in await ApiKeyService(db_session).list(tenant)]
        recent = await UsageService(db_session).for_tenant(tenant.id, limit=20)
        series = await tenant_series(db_session, tenant.id)
        period, usage = await month_usage(quota_store, tenant.id)
        terms = PlanTerms.of(plan)
        budget = terms.limits.monthly_budget_micros
        left = None if budget is None else budget - usage.spent_micros - usage.reserved_micros
        return page(
            request,
            console,
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
    async def keys(
        self,
        request: Request[Any, Any, Any],
        db_session: NamedDependency[AsyncSession],
        console: NamedDependency[Console],
    ) -> Response[str]:
        tenant_name = query_text(request, "tenant")
        tenant = await TenantService(db_session).get(tenant_name) if tenant_name else None
        rows = await ApiKeyService(db_session).list(tenant)
        tenants = await TenantService(db_session).list()
        return page(
            request,
            console,
            "keys.html",
            title="API keys",
            keys=[key for key, _ in rows],
            key_tenants={key.id: name for key, name in rows},
            tenants=tenants,
            tenant_name=tenant_name,
        )

    @get("/plans")
    async def plans(
        self,
        request: Request[Any, Any, Any],
        db_session: NamedDependency[AsyncSession],
        console: NamedDependency[Console],
    ) -> Response[str]:
        plans = [(plan, PlanTerms.of(plan)) for plan in await PlanService(db_session).list()]
        return page(
            request, console, "plans.html", title="Plans", plans=plans, limit_names=LIMIT_NAMES
        )

    @get("/usage")
    async def usage(
        self,
        request: Request[Any, Any, Any],
        db_session: NamedDependency[AsyncSession],
        console: NamedDependency[Console],
    ) -> Response[str]:
        where = usage_filter(request)
        rows = await find_usage(db_session, where)
        models = await known_models(db_session)
        tenants = await TenantService(db_session).list()
        return page(
            request,
            console,
            "usage.html",
            title="Usage",
            rows=rows,
            where=where,
            models=models,
            tenants=tenants,
            statuses=[status.value for status in UsageStatus],
        )

    @get("/usage.csv")
    async def usage_csv(
        self,
        request: Request[Any, Any, Any],
        db_session: NamedDependency[AsyncSession],
        console: NamedDependency[Console],
    ) -> Response[str]:
        where = usage_filter(request)
        rows = await find_usage(db_session, where, limit=CSV_LIMIT)
        await audit.record(  # data leaving the system is accountable
            db_session,
            actor=console.actor.name,
            action="usage.export",
            target="usage",
            details={**where.as_query(), "rows": len(rows), "format": "csv"},
            context=console.actor.context,
        )
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(CSV_HEADER)
        writer.writerows(csv_record(row) for row in rows)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        return csv_download(out.getvalue(), f"usage-{stamp}.csv")

    @get("/admins")
    async def admins(
        self,
        request: Request[Any, Any, Any],
        db_session: NamedDependency[AsyncSession],
        console: NamedDependency[Console],
    ) -> Response[str]:
        admins = await AdminService(db_session).list()
        return page(request, console, "admins.html", title="Administrators", admins=admins)

    @get("/requests")
    async def request_search(
        self,
        request: Request[Any, Any, Any],
        db_session: NamedDependency[AsyncSession],
        console: NamedDependency[Console],
    ) -> Response[str]:
        request_id = query_text(request, "id")
        return await request_page(request, db_session, console, request_id)

    @get("/requests/{request_id:str}")
    async def request_detail(
        self,
        request_id: FromPath[str],
        request: Request[Any, Any, Any],
        db_session: NamedDependency[AsyncSession],
        console: NamedDependency[Console],
    ) -> Response[str]:
        return await request_page(request, db_session, console, request_id)


async def request_page(
    request: Request[Any, Any, Any], db_session: AsyncSession, console: Console, request_id: str
) -> Response[str]:
    row, latest = None, []
    if request_id:
        row = await find_request(db_session, request_id)
    else:
        latest = await find_usage(db_session, UsageFilter(), limit=RECENT_REQUESTS)
    return page(
        request,
        console,
        "request.html",
        title=f"Request {request_id}" if request_id else "Request detail",
        request_id=request_id,
        row=row,
        latest=latest,
        itl=inter_token_ms(row.event) if row else None,
        workload=workload_class(row.event.endpoint, row.event.prompt_tokens) if row else None,
        status_code=404 if request_id and row is None else 200,
    )
