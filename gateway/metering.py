"""Settlement: every finished request writes exactly one usage_events row (and, when it
costs something, its Stripe outbox row in the same transaction), priced by the price
book version in force when the request started.

Writes run as tracked tasks so a client disconnect (which cancels the request's task)
cannot interrupt them, and shutdown waits for them: nothing metered is lost.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.admission.quota import Admission
from gateway.admission.reconcile import to_us
from gateway.tasks import TaskSet
from gateway.telemetry.tracing import REQUEST_ID, in_span
from tenants.billing.prices import PriceBook
from tenants.models import UsageEvent, UsageStatus, utcnow
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
    last_token_ms: float | None = None  # since the start, when choice 0's last token came
    stream_tokens: int = 0  # choice 0's tokens, for the inter-token latency
    error: str | None = None
    trace_id: str | None = None
    replica: str | None = None  # the engine that served it: "in-process" or a replica URL

    @property
    def itl_ms(self) -> float | None:
        """Mean time between output tokens (of the first choice)."""
        if self.ttft_ms is None or self.last_token_ms is None or self.stream_tokens < 2:
            return None
        return (self.last_token_ms - self.ttft_ms) / (self.stream_tokens - 1)


@dataclass(frozen=True)
class Charge:
    """The identity of a request for the ledger."""

    request_id: str
    principal: Principal
    model: str
    endpoint: str
    reservation: Reservation | None = None  # released by settling, after the ledger write
    priority: int | None = None
    started_at: datetime = field(default_factory=utcnow)  # prices in force then apply


class UsageRecorder:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        prices: PriceBook,
        tasks: TaskSet,
        admission: Admission,
    ) -> None:
        self.sessions = sessions
        self.prices = prices
        self.tasks = tasks
        self.admission = admission

    def settle(self, charge: Charge, outcome: Outcome) -> asyncio.Task[None]:
        """Write the row for this outcome as it is now (later changes do not leak in)."""
        write = self._write(charge, replace(outcome))
        return self.tasks.spawn(in_span("settle", write, **{REQUEST_ID: charge.request_id}))

    async def _event(self, charge: Charge, outcome: Outcome) -> UsageEvent:
        quote = await self.prices.quote(charge.model, charge.started_at)
        # A request refused by the engine, or that failed on our side before sending
        # anything, costs the tenant nothing.
        free = outcome.status == UsageStatus.REJECTED or (
            outcome.status == UsageStatus.FAILED and outcome.completion_tokens == 0
        )
        cost = quote.price.cost_micros(
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
            itl_ms=outcome.itl_ms,
            priority=charge.priority,
            price_version_id=quote.version_id,
            error=outcome.error,
            trace_id=outcome.trace_id,
            replica=outcome.replica,
            started_at=charge.started_at,
            created_at=utcnow(),  # the row's time, which settling passes to the store
        )

    async def _write(self, charge: Charge, outcome: Outcome) -> None:
        """Ledger first, once; then quota counters from it: spent always matches the
        ledger (a crash in between leaves a row the reconciler charges later; a store
        outage, a settle the recorder retries until the store takes it)."""
        cost = tokens = 0
        at_us: int | None = None
        request_id = charge.request_id
        try:
            event = await self._event(charge, outcome)
            cost = event.cost_micros
            tokens = event.prompt_tokens + event.completion_tokens
            async with self.sessions.begin() as session:
                await UsageService(session).record(event)
            at_us = to_us(event.created_at)
        except Exception:
            # Never silently: the request id lets an operator reconcile by hand.
            log.exception("usage row %s not written", request_id)
            cost = 0  # not in the ledger, so not in spent either
            raise
        finally:
            if charge.reservation is not None:
                await self.admission.settle(charge.reservation, tokens, cost, at_us)
