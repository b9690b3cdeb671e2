"""TOLLGATE_BACKENDS=dns://NAME:PORT: two real backends on loopback addresses 127.0.0.2 and
127.0.0.3 (one port, like pods behind a headless Service), a resolver the test controls;
replicas that appear join the routing and serve, replicas that vanish leave it, without a
restart; lookups that fail for a while keep the last answer."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import uvicorn

from backend import AsyncEngine, EngineConfig, SamplingParams
from backend.builtin import BUILTIN_MODEL_DIR
from backend.server import create_backend_app
from gateway.app import connect_engine
from gateway.dispatch import discovery
from gateway.dispatch.discovery import BackendDiscovery, DiscoveryError, apply, replica_url
from gateway.dispatch.engine_client import GenerateRequest
from gateway.dispatch.remote import RemoteEngineClient
from gateway.dispatch.routing import Replica
from gateway.settings import Settings
from tests.conftest import eventually

SECRET = "discovery-secret"
NAME = "backends.tollgate.test"
A, B = "127.0.0.2", "127.0.0.3"


class Resolver:
    """What NAME resolves to, as the test says; or the error a lookup raises."""

    def __init__(self, *addresses: str) -> None:
        self.addresses: list[str] = list(addresses)
        self.error: socket.gaierror | None = None
        self.lookups = 0

    async def __call__(self, host: str, port: int) -> Sequence[str]:
        assert host == NAME
        self.lookups += 1
        if self.error is not None:
            raise self.error
        return list(self.addresses)


@contextlib.asynccontextmanager
async def _backend(host: str, port: int) -> AsyncIterator[int]:
    engine = AsyncEngine.from_pretrained(BUILTIN_MODEL_DIR, EngineConfig(cpu_threads=1))
    app = create_backend_app(engine, BUILTIN_MODEL_DIR, SECRET)
    config = uvicorn.Config(app, host=host, port=port, lifespan="on", log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    await eventually(lambda: server.started or task.done(), timeout_s=60)
    assert server.started, f"backend on {host} did not start"
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await task


@pytest.fixture
async def two_backends() -> AsyncIterator[int]:
    """Two backends on one port, at two loopback addresses."""
    async with _backend(A, 0) as port, _backend(B, port):
        yield port


def _urls(client: RemoteEngineClient) -> list[str]:
    return [replica.url for replica in client.replicas]


async def _generate(client: RemoteEngineClient, request_id: str) -> None:
    params = SamplingParams(max_tokens=2, temperature=0)
    async for out in client.generate(GenerateRequest(list(range(3, 20)), params, request_id)):
        if out.finished:
            return


async def test_replicas_follow_the_name(two_backends: int, tmp_path: Path) -> None:
    port = two_backends
    resolver = Resolver(A)
    entry = f"dns://{NAME}:{port}"
    client = await discovery.connect([entry], SECRET, tmp_path, resolver, interval_s=0.05)
    try:
        assert _urls(client) == [f"http://{A}:{port}"]
        await _generate(client, "one")

        resolver.addresses = [A, B]  # a replica appears
        await eventually(lambda: len(client.replicas) == 2)
        assert _urls(client) == [f"http://{A}:{port}", f"http://{B}:{port}"]
        await eventually(lambda: all(r.healthy for r in client.replicas))

        resolver.addresses = [B]  # the first one vanishes
        await eventually(lambda: _urls(client) == [f"http://{B}:{port}"])
        for i in range(3):  # new work goes to the one that is left
            await _generate(client, f"after-{i}")

        before = resolver.lookups
        resolver.error = socket.gaierror(socket.EAI_AGAIN, "temporary failure")
        await eventually(lambda: resolver.lookups > before + 2)
        assert _urls(client) == [f"http://{B}:{port}"]  # kept through a resolver hiccup

        resolver.error = socket.gaierror(socket.EAI_NONAME, "no such name")
        await eventually(lambda: not client.replicas)  # no ready pod behind the name
        assert not client.is_ready()

        resolver.error = None
        resolver.addresses = [A]
        await eventually(lambda: client.is_ready())  # back, without a restart
        await _generate(client, "back")
    finally:
        await client.close()


async def test_a_gateway_follows_dns_from_settings(tmp_path: Path) -> None:
    """The settings path, with the system resolver: dns://localhost:PORT."""
    async with _backend("127.0.0.1", 0) as port:
        settings = Settings.from_env(
            {
                "TOLLGATE_BACKENDS": f"dns://localhost:{port}",
                "TOLLGATE_BACKEND_SECRET": SECRET,
                "TOLLGATE_DATA_DIR": str(tmp_path),
            }
        )
        client = await connect_engine(settings)
        try:
            assert isinstance(client, discovery.DiscoveringEngineClient)
            assert f"http://127.0.0.1:{port}" in _urls(client)  # and [::1] where it resolves
            assert client.is_ready()
            await _generate(client, "via-settings")
        finally:
            await client.close()


def test_static_urls_stay_as_they_are() -> None:
    found = BackendDiscovery(["http://a:9000", "http://b:9000"])
    assert found.static == ["http://a:9000", "http://b:9000"] and not found.dns


@pytest.mark.parametrize("bad", ["dns://no-port", "dns://:9000", "dns:///x:1"])
def test_bad_dns_entries_are_refused(bad: str) -> None:
    with pytest.raises(DiscoveryError, match="dns://NAME:PORT"):
        BackendDiscovery([bad])


def test_replica_urls_bracket_ipv6() -> None:
    assert replica_url("10.1.2.3", 9000) == "http://10.1.2.3:9000"
    assert replica_url("fd00::5", 9000) == "http://[fd00::5]:9000"


def test_apply_keeps_the_state_of_known_replicas() -> None:
    kept = Replica("http://a:1", in_flight=3, waiting=2)
    replicas = [kept, Replica("http://b:1")]
    assert apply(replicas, ["http://a:1", "http://c:1"])
    assert [r.url for r in replicas] == ["http://a:1", "http://c:1"]
    assert replicas[0] is kept and kept.in_flight == 3
    assert not apply(replicas, ["http://a:1", "http://c:1"])  # nothing changed
