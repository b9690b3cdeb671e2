"""The Celery worker's entry point for the stack mode (tasks: tenants/billing/worker.py,
and the batches' in gateway/batches/worker.py).

    celery -A gateway.billing.worker worker -Q tollgate      # TOLLGATE_CELERY_QUEUE
    celery -A gateway.billing.worker worker -Q tollgate-batches  # TOLLGATE_CELERY_BATCH_QUEUE
    celery -A gateway.billing.worker beat

Settings come from the TOLLGATE_* environment when Celery first looks up `app`, not at
import.
"""

from __future__ import annotations

from functools import cache, partial
from typing import Any

from celery import Celery

from gateway.batches.worker import register_batch_tasks
from gateway.billing.stripe import export_once
from gateway.settings import Settings
from tenants.billing.worker import WorkerConfig, create_celery


def create_worker(settings: Settings) -> Celery:
    """The worker's app; each relay run opens its own engine pool (a forked child too), and
    each worker process its batch tasks' runtime at their first run."""
    if settings.redis_url is None:
        raise RuntimeError("the Celery worker needs TOLLGATE_REDIS_URL (its broker)")
    config = WorkerConfig(
        broker_url=settings.redis_url,
        queue=settings.celery_queue,
        export_interval_s=float(settings.export_interval_s),
        database_url=settings.database_url,
    )
    celery = create_celery(config, partial(export_once, settings))
    register_batch_tasks(celery, settings)
    return celery


@cache
def _app() -> Celery:
    # The one object of the process Celery needs by name; everything else hangs off it.
    return create_worker(Settings.from_env())


def __getattr__(name: str) -> Any:
    # `celery -A gateway.billing.worker` looks up `app`: build it then, from the env.
    if name in ("app", "celery"):
        return _app()
    raise AttributeError(name)
