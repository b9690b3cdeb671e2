"""A real `tollgate serve` (embedded default: SQLite, no Redis) on a loopback port, for the
benchmarks that measure through the HTTP API: started in a fresh data folder with a new
admin key, ready when /readyz answers, with a first tenant's key and the model it serves,
and stopped when the block ends.

    async with httpx.AsyncClient(timeout=600) as http:
        async with serving(http, {"TOLLGATE_QUANTIZATION": "int8"}) as server:
            ... server.base, server.key, server.model, await server.tenant_key("plan")
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tenants import keys

STARTUP = re.compile(r"engine: [^\"\n]*")


def phase_options(
    doc: str, *, seconds: float, rate: float, rate_help: str, repeat: int = 2
) -> argparse.ArgumentParser:
    """The options of the open-loop benchmarks against a served gateway (fair_share,
    hostile_load, batch_fill): seconds per phase, the measured chats' rate, and how many
    times to measure; a script adds its own. `doc`: its docstring (the first paragraph
    is the help's description)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=seconds, help="per phase")
    parser.add_argument("--rate", type=float, default=rate, help=rate_help)
    parser.add_argument("--repeat", type=int, default=repeat)
    return parser


@dataclass
class Server:
    http: httpx.AsyncClient
    base: str
    admin: str
    model: str  # the first model /v1/models lists
    key: str  # a tenant of the default plan
    log: Path  # the server's stdout and stderr

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin}"}

    async def tenant_key(self, plan: str | None = None) -> str:
        """A new tenant, on `plan` (the default plan when None), and its key."""
        return await tenant_key(self.http, self.base, self.admin, plan)

    def startup_line(self) -> str:
        """The engine's start-up line (its KV and batch figures), from the log."""
        found = STARTUP.search(self.log.read_text())
        return found.group(0) if found else "(no start-up line in the log)"


@contextlib.asynccontextmanager
async def serving(
    http: httpx.AsyncClient, env: dict[str, str] | None = None, ready_timeout_s: float = 300
) -> AsyncIterator[Server]:
    """`tollgate serve` with the environment's settings over `env`, until the block ends."""
    admin, _ = keys.generate_key()
    port = 18000 + secrets.randbelow(2000)
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "serve.log"
        process = launch(Path(folder), admin, port, env or {}, log)
        try:
            await wait_ready(http, base, ready_timeout_s, process)
            listed = await http.get(
                f"{base}/v1/models", headers={"Authorization": f"Bearer {admin}"}
            )
            model = str(listed.json()["data"][0]["id"])
            key = await tenant_key(http, base, admin, None)
            # The client's own full collections (its imports, ~100 ms each) would be
            # measured as the server's latency: frozen, they walk only what it makes.
            gc.collect()
            gc.freeze()
            yield Server(http, base, admin, model, key, log)
        finally:
            process.terminate()
            process.wait(timeout=60)


def launch(
    folder: Path, admin: str, port: int, env: dict[str, str], log: Path
) -> subprocess.Popen[str]:
    full = {
        **os.environ,
        "TOLLGATE_DATA_DIR": str(folder),
        "TOLLGATE_DATABASE_URL": "",
        "TOLLGATE_REDIS_URL": "",
        "TOLLGATE_ADMIN_KEY": admin,
        "TOLLGATE_MAX_CONNECTIONS_PER_CLIENT": "2000",  # a benchmark's load is one host
        "PYTHONUNBUFFERED": "1",
        **env,
    }
    tollgate = str(Path(sys.executable).parent / "tollgate")
    with log.open("w") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            [tollgate, "serve", "--port", str(port)],
            env=full,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )


async def wait_ready(
    http: httpx.AsyncClient, base: str, timeout_s: float, process: subprocess.Popen[str]
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"tollgate serve exited with {process.returncode}")
        try:
            if (await http.get(f"{base}/readyz")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError("tollgate serve did not become ready")


async def tenant_key(http: httpx.AsyncClient, base: str, admin: str, plan: str | None) -> str:
    auth = {"Authorization": f"Bearer {admin}"}
    name = f"t-{secrets.token_hex(4)}"
    body: dict[str, Any] = {"name": name} | ({"plan": plan} if plan else {})
    (await http.post(f"{base}/admin/api/tenants", json=body, headers=auth)).raise_for_status()
    key = await http.post(f"{base}/admin/api/tenants/{name}/keys", json={}, headers=auth)
    return str(key.json()["key"])
