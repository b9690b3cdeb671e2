"""Billing bodies."""

from __future__ import annotations

from datetime import UTC, date, datetime
from typing import Annotated

from msgspec import Meta, Struct

from gateway.core.errors import InvalidRequest
from tenants.billing.reports import Period
from tenants.errors import InvalidInputError
from tenants.models import parse_utc, utcnow

MicrosPerMtok = Annotated[int, Meta(ge=0, le=10**12)]
RowId = Annotated[int, Meta(ge=1, le=2**63 - 1)]  # a BIGINT; SQLite refuses anything past it


class PriceBody(Struct, kw_only=True, forbid_unknown_fields=True):
    """Prices in integer micro-units per million tokens; `effective_from` an ISO date
    (midnight UTC) or date-time, now when left out."""

    model: Annotated[str, Meta(min_length=1, max_length=200)]
    input_micros_per_mtok: MicrosPerMtok
    cached_input_micros_per_mtok: MicrosPerMtok
    output_micros_per_mtok: MicrosPerMtok
    effective_from: str | None = None
    batch_discount_pct: Annotated[int, Meta(ge=0, le=100)] = 50  # off a batch line's price

    def effective(self) -> datetime:
        return utcnow() if self.effective_from is None else parse_moment(self.effective_from)


class CustomerBody(Struct, kw_only=True, forbid_unknown_fields=True):
    customer_id: Annotated[str, Meta(min_length=1, max_length=255)]


class ResolveBody(Struct, kw_only=True, forbid_unknown_fields=True):
    """Unconfirmed rows checked in Stripe: there (`in_stripe`) or not; all, or `rows`."""

    in_stripe: bool
    rows: list[RowId] | None = None


def parse_moment(text: str) -> datetime:
    """'2026-12-01' (midnight UTC) or an ISO date-time (UTC when it names no zone)."""
    try:
        if len(text) == 10:
            return datetime.combine(date.fromisoformat(text), datetime.min.time(), tzinfo=UTC)
        return parse_utc(text)
    except ValueError:
        raise InvalidRequest(
            f"expected a date like 2026-12-01 or an ISO date-time, got {text!r}",
            param="effective_from",
        ) from None


def period_of(text: str | None) -> Period:
    try:
        return Period.current() if text is None else Period.parse(text)
    except InvalidInputError as exc:
        raise InvalidRequest(str(exc), param="period") from None
