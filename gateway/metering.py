"""Settlement: every finished request writes exactly one usage_events row.

Writes run as tracked tasks so a client disconnect (which cancels the request's task)
cannot interrupt them, and shutdown waits for them: nothing metered is lost.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.admission.quota import Admission
from gateway.tasks import TaskSet
from tenants.models import UsageEvent, UsageStatus
from tenants.pricing import Price
from tenants.quota import Reservation
from tenants.services import Principal, UsageService

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    """What one request consumed, filled in as it runs."""

    status: UsageStatus = UsageStatus.COMPLETED
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    queue_ms: float | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class Charge:
    """The identity of a request for the ledger."""

    request_id: str
    principal: Principal
    model: str
    endpoint: str
    reservation: Reservation | None = None  # released by settling, after the ledger write


class UsageRecorder:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        price: Price,
        tasks: TaskSet,
        admission: Admission,
    ) -> None:
        self.sessions = sessions
        self.price = price
        self.tasks = tasks
        self.admission = admission

    def settle(self, charge: Charge, outcome: Outcome) -> asyncio.Task[None]:
        """Write the row for this outcome as it is now (later changes do not leak in)."""
        return self.tasks.spawn(self._write(charge.reservation, self._event(charge, outcome)))

    def _event(self, charge: Charge, outcome: Outcome) -> UsageEvent:
        # A request that failed on our side before sending anything costs the tenant nothing.
        free = outcome.status == UsageStatus.FAILED and outcome.completion_tokens == 0
        cost = self.price.cost_micros(
            outcome.prompt_tokens, outcome.cached_tokens, outcome.completion_tokens
        )
        return UsageEvent(
            request_id=charge.request_id,
            tenant_id=charge.principal.tenant_id,
            api_key_id=charge.principal.key_id,
            model=charge.model,
            endpoint=charge.endpoint,
            status=outcome.status,
            finish_reason=outcome.finish_reason,
            prompt_tokens=outcome.prompt_tokens,
            cached_tokens=outcome.cached_tokens,
            completion_tokens=outcome.completion_tokens,
            cost_micros=0 if free else cost,
            queue_ms=outcome.queue_ms,
            ttft_ms=outcome.ttft_ms,
            e2e_ms=outcome.e2e_ms,
            error=outcome.error,
        )

    async def _write(self, reservation: Reservation | None, event: UsageEvent) -> None:
        """Ledger first, then quota counters: spent always matches the ledger (a crash in
        between leaves a row the reconciler charges later)."""
        cost = event.cost_micros
        tokens = event.prompt_tokens + event.completion_tokens
        try:
            async with self.sessions.begin() as session:
                await UsageService(session).record(event)
        except Exception:
            # Never silently: the request id lets an operator reconcile by hand.
            log.exception("usage row %s not written", event.request_id)
            cost = 0  # not in the ledger, so not in spent either
            raise
        finally:
            if reservation is not None:
                await self.admission.settle(reservation, tokens, cost)
