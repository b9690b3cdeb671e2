"""GET /metrics on the gateway, in the Prometheus text format.

Access: with TOLLGATE_METRICS_TOKEN set, scrapers send `Authorization: Bearer <token>`;
without it, only loopback clients are answered (a laptop install, or a scraper sidecar).
Tenant budgets and reservations are read from the quota store at scrape time, for the
labelled (busiest) tenants only.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any

from litestar import Request, Response, get
from litestar.di import NamedDependency

from gateway.core.errors import AuthenticationFailed, PermissionDenied
from gateway.http.auth import bearer_token
from gateway.telemetry.request import Telemetry
from tenants.quota import QuotaStore, month_period, tenant_scope

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LOOPBACK = ("127.0.0.1", "::1")


@get("/metrics", include_in_schema=False)
async def metrics(
    request: Request[Any, Any, Any], quota_store: NamedDependency[QuotaStore]
) -> Response[bytes]:
    telemetry: Telemetry = request.app.state.telemetry
    _check_access(request, telemetry.metrics_token)
    await _refresh_tenant_gauges(telemetry, quota_store)
    # As a header: a text/* media_type would get a second charset appended by Litestar.
    return Response(telemetry.metrics.exposition(), headers={"content-type": CONTENT_TYPE})


def _check_access(request: Request[Any, Any, Any], token: str | None) -> None:
    if token is None:
        if request.client is None or request.client.host not in LOOPBACK:
            raise PermissionDenied("set TOLLGATE_METRICS_TOKEN to scrape /metrics remotely")
        return
    given = bearer_token(request) or ""
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise AuthenticationFailed("missing or wrong metrics token", code="invalid_metrics_token")


async def _refresh_tenant_gauges(telemetry: Telemetry, store: QuotaStore) -> None:
    tenants = list(telemetry.metrics.labelled_tenants())
    period = month_period()
    try:
        usages = await asyncio.gather(*(store.usage(tenant_scope(t), period) for t in tenants))
    except Exception:  # the quota store is away: serve the rest, gauges keep their last value
        log.warning("tenant gauges not refreshed", exc_info=True)
        return
    for tenant, usage in zip(tenants, usages, strict=True):
        telemetry.metrics.set_tenant_gauges(
            tenant,
            reserved=usage.reserved_micros,
            concurrent=usage.concurrent,
            spent=usage.spent_micros,
            limit=telemetry.budgets.get(tenant),
        )
