"""The gateway's side of batches in stack mode: it stores a batch and queues a Celery task
that runs it (gateway/batches/worker.py); the gateway itself runs no batch line. A task
lost on the way costs a few seconds, not the batch: beat's sweep queues one for every
unfinished batch (TOLLGATE_BATCH_SWEEP_S)."""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol, runtime_checkable

from celery import Celery

from gateway.settings import Settings

log = logging.getLogger(__name__)

RUN_TASK = "tollgate.batches.run"  # args: the batch's id
SWEEP_TASK = "tollgate.batches.sweep"  # no args: a run for every unfinished batch


@runtime_checkable  # Litestar checks a dependency against its type
class BatchWaker(Protocol):
    """Who runs batches, as the routes see it: told when a batch is created or cancelled."""

    def wake(self, batch_id: str | None = None) -> None: ...


def runs_in_celery(settings: Settings) -> bool:
    """Stack mode (Redis, Celery's broker, is set): Celery workers run batches."""
    return settings.redis_url is not None


class CeleryBatches:
    """Stands where the embedded BatchRunner stands (app.state.batch_runner): `wake` queues
    a run of the batch instead of running it here."""

    def __init__(self, settings: Settings) -> None:
        assert settings.redis_url is not None
        self.queue = settings.celery_batch_queue
        self.celery = Celery("tollgate", broker=settings.redis_url, set_as_current=False)
        self.celery.conf.update(broker_connection_retry_on_startup=True)
        self._sending: set[asyncio.Future[None]] = set()

    def start(self) -> None:
        pass  # the broker's connection opens at the first send

    def wake(self, batch_id: str | None = None) -> None:
        """Queue a run of `batch_id` (a sweep when None). A publish blocks, so it goes to a
        thread; a failure is logged: the sweep queues the batch's run later anyway."""
        sending = asyncio.get_running_loop().run_in_executor(None, self._send, batch_id)
        self._sending.add(sending)
        sending.add_done_callback(self._sent)

    def _send(self, batch_id: str | None) -> None:
        if batch_id is None:
            self.celery.send_task(SWEEP_TASK, queue=self.queue)
        else:
            self.celery.send_task(RUN_TASK, args=[batch_id], queue=self.queue)

    def _sent(self, sending: asyncio.Future[None]) -> None:
        self._sending.discard(sending)
        if not sending.cancelled() and sending.exception() is not None:
            log.warning("queueing a batch run failed: %r", sending.exception())

    async def close(self) -> None:
        if self._sending:
            await asyncio.wait(set(self._sending), timeout=5)
        self.celery.close()
