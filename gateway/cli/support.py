"""What every `tollgate` subcommand module shares: the audit actor, one transaction per
command, and amounts of money typed on the command line."""

from __future__ import annotations

import argparse
import asyncio
import getpass
from collections.abc import Awaitable, Callable
from decimal import Decimal, InvalidOperation
from typing import TypeVar

from sqlalchemy.ext.asyncio import AsyncSession

from gateway.settings import Settings
from tenants import db
from tenants.audit import Actor

T = TypeVar("T")


def actor() -> Actor:
    """The audit log's name for whoever runs the CLI."""
    try:
        return Actor(f"cli:{getpass.getuser()}")
    except (KeyError, OSError):  # no user name in this environment
        return Actor("cli:unknown")


def in_session(settings: Settings, work: Callable[[AsyncSession], Awaitable[T]]) -> T:
    """Run `work` in one transaction: committed when it returns, rolled back when it raises."""

    async def run() -> T:
        engine = db.create_engine(settings.database_url)
        try:
            async with db.session_factory(engine).begin() as session:
                return await work(session)
        finally:
            await engine.dispose()

    return asyncio.run(run())


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
