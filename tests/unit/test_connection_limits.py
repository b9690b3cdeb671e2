"""`tollgate serve`'s connection limits (gateway/cli/connections.py) on real sockets: uvicorn
configured as gateway_config configures it, on 127.0.0.1, in front of a small app."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import uvicorn

from gateway.cli.serve import gateway_config
from gateway.settings import Settings
from tests.conftest import eventually

BOUND_S = 10.0  # how long a test waits for an answer before it fails


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@contextlib.asynccontextmanager
async def gateway(**changes: Any) -> AsyncIterator[int]:
    """The port of a server with `tollgate serve`'s uvicorn options and these settings."""
    settings = replace(Settings.from_env({"TOLLGATE_PORT": "0"}), **changes)
    server = uvicorn.Server(gateway_config(_app, settings))
    task = asyncio.create_task(server.serve())
    await eventually(lambda: server.started or task.done())
    assert server.started
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await task


async def answer(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection (bounded)."""
    return await asyncio.wait_for(reader.read(), BOUND_S)


async def test_a_connection_whose_headers_are_late_is_answered_408_and_closed() -> None:
    """A slow-header socket (nothing sent; or half a request line) is closed once the
    header deadline passes, while a prompt request on another connection is served."""
    async with gateway(header_timeout_s=0.5) as port:
        silent = await asyncio.open_connection("127.0.0.1", port)
        slow = await asyncio.open_connection("127.0.0.1", port)
        slow[1].write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never the blank line
        prompt_reader, prompt_writer = await asyncio.open_connection("127.0.0.1", port)
        prompt_writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await answer(prompt_reader)).startswith(b"HTTP/1.1 200")
        for reader, writer in (silent, slow):
            assert (await answer(reader)).startswith(b"HTTP/1.1 408")
            writer.close()
        prompt_writer.close()


async def test_a_client_past_its_connection_cap_is_refused_until_one_closes() -> None:
    async with gateway(max_connections_per_client=3, header_timeout_s=60.0) as port:
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        refused = await answer(reader)
        writer.close()
        assert refused.startswith(b"HTTP/1.1 429")
        assert b'"code":"too_many_connections"' in refused and b"Retry-After: 1" in refused
        assert b"x-ratelimit-limit-connections: 3\r\n" in refused  # the limit that refused
        assert b"x-ratelimit-remaining-connections: 0\r\n" in refused
        held.pop()[1].close()

        async def admitted() -> bool:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            status = (await answer(reader))[:12]
            writer.close()
            return status == b"HTTP/1.1 200"

        await eventually(admitted, timeout_s=BOUND_S)  # once the server saw the close
        for _, held_writer in held:
            held_writer.close()


async def test_a_trusted_proxy_is_not_capped() -> None:
    """Behind a proxy every client arrives from its address: it is not one client."""
    async with gateway(max_connections_per_client=1, trusted_proxies=("127.0.0.1",)) as port:
        first = await asyncio.open_connection("127.0.0.1", port)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await answer(reader)).startswith(b"HTTP/1.1 200")
        writer.close()
        first[1].close()


def test_the_limits_are_settings() -> None:
    settings = Settings.from_env(
        {"TOLLGATE_HEADER_TIMEOUT_S": "5", "TOLLGATE_MAX_CONNECTIONS_PER_CLIENT": "32"}
    )
    assert (settings.header_timeout_s, settings.max_connections_per_client) == (5.0, 32)
    defaults = Settings.from_env({})
    assert (defaults.header_timeout_s, defaults.max_connections_per_client) == (10.0, 256)
