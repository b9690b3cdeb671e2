"""The quota store: atomic check-and-reserve of rate limits, concurrency and budgets.

`open_quota_store(redis_url)` picks the implementation: Redis (shared by gateway
replicas, one Lua script per operation) when a URL is given, else the in-process store
of the embedded default. Both keep the contract in `tenants.quota.contract`.
"""

from __future__ import annotations

from tenants.quota.contract import (
    CONCURRENCY_RETRY_HINT_S,
    KEY_SCOPE,
    Denied,
    DenyReason,
    Granted,
    Limits,
    QuotaError,
    QuotaStore,
    Reservation,
    ReservationIdError,
    ReserveRequest,
    Scope,
    ScopeUsage,
    SettleResult,
    SpendUnknownError,
    StoreUnavailableError,
    WindowStatus,
    binding,
    key_scope,
    month_period,
    tenant_scope,
    wall_us,
)
from tenants.quota.memory import MemoryQuotaStore
from tenants.quota.redis import RedisQuotaStore


def open_quota_store(
    redis_url: str | None, *, prefix: str | None = None, guarded: bool = False
) -> QuotaStore:
    """RedisQuotaStore on `redis_url` (its own pool, closed by aclose()), or a
    MemoryQuotaStore when no URL is configured. guarded: reserve() refuses a period
    whose spend has not been rebuilt from the ledger (the gateway's setting)."""
    if not redis_url:
        return MemoryQuotaStore(guarded=guarded)
    if prefix is None:
        return RedisQuotaStore.from_url(redis_url, guarded=guarded)
    return RedisQuotaStore.from_url(redis_url, prefix=prefix, guarded=guarded)


__all__ = [
    "CONCURRENCY_RETRY_HINT_S",
    "KEY_SCOPE",
    "Denied",
    "DenyReason",
    "Granted",
    "Limits",
    "MemoryQuotaStore",
    "QuotaError",
    "QuotaStore",
    "RedisQuotaStore",
    "Reservation",
    "ReservationIdError",
    "ReserveRequest",
    "Scope",
    "ScopeUsage",
    "SettleResult",
    "SpendUnknownError",
    "StoreUnavailableError",
    "WindowStatus",
    "binding",
    "key_scope",
    "month_period",
    "open_quota_store",
    "tenant_scope",
    "wall_us",
]
