"""`tollgate quota …`: the quota store's spend, rebuilt from the ledger on demand."""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict
from typing import Any

from gateway.admission.reconcile import Rebuilder, Rebuilt
from gateway.cli.support import command, group, period_flag
from gateway.settings import Settings
from tenants import db
from tenants.quota import open_quota_store


def add_commands(commands: Any) -> None:
    """Register the subcommands on the CLI's top-level subparsers."""
    quota = group(commands, "quota", "the quota store (TOLLGATE_REDIS_URL)")
    rebuild = command(
        quota,
        "rebuild",
        "set every tenant's and key's spent from the ledger (safe while gateways run)",
        _quota_rebuild,
    )
    period_flag(rebuild)


def _quota_rebuild(settings: Settings, args: argparse.Namespace) -> int:
    period = args.period.label if args.period else None
    rebuilt = asyncio.run(rebuild_now(settings, period))
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
