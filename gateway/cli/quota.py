"""`tollgate quota …`: the quota store's spend, rebuilt from the ledger on demand."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from dataclasses import asdict
from typing import Any

from gateway.admission.reconcile import Rebuilder, Rebuilt
from gateway.cli.support import command, group
from gateway.settings import Settings
from tenants import db
from tenants.quota import open_quota_store

_PERIOD = re.compile(r"^\d{4}-(0[1-9]|1[0-2])$")


def add_commands(commands: Any) -> None:
    """Register the subcommands on the CLI's top-level subparsers."""
    quota = group(commands, "quota", "the quota store (TOLLGATE_REDIS_URL)")
    rebuild = command(
        quota,
        "rebuild",
        "set every tenant's and key's spent from the ledger (safe while gateways run)",
        _quota_rebuild,
    )
    rebuild.add_argument("--period", type=_period, help="YYYY-MM, UTC (default: this month)")


def _period(text: str) -> str:
    if not _PERIOD.match(text):
        raise argparse.ArgumentTypeError(f"not a YYYY-MM month: {text!r}")
    return text


def _quota_rebuild(settings: Settings, args: argparse.Namespace) -> int:
    rebuilt = asyncio.run(rebuild_now(settings, args.period))
    print(json.dumps(asdict(rebuilt)))
    return 0 if rebuilt.ready else 1


async def rebuild_now(settings: Settings, period: str | None) -> Rebuilt:
    """One rebuild, as a running gateway would do it. Without a Redis URL the store is
    in-process: this only shows the figures (each gateway rebuilds its own at start)."""
    engine = db.create_engine(settings.database_url)
    store = open_quota_store(settings.redis_url)
    try:
        rebuilder = Rebuilder(
            db.session_factory(engine), store, settings.lease_s, settings.request_timeout_s + 30
        )
        return await rebuilder.ensure(period)
    finally:
        await store.aclose()
        await engine.dispose()
