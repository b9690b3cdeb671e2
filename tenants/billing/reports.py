"""Billing reports from the ledger: totals by model and token type, a daily series, an
invoice preview, and CSV. Amounts are sums of the ledger's integer micro-units, so a
report always equals its rows.

The query reads (tenant_id, created_at) and the columns the PostgreSQL index includes:
a tenant's month comes from the index alone.
"""

from __future__ import annotations

import csv
import io
import re
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from tenants import audit
from tenants.audit import Actor
from tenants.billing import ledger
from tenants.errors import InvalidInputError
from tenants.models import Tenant, utcnow

_PERIOD = re.compile(r"^(\d{4})-(\d{2})$")


@dataclass(frozen=True)
class Period:
    """A calendar month in UTC: [start, end)."""

    label: str
    start: datetime
    end: datetime

    @classmethod
    def parse(cls, text: str) -> Period:
        match = _PERIOD.match(text)
        if match is None or not 1 <= int(match.group(2)) <= 12:
            raise InvalidInputError(f"period must look like 2026-11, got {text!r}")
        year, month = int(match.group(1)), int(match.group(2))
        try:
            start = datetime(year, month, 1, tzinfo=UTC)
            end = datetime(year + month // 12, month % 12 + 1, 1, tzinfo=UTC)
        except ValueError:  # year 0, or a month whose end is past year 9999
            raise InvalidInputError(f"period {text!r} is outside the calendar") from None
        return cls(text, start, end)

    @classmethod
    def current(cls, now: datetime | None = None) -> Period:
        return cls.parse((now or utcnow()).strftime("%Y-%m"))


@dataclass
class Totals:
    """Input tokens are the uncached part of the prompt; cached input is billed apart."""

    requests: int = 0
    input_tokens: int = 0
    cached_input_tokens: int = 0
    output_tokens: int = 0
    cost_micros: int = 0

    def add(self, other: Totals) -> None:
        self.requests += other.requests
        self.input_tokens += other.input_tokens
        self.cached_input_tokens += other.cached_input_tokens
        self.output_tokens += other.output_tokens
        self.cost_micros += other.cost_micros

    def minus(self, other: Totals) -> Totals:
        return Totals(
            requests=self.requests - other.requests,
            input_tokens=self.input_tokens - other.input_tokens,
            cached_input_tokens=self.cached_input_tokens - other.cached_input_tokens,
            output_tokens=self.output_tokens - other.output_tokens,
            cost_micros=self.cost_micros - other.cost_micros,
        )

    def view(self) -> dict[str, int]:
        return {
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "cached_input_tokens": self.cached_input_tokens,
            "output_tokens": self.output_tokens,
            "cost_micros": self.cost_micros,
        }


CSV_FIELDS = ("date", "model", *Totals().view())


@dataclass
class Report:
    tenant_id: str
    tenant_name: str
    period: Period
    totals: Totals = field(default_factory=Totals)
    by_model: dict[str, Totals] = field(default_factory=dict)
    by_status: dict[str, int] = field(default_factory=dict)
    by_day_model: dict[tuple[date, str], Totals] = field(default_factory=dict)
    batch: Totals = field(default_factory=Totals)  # of the totals: batch lines (Batch API)

    def apart(self) -> dict[str, Totals]:
        """The totals split: interactive requests and batch lines, for the console."""
        return {"interactive": self.totals.minus(self.batch), "batch": self.batch}

    def daily(self) -> list[tuple[date, Totals]]:
        days: dict[date, Totals] = defaultdict(Totals)
        for (day, _), totals in self.by_day_model.items():
            days[day].add(totals)
        return sorted(days.items())

    def view(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant_name,
            "period": self.period.label,
            "from": self.period.start.isoformat(),
            "to": self.period.end.isoformat(),
            "totals": self.totals.view(),
            "batch": self.batch.view(),
            "by_status": dict(sorted(self.by_status.items())),
            "by_model": [
                {"model": model, **totals.view()} for model, totals in sorted(self.by_model.items())
            ],
            "daily": [{"date": day.isoformat(), **totals.view()} for day, totals in self.daily()],
            "invoice_preview": self.invoice_preview(),
        }

    def invoice_preview(self) -> dict[str, Any]:
        """What the period's invoice will say: one line per model, amounts in micro-units
        and as a decimal string (never a float)."""
        lines = [
            {
                "description": f"{model}: {t.input_tokens} input, {t.cached_input_tokens} "
                f"cached input, {t.output_tokens} output tokens",
                "model": model,
                "amount_micros": t.cost_micros,
                "amount": format_micros(t.cost_micros),
            }
            for model, t in sorted(self.by_model.items())
            if t.cost_micros or t.requests
        ]
        return {
            "currency": "usd",
            "lines": lines,
            "total_micros": self.totals.cost_micros,
            "total": format_micros(self.totals.cost_micros),
        }

    def csv(self) -> str:
        """One line per day and model; the columns sum to the report's totals."""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(CSV_FIELDS)
        for (day, model), t in sorted(self.by_day_model.items()):
            writer.writerow([day.isoformat(), model, *t.view().values()])
        return out.getvalue()


def format_micros(micros: int) -> str:
    sign = "-" if micros < 0 else ""
    whole, fraction = divmod(abs(micros), 1_000_000)
    return f"{sign}{whole}.{fraction:06d}"


async def build_report(session: AsyncSession, tenant: Tenant, period: Period) -> Report:
    report = Report(tenant.id, tenant.name, period)
    for row in await ledger.tenant_days(session, tenant.id, period.start, period.end):
        totals = Totals(
            requests=int(row.requests),
            input_tokens=int(row.prompt) - int(row.cached),
            cached_input_tokens=int(row.cached),
            output_tokens=int(row.completion),
            cost_micros=int(row.cost),
        )
        on = row.day if isinstance(row.day, date) else date.fromisoformat(row.day)
        report.totals.add(totals)
        if row.batch:
            report.batch.add(totals)
        report.by_model.setdefault(row.model, Totals()).add(totals)
        report.by_day_model.setdefault((on, row.model), Totals()).add(totals)
        report.by_status[row.status] = report.by_status.get(row.status, 0) + totals.requests
    return report


async def export_csv(
    session: AsyncSession, actor: Actor, tenant: Tenant, period: Period
) -> tuple[str, str]:
    """The tenant's report for the period as CSV: (filename, text). Exporting billing data
    is audited, in the caller's transaction."""
    report = await build_report(session, tenant, period)
    await audit.record(
        session,
        actor=actor.name,
        action="billing.report.export",
        target=f"tenant:{tenant.name}",
        tenant_id=tenant.id,
        details={"period": period.label, "format": "csv"},
        context=actor.context,
    )
    return f"tollgate-{tenant.name}-{period.label}.csv", report.csv()
