"""Request dependencies shared by the admin API and the console (litestar-fullstack's way):
one database transaction per request, and what handlers read of the quota store."""

from __future__ import annotations

from collections.abc import AsyncIterator

from litestar.di import NamedDependency, Provide
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.runtime import Runtime
from tenants.quota import QuotaStore, ScopeUsage, month_period, tenant_scope


async def provide_db_session(runtime: NamedDependency[Runtime]) -> AsyncIterator[AsyncSession]:
    """The request's session: committed when the handler returns, rolled back when it
    raises (a handler that must act after the commit may commit earlier itself). It takes
    no connection until first used, so a dependency that refuses the request holds none."""
    async with runtime.sessions() as session:
        try:
            yield session
        except Exception:
            await session.rollback()
            raise
        await session.commit()


def provide_quota_store(runtime: NamedDependency[Runtime]) -> QuotaStore:
    return runtime.admission.store


async def month_usage(store: QuotaStore, tenant_id: str) -> tuple[str, ScopeUsage]:
    """A tenant's quota counters for this month, with the month's name."""
    period = month_period()
    return period, await store.usage(tenant_scope(tenant_id), period)


REQUEST_DEPENDENCIES = {
    "db_session": Provide(provide_db_session),
    "quota_store": Provide(provide_quota_store, sync_to_thread=False),
}
