"""Celery app for the stack mode: the Stripe relay and the daily rollups, on beat.

    celery -A tenants.billing.worker worker -Q tollgate      # TOLLGATE_CELERY_QUEUE
    celery -A tenants.billing.worker beat

Settings come from the TOLLGATE_* environment when the app is first used, not at import.
The relay task is `acks_late` and its effects are idempotent (rows are marked exported
only after Stripe took them; identifiers deduplicate a resend), so a redelivery after a
worker crash sends nothing twice. Runs never overlap: a task finding another run holding
the export lock (a long run with `-c 2`, a hand-run export) returns at once.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

from celery import Celery

from gateway.settings import Settings
from tenants.billing.export import export_once, rollup_once
from tenants.billing.export_lock import ExportBusy
from tenants.billing.rollups import ROLLUP_EVERY_S

log = logging.getLogger(__name__)

RELAY_BUDGET_S = 60.0  # well inside the broker's visibility timeout


@cache
def settings() -> Settings:
    return Settings.from_env()


def create_celery(config: Settings) -> Celery:
    if config.redis_url is None:
        raise RuntimeError("the Celery worker needs TOLLGATE_REDIS_URL (its broker)")
    celery = Celery("tollgate", broker=config.redis_url)
    celery.conf.update(
        task_default_queue=config.celery_queue,
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        beat_schedule={
            "stripe-relay": {
                "task": "tollgate.billing.relay",
                "schedule": float(config.export_interval_s),
                "options": {"queue": config.celery_queue, "expires": config.export_interval_s},
            },
            "daily-rollups": {
                "task": "tollgate.billing.rollup",
                "schedule": ROLLUP_EVERY_S,
                "options": {"queue": config.celery_queue, "expires": ROLLUP_EVERY_S},
            },
        },
    )
    celery.task(name="tollgate.billing.relay", acks_late=True)(relay)
    celery.task(name="tollgate.billing.rollup", acks_late=True)(rollup)
    return celery


def relay() -> dict[str, int]:
    try:
        result = export_once(settings(), RELAY_BUDGET_S)
    except ExportBusy:
        return {"busy": 1}  # a run longer than the beat interval, or a hand-run export
    if result is None:
        return {"exported": 0}  # Stripe is off: the ledger alone is kept
    return result.counts()


def rollup() -> int:
    return rollup_once(settings())


@cache
def _app() -> Celery:
    return create_celery(settings())


def __getattr__(name: str) -> Any:
    # `celery -A tenants.billing.worker` looks up `app`: build it then, from the env.
    if name in ("app", "celery"):
        return _app()
    raise AttributeError(name)
