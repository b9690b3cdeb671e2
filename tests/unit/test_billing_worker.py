"""The Celery worker's app, built from settings by its entry point (no broker needed)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.billing.worker import create_worker
from gateway.settings import Settings
from tenants.billing.export_lock import ExportBusy
from tenants.billing.relay import RelayResult
from tenants.billing.worker import run_relay


def test_the_worker_schedules_both_tasks_on_its_queue() -> None:
    settings = replace(
        Settings.from_env({"TOLLGATE_EXPORT_INTERVAL_S": "7", "TOLLGATE_CELERY_QUEUE": "bill"}),
        redis_url="redis://127.0.0.1:6379/0",
    )
    app = create_worker(settings)
    schedule = app.conf.beat_schedule
    assert schedule["stripe-relay"]["schedule"] == 7.0
    assert {entry["options"]["queue"] for entry in schedule.values()} == {"bill"}
    assert {"tollgate.billing.relay", "tollgate.billing.rollup"} <= set(app.tasks)
    assert app.tasks["tollgate.billing.relay"]() == {"exported": 0}  # Stripe is off


def test_the_worker_needs_its_broker() -> None:
    with pytest.raises(RuntimeError, match="TOLLGATE_REDIS_URL"):
        create_worker(Settings.from_env({}))


def test_a_relay_run_reports_busy_and_counts() -> None:
    def busy(budget_s: float) -> RelayResult | None:
        raise ExportBusy()

    assert run_relay(busy) == {"busy": 1}
    assert run_relay(lambda budget_s: RelayResult(exported=3, deferred=1)) == {
        "exported": 3,
        "deferred": 1,
        "rejected": 0,
    }
