"""What every `tollgate` subcommand module shares: registering commands, the audit actor,
one transaction per command, removing what the gateways serve, listings, and amounts of
money typed on the command line."""

from __future__ import annotations

import argparse
import getpass
import json
from collections.abc import Awaitable, Callable
from decimal import Decimal, InvalidOperation
from typing import Any, Protocol, TypeVar

from sqlalchemy.ext.asyncio import AsyncSession

from gateway.settings import Settings
from tenants import db
from tenants.audit import Actor
from tenants.billing.reports import Period
from tenants.errors import InvalidInputError

T = TypeVar("T")


Handler = Callable[[Settings, argparse.Namespace], int]


def group(commands: Any, name: str, summary: str) -> Any:
    """`tollgate NAME …`: a command whose own commands are added to what it returns."""
    return commands.add_parser(name, help=summary).add_subparsers(required=True)


def command(commands: Any, name: str, summary: str, handler: Handler) -> argparse.ArgumentParser:
    """A command that runs `handler(settings, args)`; its flags go on what it returns."""
    parser: argparse.ArgumentParser = commands.add_parser(name, help=summary)
    parser.set_defaults(handler=handler)
    return parser


def period_flag(parser: argparse.ArgumentParser) -> None:
    """`--period YYYY-MM`, a calendar month in UTC read as a Period (None when left out:
    the command takes this month)."""
    parser.add_argument("--period", type=_period, help="YYYY-MM, UTC (default: this month)")


def _period(text: str) -> Period:
    try:
        return Period.parse(text)
    except InvalidInputError as exc:  # shown as a usage error
        raise argparse.ArgumentTypeError(str(exc)) from None


def actor() -> Actor:
    """The audit log's name for whoever runs the CLI."""
    try:
        return Actor(f"cli:{getpass.getuser()}")
    except (KeyError, OSError):  # no user name in this environment
        return Actor("cli:unknown")


def in_session(settings: Settings, work: Callable[[AsyncSession], Awaitable[T]]) -> T:
    """Run `work` in one transaction: committed when it returns, rolled back when it raises."""
    return db.run_once(settings.database_url, work)


def print_in_session(settings: Settings, work: Callable[[AsyncSession], Awaitable[str]]) -> int:
    """A command whose outcome is one message: run `work` as in_session does and print
    what it returns."""
    print(in_session(settings, work))
    return 0


class _Removes(Protocol):
    async def remove(self, name: str) -> None: ...


def remove_served(
    settings: Settings, service: Callable[[AsyncSession, Actor], _Removes], name: str
) -> int:
    """Remove a served model or adapter as the CLI's user (audited), and say when that
    takes effect: every gateway drops it at its next refresh of the registry."""
    in_session(settings, lambda session: service(session, actor()).remove(name))
    print(f"removed {name} (gateways stop serving it within a few seconds)")
    return 0


def print_views(
    views: list[dict[str, Any]], header: str, row: Callable[[dict[str, Any]], str], as_json: bool
) -> int:
    """A listing as JSON (`--json`), or as a tab-separated table under `header`."""
    print(json.dumps(views, indent=2) if as_json else "\n".join([header, *map(row, views)]))
    return 0


def micros(text: str, example: str, what: str) -> int:
    """An amount in currency units (`example`, e.g. '25.50') as integer micro-units;
    `what` names it in the error ('budget must be >= 0 ...')."""
    try:
        amount = Decimal(text) * 1_000_000
    except InvalidOperation:
        raise argparse.ArgumentTypeError(
            f"expected an amount like {example}, got {text!r}"
        ) from None
    if amount < 0 or amount != amount.to_integral_value():
        raise argparse.ArgumentTypeError(f"{what} must be >= 0 with at most 6 decimals")
    return int(amount)
