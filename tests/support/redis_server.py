"""A redis-server of a test's own on a free loopback port, which it may stop, restart
(empty: nothing is kept on disk, as in many deployments) or cut connections to."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import AsyncIterator

from redis.asyncio import Redis

from tests.conftest import eventually
from tests.e2e.processes import free_port

REDIS_SERVER = shutil.which("redis-server") or "redis-server"
_EPHEMERAL = ["--save", "", "--appendonly", "no"]  # a restart comes back empty


class RedisServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._popen: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        self._popen = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", *_EPHEMERAL],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        await eventually(self._answers, timeout_s=10)

    async def _answers(self) -> bool:
        client = Redis.from_url(self.url, socket_connect_timeout=0.5)
        try:
            return bool(await client.ping())
        except OSError:
            return False
        except Exception:  # redis' ConnectionError while it starts
            return False
        finally:
            await client.aclose()

    def stop(self) -> None:
        if self._popen is not None and self._popen.poll() is None:
            self._popen.kill()
            self._popen.wait()

    async def restart(self) -> None:
        self.stop()
        await self.start()

    async def drop_connections(self) -> int:
        """CLIENT KILL every normal connection but this one: each pooled client sees a
        reset on its next command."""
        client = Redis.from_url(self.url)
        try:
            killed: int = await client.client_kill_filter(_type="normal", skipme=True)
            return killed
        finally:
            await client.aclose()


@contextlib.asynccontextmanager
async def redis_server() -> AsyncIterator[RedisServer]:
    server = RedisServer()
    await server.start()
    try:
        yield server
    finally:
        server.stop()
