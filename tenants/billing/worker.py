"""Celery tasks of the stack mode: the Stripe relay and the daily rollups, on beat.

The app is built by its entry point, gateway/billing/worker.py (`celery -A
gateway.billing.worker`), from the TOLLGATE_* settings; this module takes plain values.
The relay task is `acks_late` and its effects are idempotent (rows are marked exported
only after Stripe took them; identifiers deduplicate a resend), so a redelivery after a
worker crash sends nothing twice. Runs never overlap: a task finding another run holding
the export lock (a long run with `-c 2`, a hand-run export) returns at once. A worker
relays once as it starts, then on beat.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery import Celery
from celery.signals import worker_ready

from tenants.billing.export import rollup_once
from tenants.billing.export_lock import ExportBusy
from tenants.billing.relay import RelayResult
from tenants.billing.rollups import ROLLUP_EVERY_S

RELAY_BUDGET_S = 60.0  # well inside the broker's visibility timeout


@dataclass(frozen=True)
class WorkerConfig:
    broker_url: str
    queue: str
    export_interval_s: float
    database_url: str  # the rollups'


Export = Callable[[float], RelayResult | None]  # one relay run within a budget; None: Stripe off


def create_celery(config: WorkerConfig, export: Export) -> Celery:
    celery = Celery("tollgate", broker=config.broker_url)
    celery.conf.update(
        task_default_queue=config.queue,
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        beat_schedule={
            "stripe-relay": {
                "task": "tollgate.billing.relay",
                "schedule": config.export_interval_s,
                "options": {"queue": config.queue, "expires": config.export_interval_s},
            },
            "daily-rollups": {
                "task": "tollgate.billing.rollup",
                "schedule": ROLLUP_EVERY_S,
                "options": {"queue": config.queue, "expires": ROLLUP_EVERY_S},
            },
        },
    )

    def relay_task() -> dict[str, int]:
        return run_relay(export)

    def rollup_task() -> int:
        return rollup_once(config.database_url)

    relay = celery.task(name="tollgate.billing.relay", acks_late=True, shared=False)(relay_task)
    celery.task(name="tollgate.billing.rollup", acks_late=True, shared=False)(rollup_task)

    def relay_at_start(sender: Any, **_: Any) -> None:
        # A worker that starts, or restarts after a crash, relays what is pending now
        # rather than one beat interval later (30 s by default). Several starting at once
        # cost nothing: a run finding the export lock held returns at once.
        if sender.app is celery:
            relay.apply_async(queue=config.queue, expires=config.export_interval_s)

    worker_ready.connect(relay_at_start, weak=False)
    return celery


def run_relay(export: Export) -> dict[str, int]:
    try:
        result = export(RELAY_BUDGET_S)
    except ExportBusy:
        return {"busy": 1}  # a run longer than the beat interval, or a hand-run export
    if result is None:
        return {"exported": 0}  # Stripe is off: the ledger alone is kept
    return result.counts()
