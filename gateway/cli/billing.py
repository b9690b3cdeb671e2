"""`tollgate billing …` and `tollgate prices …`: reports, Stripe export, the price book."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, date, datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from gateway.billing.stripe import export_once
from gateway.cli.support import (
    actor,
    command,
    group,
    in_session,
    micros,
    period_flag,
    print_in_session,
)
from gateway.settings import Settings
from tenants.billing.customers import StripeCustomerService
from tenants.billing.models import PriceVersion
from tenants.billing.outbox import OutboxService, TooOld
from tenants.billing.prices import PriceService
from tenants.billing.reports import Period, Report, build_report, format_micros
from tenants.billing.stripe_meters import event_identifier
from tenants.models import as_utc
from tenants.pricing import TOKENS_PER_UNIT, Price
from tenants.services import TenantService


def add_commands(commands: Any) -> None:
    """Register the subcommands on the CLI's top-level subparsers."""
    billing = group(commands, "billing", "usage reports and Stripe export")
    report = command(billing, "report", "a tenant's usage and spend for a month", _billing_report)
    report.add_argument("--tenant", required=True)
    period_flag(report)
    report.add_argument("--format", choices=("table", "json", "csv"), default="table")
    for name, summary, handler in (  # these take no arguments
        ("export", "send pending usage to Stripe now (TOLLGATE_STRIPE_API_KEY)", _billing_export),
        ("status", "outbox rows pending, exported and failed; the oldest pending", _billing_status),
        (
            "requeue",
            "send the rows Stripe rejected again (after fixing the cause)",
            _billing_requeue,
        ),
        (
            "unconfirmed",
            "rows maybe in Stripe past its dedup window: check these in Stripe",
            _billing_unconfirmed,
        ),
    ):
        command(billing, name, summary, handler)
    resolve = command(
        billing,
        "resolve",
        "settle the unconfirmed rows once you checked them in Stripe",
        _billing_resolve,
    )
    found = resolve.add_mutually_exclusive_group(required=True)
    found.add_argument("--in-stripe", action="store_true", help="they are there: mark exported")
    found.add_argument(
        "--not-in-stripe", action="store_true", help="they are not there: send them again"
    )
    resolve.add_argument(
        "--row", type=int, action="append", help="only this outbox row id (repeatable)"
    )
    command(
        billing,
        "too-old",
        "rows older than Stripe accepts (35 days), per tenant: bill them by hand",
        _billing_too_old,
    )
    customer = command(
        billing,
        "customer",
        "show, or --link, the Stripe customer a tenant is billed as",
        _billing_customer,
    )
    customer.add_argument("--tenant", required=True)
    customer.add_argument("--link", metavar="CUSTOMER_ID", help="an existing cus_… id")

    prices = group(commands, "prices", "the price book")
    command(prices, "list", "every price version", _prices_list).add_argument("--model")
    set_price = command(
        prices, "set", "add a price version (amounts per million tokens, e.g. 0.10)", _prices_set
    )
    set_price.add_argument("--model", required=True, help="model name, or '*' for every model")
    set_price.add_argument("--input", type=_per_mtok, required=True)
    set_price.add_argument("--cached-input", type=_per_mtok, required=True)
    set_price.add_argument("--output", type=_per_mtok, required=True)
    set_price.add_argument(
        "--effective", type=_day, help="YYYY-MM-DD, from midnight UTC (default: now)"
    )


def _per_mtok(text: str) -> int:
    """Currency units per million tokens ('0.10'), as integer micro-units."""
    return micros(text, "0.10", "a price")


def _day(text: str) -> datetime:
    try:
        return datetime.combine(date.fromisoformat(text), datetime.min.time(), tzinfo=UTC)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a date like 2026-12-01, got {text!r}") from None


def _billing_report(settings: Settings, args: argparse.Namespace) -> int:
    async def work(session: AsyncSession) -> Report:
        tenant = await TenantService(session).get(args.tenant)
        return await build_report(session, tenant, args.period or Period.current())

    report = in_session(settings, work)
    if args.format == "json":
        print(json.dumps(report.view(), indent=2))
    elif args.format == "csv":
        print(report.csv(), end="")
    else:
        print(_table(report))
    return 0


def _table(report: Report) -> str:
    header = ("MODEL", "REQUESTS", "INPUT", "CACHED INPUT", "OUTPUT", "AMOUNT")
    lines = [
        (model, t.requests, t.input_tokens, t.cached_input_tokens, t.output_tokens, t.cost_micros)
        for model, t in sorted(report.by_model.items())
    ]
    total = report.totals
    lines.append(
        (
            "TOTAL",
            total.requests,
            total.input_tokens,
            total.cached_input_tokens,
            total.output_tokens,
            total.cost_micros,
        )
    )
    rows = [header] + [(*line[:5], format_micros(line[5])) for line in lines]
    cells = [[str(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    title = f"tenant {report.tenant_name}, {report.period.label} (UTC), amounts in USD"
    body = [
        "  ".join(
            cell.rjust(w) if i else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in cells
    ]
    return "\n".join([title, *body])


def _billing_export(settings: Settings, args: argparse.Namespace) -> int:
    if settings.stripe_api_key is None:
        print("tollgate: Stripe export is off: set TOLLGATE_STRIPE_API_KEY", file=sys.stderr)
        return 2
    result = export_once(settings, budget_s=600.0)
    assert result is not None  # Stripe is configured

    async def work(session: AsyncSession) -> dict[str, int]:
        return await OutboxService(session, actor()).record_export(result)

    counts = in_session(settings, work)
    print(", ".join(f"{name}={value}" for name, value in counts.items()))
    if result.meter_error is not None:
        print(f"tollgate: nothing exported: {result.meter_error}", file=sys.stderr)
    return 0 if not (result.deferred or result.meter_error) else 1


def _billing_status(settings: Settings, args: argparse.Namespace) -> int:
    async def work(session: AsyncSession) -> dict[str, object]:
        return (await OutboxService(session).status()).view()

    status = in_session(settings, work)
    warnings = status.pop("warnings")
    print(
        "\n".join(
            f"{name}\t{value if value is not None else '-'}" for name, value in status.items()
        )
    )
    for warning in warnings if isinstance(warnings, list) else []:
        print(f"warning: {warning}", file=sys.stderr)
    if settings.stripe_api_key is None:
        print("Stripe export is off (TOLLGATE_STRIPE_API_KEY unset): rows wait", file=sys.stderr)
    return 0


def _billing_requeue(settings: Settings, args: argparse.Namespace) -> int:
    async def work(session: AsyncSession) -> int:
        return await OutboxService(session, actor()).requeue_failed()

    print(f"requeued {in_session(settings, work)} rows")
    return 0


def _billing_unconfirmed(settings: Settings, args: argparse.Namespace) -> int:
    async def work(session: AsyncSession) -> list[str]:
        return [
            "\t".join(
                [
                    str(row.id),
                    row.tenant_id,
                    event_identifier(row.usage_event_id),
                    format_micros(row.value),
                    as_utc(row.maybe_sent_at).isoformat() if row.maybe_sent_at else "-",
                ]
            )
            for row in await OutboxService(session).unconfirmed()
        ]

    print(
        "\n".join(
            ["ROW\tTENANT ID\tIDENTIFIER\tAMOUNT (USD)\tFIRST SENT", *in_session(settings, work)]
        )
    )
    return 0


def _billing_resolve(settings: Settings, args: argparse.Namespace) -> int:
    async def work(session: AsyncSession) -> int:
        service = OutboxService(session, actor())
        return await service.resolve_unconfirmed(in_stripe=args.in_stripe, rows=args.row)

    done = "marked exported" if args.in_stripe else "queued to send again"
    print(f"{in_session(settings, work)} unconfirmed rows {done}")
    return 0


def _billing_too_old(settings: Settings, args: argparse.Namespace) -> int:
    async def work(session: AsyncSession) -> list[TooOld]:
        return await OutboxService(session).too_old()

    rows = in_session(settings, work)
    lines = [f"{t.tenant}\t{t.rows}\t{format_micros(t.micros)}" for t in rows]
    print("\n".join(["TENANT\tROWS\tAMOUNT (USD)", *lines]))
    return 0


def _billing_customer(settings: Settings, args: argparse.Namespace) -> int:
    async def work(session: AsyncSession) -> str:
        tenant = await TenantService(session).get(args.tenant)
        service = StripeCustomerService(session, actor())
        if args.link is not None:
            await service.link(tenant, args.link)
        customer_id = await service.find(tenant)
        return f"{tenant.name}\t{customer_id or 'none yet (created on the first export)'}"

    return print_in_session(settings, work)


def _describe(version: PriceVersion) -> str:
    when = as_utc(version.effective_from).isoformat(timespec="seconds")
    per_mtok = [
        format_micros(value)
        for value in (
            version.input_micros_per_mtok,
            version.cached_input_micros_per_mtok,
            version.output_micros_per_mtok,
        )
    ]
    return "\t".join([version.model, when, *per_mtok, version.created_by or "-", version.id])


def _prices_list(settings: Settings, args: argparse.Namespace) -> int:
    async def work(session: AsyncSession) -> list[str]:
        return [_describe(v) for v in await PriceService(session).list(args.model)]

    header = "MODEL\tEFFECTIVE FROM\tINPUT/MTOK\tCACHED INPUT/MTOK\tOUTPUT/MTOK\tBY\tID"
    print("\n".join([header, *in_session(settings, work)]))
    return 0


def _prices_set(settings: Settings, args: argparse.Namespace) -> int:
    price = Price(args.input, args.cached_input, args.output)

    async def work(session: AsyncSession) -> str:
        effective = args.effective or datetime.now(UTC)
        return _describe(await PriceService(session, actor()).create(args.model, price, effective))

    print("added " + in_session(settings, work))
    print(f"(amounts per {TOKENS_PER_UNIT:,} tokens; gateways pick it up within 30 s)")
    return 0
