"""What one request is and what it used, as the ledger and telemetry see it.

A leaf: it imports no other gateway module, so the API layer, metering and telemetry
share these types without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

from backend import SamplingParams
from tenants.models import BATCH_ENDPOINT_PREFIX, UsageStatus, utcnow
from tenants.quota import Reservation
from tenants.services import Principal


@dataclass
class RequestUsage:
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
    delivered: int = 0  # completion tokens a stream has sent to the client so far
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
    """The identity of a request for the ledger, and the one owner of its priority."""

    request_id: str
    principal: Principal
    model: str
    endpoint: str
    reservation: Reservation | None = None  # released by settling, after the ledger write
    priority: int = 0  # the class it runs at, the plan's terms applied (0: most urgent)
    started_at: datetime = field(default_factory=utcnow)  # prices in force then apply
    # A LoRA adapter's base model: priced as it unless the book prices `model` itself.
    base_model: str | None = None
    # Its Idempotency-Key: the ledger bills a key once, so a rerun (the first answer lost
    # to a crash) is not billed again (tenants.billing.ledger).
    idempotency_key: str | None = None

    @property
    def batch(self) -> bool:
        """A line of a batch (the Batch API), priced at the batch price."""
        return self.endpoint.startswith(BATCH_ENDPOINT_PREFIX)


class Metered(Protocol):
    """A request under way as telemetry reads it (gateway.api.generation.Generation)."""

    @property
    def charge(self) -> Charge: ...

    @property
    def params(self) -> SamplingParams: ...

    @property
    def prompt(self) -> list[int]: ...

    @property
    def response_id(self) -> str: ...
