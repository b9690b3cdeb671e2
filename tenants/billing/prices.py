"""The price book: prices per model, versioned by effective date.

A request is priced by the version in force when it started. Versions are few and change
rarely, so every process keeps them all in memory and re-reads them every `refresh_s`:
the hot path never queries per request. A version must take effect in the future (or
now), so a cache at most `refresh_s` old never prices a request by a superseded version
as long as new prices are set at least that long ahead.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tenants.audit import Audited
from tenants.billing.models import PriceVersion
from tenants.errors import ConflictError, InvalidInputError
from tenants.models import as_utc, utcnow
from tenants.pricing import DEFAULT_PRICE, Price

ANY_MODEL = "*"  # a version for every model that has none of its own
MAX_MICROS_PER_MTOK = 10**12  # a million currency units per million tokens: surely a typo
PAST_GRACE = timedelta(minutes=5)  # clock skew between the operator and the server


@dataclass(frozen=True)
class Quote:
    price: Price
    version_id: str | None  # None: the built-in default price


def price_of(version: PriceVersion) -> Price:
    return Price(
        version.input_micros_per_mtok,
        version.cached_input_micros_per_mtok,
        version.output_micros_per_mtok,
        version.batch_discount_pct,
    )


def quote(versions: Sequence[PriceVersion], model: str, moment: datetime) -> Quote:
    """The version in force for `model` at `moment`: the model's own latest version that had
    started by then, else the latest '*' version, else the built-in default."""
    return PriceIndex(versions).quote(model, moment)


class PriceIndex:
    """The versions by model, oldest first, each as its start and its quote: a quote is
    a walk back through one model's few versions, no ORM attribute read (a request asks
    twice: to reserve and to settle)."""

    def __init__(self, versions: Sequence[PriceVersion]) -> None:
        self._by_model: dict[str, list[tuple[datetime, Quote]]] = {}
        for version in sorted(versions, key=lambda v: as_utc(v.effective_from)):
            entry = (as_utc(version.effective_from), Quote(price_of(version), version.id))
            self._by_model.setdefault(version.model, []).append(entry)

    def quote(self, model: str, moment: datetime, base: str | None = None) -> Quote:
        """`base`: a LoRA adapter's base model, whose price the adapter pays unless the
        book has one for the adapter's own name."""
        names = (model, ANY_MODEL) if base is None else (model, base, ANY_MODEL)
        for name in names:
            for effective_from, in_force in reversed(self._by_model.get(name, ())):
                if effective_from <= moment:
                    return in_force
        return Quote(DEFAULT_PRICE, None)


class PriceService(Audited):
    async def list(self, model: str | None = None) -> list[PriceVersion]:
        query = select(PriceVersion).order_by(PriceVersion.model, PriceVersion.effective_from)
        if model is not None:
            query = query.where(PriceVersion.model == model)
        return list((await self.session.execute(query)).scalars())

    async def create(
        self, model: str, price: Price, effective_from: datetime, created_by: str | None = None
    ) -> PriceVersion:
        """Add a version, audited, by `created_by` (default: the actor). History is never
        rewritten: it may not take effect in the past."""
        _check(model, price)
        effective_from = as_utc(effective_from)
        if effective_from < utcnow() - PAST_GRACE:
            raise InvalidInputError(
                "a price version cannot take effect in the past (requests already priced)"
            )
        clash = await self.session.scalar(
            select(PriceVersion.id).where(
                PriceVersion.model == model, PriceVersion.effective_from == effective_from
            )
        )
        if clash is not None:
            raise ConflictError(f"{model!r} already has a price from {effective_from.isoformat()}")
        version = PriceVersion(
            model=model,
            input_micros_per_mtok=price.input_micros_per_mtok,
            cached_input_micros_per_mtok=price.cached_input_micros_per_mtok,
            output_micros_per_mtok=price.output_micros_per_mtok,
            batch_discount_pct=price.batch_discount_pct,
            effective_from=effective_from,
            created_by=created_by or self.actor.name[:100],
        )
        self.session.add(version)
        await self.session.flush()
        await self._audit(
            "price.create",
            f"price:{model}",
            None,
            version_id=version.id,
            effective_from=effective_from.isoformat(),
            input_micros_per_mtok=price.input_micros_per_mtok,
            cached_input_micros_per_mtok=price.cached_input_micros_per_mtok,
            output_micros_per_mtok=price.output_micros_per_mtok,
            batch_discount_pct=price.batch_discount_pct,
        )
        return version


def _check(model: str, price: Price) -> None:
    if not model or len(model) > 200:
        raise InvalidInputError("model must be 1-200 characters ('*' for every model)")
    for name, value in (
        ("input", price.input_micros_per_mtok),
        ("cached input", price.cached_input_micros_per_mtok),
        ("output", price.output_micros_per_mtok),
    ):
        if not 0 <= value <= MAX_MICROS_PER_MTOK:
            raise InvalidInputError(f"the {name} price must be between 0 and {MAX_MICROS_PER_MTOK}")
    if not 0 <= price.batch_discount_pct <= 100:
        raise InvalidInputError("the batch discount must be between 0 and 100 percent")


class PriceBook:
    """Quotes from an in-memory copy of the price book, re-read every `refresh_s`."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession], refresh_s: float = 30.0) -> None:
        self.sessions = sessions
        self.refresh_s = refresh_s
        self._index = PriceIndex([])
        self._loaded_at: float | None = None
        self._lock = asyncio.Lock()

    async def quote(self, model: str, moment: datetime, base: str | None = None) -> Quote:
        if self._stale():
            async with self._lock:
                if self._stale():  # another caller may have refreshed while we waited
                    await self.refresh()
        return self._index.quote(model, as_utc(moment), base)

    async def refresh(self) -> None:
        async with self.sessions() as session:
            self._index = PriceIndex(await PriceService(session).list())
        self._loaded_at = time.monotonic()

    def invalidate(self) -> None:
        """Re-read on the next quote (after this process changed the book)."""
        self._loaded_at = None

    def _stale(self) -> bool:
        return self._loaded_at is None or time.monotonic() - self._loaded_at >= self.refresh_s
