"""The Celery worker's app, built from settings by its entry point (no broker needed)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.batches.tasks import RUN_TASK, SWEEP_TASK, CeleryBatches
from gateway.billing.worker import create_worker
from gateway.settings import Settings
from tenants.billing.export_lock import ExportBusy
from tenants.billing.relay import RelayResult
from tenants.billing.worker import WorkerConfig, create_celery, run_relay


def _settings(env: dict[str, str]) -> Settings:
    return replace(Settings.from_env(env), redis_url="redis://127.0.0.1:6379/0")


def test_the_worker_schedules_both_tasks_on_its_queue() -> None:
    settings = _settings({"TOLLGATE_EXPORT_INTERVAL_S": "7", "TOLLGATE_CELERY_QUEUE": "bill"})
    app = create_worker(settings)
    schedule = app.conf.beat_schedule
    assert schedule["stripe-relay"]["schedule"] == 7.0
    queues = {name: entry["options"]["queue"] for name, entry in schedule.items()}
    assert queues == {
        "stripe-relay": "bill",
        "daily-rollups": "bill",
        "batch-sweep": "bill-batches",
    }
    assert {"tollgate.billing.relay", "tollgate.billing.rollup"} <= set(app.tasks)
    assert app.tasks["tollgate.billing.relay"]() == {"exported": 0}  # Stripe is off


@pytest.mark.parametrize(
    ("env", "batches"),
    [
        ({"TOLLGATE_CELERY_QUEUE": "bill"}, "bill-batches"),
        ({"TOLLGATE_CELERY_BATCH_QUEUE": "b"}, "b"),
    ],
)
def test_batch_tasks_go_to_their_own_queue(env: dict[str, str], batches: str) -> None:
    """A batch run holds a worker slot for minutes: on the billing queue, the relay would
    wait behind it."""
    settings = _settings(env)
    app = create_worker(settings)
    routes = {name: app.amqp.router.route({}, name)["queue"].name for name in app.tasks}
    assert routes[RUN_TASK] == routes[SWEEP_TASK] == batches
    assert (
        routes["tollgate.billing.relay"]
        == routes["tollgate.billing.rollup"]
        == settings.celery_queue
    )
    sent: list[tuple[str, str]] = []
    gateway = CeleryBatches(settings)
    gateway.celery.send_task = lambda name, queue, **_: sent.append((name, queue))  # type: ignore[method-assign]
    gateway._send("batch_1")
    gateway._send(None)
    assert sent == [(RUN_TASK, batches), (SWEEP_TASK, batches)]


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


def test_each_app_runs_its_own_tasks() -> None:
    """Tasks made by a factory are not shared: a second app in one process (the tests, a
    worker that rebuilds its app) would otherwise run the first app's callables."""
    config = WorkerConfig("redis://127.0.0.1:6379/0", "bill", 30.0, "sqlite://")
    first = create_celery(config, lambda budget_s: RelayResult(exported=1))
    second = create_celery(config, lambda budget_s: RelayResult(exported=2))
    assert first.tasks["tollgate.billing.relay"]()["exported"] == 1
    assert second.tasks["tollgate.billing.relay"]()["exported"] == 2
