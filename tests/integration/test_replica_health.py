"""A replica's health as the gateway's stats poll sees it, against a stats server on
loopback whose answers can be made late. A replica too busy to answer one poll in time
stays in routing; only MISSED_POLLS_TO_DOWN late answers in a row take it out (the
faults-under-load test saw a live replica dropped for one late poll while the other was
restarting: the gateway then refused everything). A refused connection or a stopped
engine takes it out at once."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from backend.builtin import BUILTIN_MODEL_DIR, BUILTIN_MODEL_NAME
from backend.tokenizer import Tokenizer
from gateway.dispatch.remote import HEALTH_TIMEOUT_S, RemoteEngineClient
from gateway.dispatch.routing import MISSED_POLLS_TO_DOWN, affinity_key, pick
from tests.e2e.processes import free_port


class StatsServer:
    """Answers GET /internal/stats after `delay_s`, saying the engine runs or not; notes
    the request ids POST /internal/abort names."""

    def __init__(self) -> None:
        self.delay_s = 0.0
        self.running = True
        self.aborted: list[str] = []
        self.extra: dict[str, Any] = {}  # more stats fields to answer with
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                time.sleep(server.delay_s)  # a replica too busy to answer sooner
                stats = {"running": server.running, "num_running": 1, **server.extra}
                body = json.dumps(stats).encode()
                with contextlib.suppress(OSError):  # the poll gave up: nobody reads it
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                server.aborted.append(json.loads(body)["request_id"])
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler

    @contextlib.contextmanager
    def serving(self) -> Iterator[StatsServer]:
        thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._server.shutdown()
            self._server.server_close()
            thread.join(timeout=5)


@contextlib.asynccontextmanager
async def client(url: str) -> AsyncIterator[RemoteEngineClient]:
    remote = RemoteEngineClient(
        [url], "s3cret", Tokenizer(BUILTIN_MODEL_DIR), BUILTIN_MODEL_NAME, 2048
    )
    try:
        yield remote
    finally:
        await remote.close()


@pytest.fixture
def stats() -> Iterator[StatsServer]:
    with StatsServer().serving() as server:
        yield server


async def test_a_slow_replica_leaves_only_after_late_polls_in_a_row(stats: StatsServer) -> None:
    async with client(stats.url) as remote:
        stats.delay_s = HEALTH_TIMEOUT_S + 0.5
        for _ in range(MISSED_POLLS_TO_DOWN - 1):
            await remote.refresh()
            assert remote.is_ready()
        stats.delay_s = 0.0  # one answer in time: the count starts again
        await remote.refresh()
        stats.delay_s = HEALTH_TIMEOUT_S + 0.5
        for _ in range(MISSED_POLLS_TO_DOWN - 1):
            await remote.refresh()
            assert remote.is_ready()
        await remote.refresh()
        assert not remote.is_ready()
        stats.delay_s = 0.0  # it answers again: back in routing
        await remote.refresh()
        assert remote.is_ready()


async def test_an_adapters_requests_route_to_the_replica_that_has_it_loaded() -> None:
    """The stats poll reads each replica's loaded and running LoRA adapters."""
    with StatsServer().serving() as one, StatsServer().serving() as two:
        two.extra = {"loaded_lora_adapters": ["ft-a"], "running_lora_adapters": ["ft-b"]}
        remote = RemoteEngineClient(
            [one.url, two.url], "s3cret", Tokenizer(BUILTIN_MODEL_DIR), BUILTIN_MODEL_NAME, 2048
        )
        try:
            await remote.refresh()
            first, second = remote.replicas
            assert first.adapters == frozenset()
            assert second.adapters == frozenset({"ft-a", "ft-b"})
            keys = [affinity_key("t", [i, 1, 2]) for i in range(50)]

            def routed(adapter: str | None) -> set[str]:
                return {r.url for k in keys if (r := pick(remote.replicas, k, adapter=adapter))}

            assert routed(None) == {one.url, two.url}  # by the prompt alone: both
            assert routed("ft-a") == routed("ft-b") == {two.url}
        finally:
            await remote.close()


async def test_a_stopped_engine_leaves_at_once(stats: StatsServer) -> None:
    async with client(stats.url) as remote:
        stats.running = False
        await remote.refresh()
        assert not remote.is_ready()


async def test_a_refused_connection_leaves_at_once() -> None:
    async with client(f"http://127.0.0.1:{free_port()}") as remote:  # nothing listens
        await remote.refresh()
        assert not remote.is_ready()


async def test_an_abort_is_sent_before_the_client_closes(stats: StatsServer) -> None:
    """abort() sends in the background; close() waits for it instead of closing the
    connection pool under it."""
    async with client(stats.url) as remote:
        remote._placements["req-1"] = remote.replicas[0]  # where generate() sent it
        remote.abort("req-1")
    assert stats.aborted == ["req-1"]


async def test_a_connection_not_taken_in_time_is_a_missed_poll() -> None:
    """A replica whose accept queue is full (too busy to take the connection) is late,
    not gone: one such poll keeps it in routing. A gateway under load took its only
    replica out for a connect timeout once, and answered its next request 503."""
    with socket.create_server(("127.0.0.1", 0), backlog=0) as listener:
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):  # fills the queue
            async with client(f"http://127.0.0.1:{port}") as remote:
                await remote.refresh()
                assert remote.is_ready()
                assert remote.replicas[0].missed_polls == 1
