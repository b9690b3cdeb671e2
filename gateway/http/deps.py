"""Request dependencies shared by the admin API and the console (litestar-fullstack's way):
one database transaction per request, and what handlers read of the quota store."""

from __future__ import annotations

from collections.abc import AsyncIterator

from litestar.di import NamedDependency
from litestar.params import SkipValidation
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.dispatch.engine_client import EngineClient
from tenants.quota import QuotaStore, ScopeUsage, month_period, tenant_scope

# The engine client, None until the start attaches it. Litestar checks a dependency's
# value against its type, and a Protocol's union with None cannot be checked: skipped.
MaybeEngine = NamedDependency[SkipValidation[EngineClient | None]]


async def provide_db_session(
    sessions: NamedDependency[async_sessionmaker[AsyncSession]],
) -> AsyncIterator[AsyncSession]:
    """The request's session: committed when the handler returns, rolled back when it
    raises (a handler that must act after the commit may commit earlier itself). It takes
    no connection until first used, so a dependency that refuses the request holds none."""
    async with sessions() as session:
        try:
            yield session
        except Exception:
            await session.rollback()
            raise
        await session.commit()


async def month_usage(store: QuotaStore, tenant_id: str) -> tuple[str, ScopeUsage]:
    """A tenant's quota counters for this month, with the month's name."""
    period = month_period()
    return period, await store.usage(tenant_scope(tenant_id), period)
