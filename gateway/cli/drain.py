"""Graceful drain on SIGTERM, for gateways and backends alike.

The order Kubernetes needs: readiness goes false first (the pod leaves its Service and,
for a backend, the headless Service's DNS answer; gateways stop routing to it), new
requests get 503 (safe to retry elsewhere: nothing of them ran), in-flight requests and
streams finish within TOLLGATE_DRAIN_S, then uvicorn shuts down and the lifespan settles
what is left (usage rows, quota reservations, the engine).

`DrainGuard` wraps the ASGI app: it counts in-flight HTTP requests and turns new ones
away while draining. Probes, metrics and the paths listed as exempt pass untouched and
are not counted, so a scrape never holds a drain open. Requests still running when the
grace period is over see their client disconnect: they end through the same path as a
real disconnect (the engine request is aborted, the usage row says what was delivered),
with SETTLE_S to do it, before uvicorn shuts down.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Collection, MutableMapping
from types import FrameType
from typing import Any

import msgspec
import uvicorn

from gateway.core.errors import ApiError
from gateway.core.tasks import Interrupt

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[..., Awaitable[None]]  # Litestar types its scopes more narrowly

PROBES = frozenset({"/healthz", "/readyz", "/metrics"})
# After the grace period: how long cut requests get to settle, and then how long uvicorn
# waits for what is still open before it cancels it.
SETTLE_S = 5
DISCONNECT: Message = {"type": "http.disconnect"}


class Draining(ApiError):
    status = 503
    type = "server_error"
    default_code = "draining"


class Drain:
    """Whether this process is draining, and how many requests it still serves."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.in_flight = 0
        self.deadline: float | None = None  # set when the drain begins
        self.cut = False  # true once the grace period is over
        self.receiving: set[Interrupt] = set()  # of the tasks waiting for a client's message

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def begin(self) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + self.grace_s

    def over(self) -> bool:
        """Draining, and nothing is left in flight, or the grace period and the settling
        after it have run out. Cuts what is left once the grace period is over."""
        if self.deadline is None:
            return False
        if self.in_flight == 0:
            return True
        now = time.monotonic()
        if now >= self.deadline and not self.cut:
            log.warning("drain: grace period over, cutting %d requests", self.in_flight)
            self.cut = True
            for waiting in self.receiving:  # each wait ends as a disconnect (DrainGuard)
                waiting.fire()
        return now >= self.deadline + SETTLE_S


class DrainGuard:
    """ASGI middleware: counts requests in flight; while draining, answers new ones 503."""

    def __init__(self, app: ASGIApp, drain: Drain, exempt: Collection[str] = PROBES) -> None:
        self.app = app
        self.drain = drain
        self.exempt = frozenset(exempt)
        error = Draining("this server is shutting down; retry on another replica")
        self.refusal = msgspec.json.encode(error.body())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            await self._refuse(send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, self._until_cut(receive), send)
        finally:
            self.drain.in_flight -= 1

    def _until_cut(self, receive: Receive) -> Receive:
        """The client's messages, until the drain cuts the request: then a disconnect. A
        wait under way at the cut is cancelled by it: no task or race per receive."""
        drain = self.drain

        async def receive_or_disconnect() -> Message:
            if drain.cut:
                return DISCONNECT
            waiting = Interrupt()
            drain.receiving.add(waiting)
            try:
                return await receive()
            except asyncio.CancelledError:
                if waiting.ours():  # the cut
                    return DISCONNECT
                raise
            finally:
                drain.receiving.discard(waiting)

        return receive_or_disconnect

    async def _refuse(self, send: Send) -> None:
        headers = [
            (b"content-type", b"application/json"),
            (b"retry-after", b"1"),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": Draining.status, "headers": headers})
        await send({"type": "http.response.body", "body": self.refusal})


class DrainingServer(uvicorn.Server):
    """uvicorn, with SIGTERM (or a first Ctrl-C) starting a drain instead of a shutdown;
    the shutdown follows once the drain is over. A second signal shuts down at once."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain.draining or sig not in (signal.SIGTERM, signal.SIGINT):
            super().handle_exit(sig, frame)
            return
        self.drain.begin()
        log.info(
            "draining: not ready, refusing new requests; %d in flight, %.0f s to finish",
            self.drain.in_flight,
            self.drain.grace_s,
        )

    async def on_tick(self, counter: int) -> bool:
        if self.drain.over():
            if self.drain.in_flight:
                log.warning("drain: %d requests still open after settling", self.drain.in_flight)
            return True
        return await super().on_tick(counter)
