"""Backend replicas found by DNS: a `dns://NAME:PORT` entry in TOLLGATE_BACKENDS stands for
every address NAME resolves to (on Kubernetes, the backends' headless Service, whose
answer lists each ready pod), re-resolved every few seconds. Replicas that appear join
the routing; replicas that vanish leave it (requests already on them finish); no
restart. `http://` entries stay as they are.

A lookup that fails for a while (a resolver timeout) keeps the last answer; a name that
no longer exists (no ready pod at all) means no replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from gateway.core.errors import EngineUnavailable
from gateway.dispatch.remote import RemoteEngineClient
from gateway.dispatch.routing import Replica
from gateway.settings.errors import ConfigError

log = logging.getLogger(__name__)

DNS_SCHEME = "dns"
RESOLVE_EVERY_S = 5.0
FIRST_REPLICA_WAIT_S = 120.0  # at start, backends may still be loading their model
FIRST_REPLICA_RETRY_S = 2.0

# host, port -> the addresses it resolves to; raises socket.gaierror like getaddrinfo.
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]


class DiscoveryError(ConfigError):
    """A TOLLGATE_BACKENDS entry that cannot be used."""


async def system_resolver(host: str, port: int) -> list[str]:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def replica_url(address: str, port: int) -> str:
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return f"http://{host}:{port}"


class DnsEntry:
    """One `dns://NAME:PORT` entry and the replica URLs of its last answer."""

    def __init__(self, entry: str) -> None:
        parts = urlsplit(entry)
        if parts.scheme != DNS_SCHEME or not parts.hostname or parts.port is None:
            raise DiscoveryError(f"TOLLGATE_BACKENDS: {entry!r} is not dns://NAME:PORT")
        self.host, self.port = parts.hostname, parts.port
        self.urls: list[str] = []

    async def resolve(self, resolver: Resolver) -> list[str]:
        try:
            addresses = await resolver(self.host, self.port)
        except socket.gaierror as exc:
            if exc.errno != socket.EAI_NONAME:
                log.warning("resolving %s failed (%s); keeping %d replicas", self.host, exc,
                            len(self.urls))  # fmt: skip
                return self.urls
            addresses = []  # the name is gone: no ready replica behind it
        self.urls = [replica_url(address, self.port) for address in addresses]
        return self.urls


class BackendDiscovery:
    """TOLLGATE_BACKENDS, with its dns:// entries resolved to one URL per address."""

    def __init__(self, entries: Sequence[str], resolver: Resolver | None = None) -> None:
        self.static = [e for e in entries if not e.startswith(f"{DNS_SCHEME}://")]
        self.dns = [DnsEntry(e) for e in entries if e.startswith(f"{DNS_SCHEME}://")]
        self.resolver = resolver or system_resolver

    async def urls(self) -> list[str]:
        resolved = [await entry.resolve(self.resolver) for entry in self.dns]
        return list(dict.fromkeys([*self.static, *(url for urls in resolved for url in urls)]))


def apply(replicas: list[Replica], urls: Sequence[str]) -> bool:
    """Make `replicas` (in place) the replicas of `urls`: known ones keep their state,
    new ones are added, vanished ones removed. True when anything changed."""
    known = {replica.url: replica for replica in replicas}
    updated = [known.get(url) or Replica(url) for url in urls]
    if [r.url for r in updated] == [r.url for r in replicas]:
        return False
    joined = sorted(set(urls) - known.keys())
    left = sorted(known.keys() - set(urls))
    log.info("backend replicas: %d (joined %s, left %s)", len(updated), joined, left)
    replicas[:] = updated
    return True


class DiscoveringEngineClient(RemoteEngineClient):
    """A RemoteEngineClient whose replica set follows BackendDiscovery."""

    _discovery_task: asyncio.Task[None] | None = None

    def follow(self, discovery: BackendDiscovery, interval_s: float) -> None:
        loop = asyncio.get_running_loop()
        self._discovery_task = loop.create_task(self._rediscover(discovery, interval_s))

    async def _rediscover(self, discovery: BackendDiscovery, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)  # a resolution period, not synchronisation
            try:
                if apply(self.replicas, await discovery.urls()):
                    await self.refresh()  # newcomers get their health and load at once
            except Exception:
                log.exception("backend discovery failed; keeping the current replicas")

    async def close(self) -> None:
        if self._discovery_task is not None:
            self._discovery_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._discovery_task
        await super().close()


async def connect(
    entries: Sequence[str],
    secret: str,
    cache_dir: Path,
    resolver: Resolver | None = None,  # None: the system's (getaddrinfo)
    interval_s: float = RESOLVE_EVERY_S,
) -> RemoteEngineClient:
    """The engine client for TOLLGATE_BACKENDS. Static URLs only: a RemoteEngineClient as
    before. With dns:// entries: one that follows the name, after waiting (bounded) for a
    first replica to answer, since backends may start after the gateways."""
    discovery = BackendDiscovery(entries, resolver)
    if not discovery.dns:
        return await RemoteEngineClient.connect(entries, secret, cache_dir)
    give_up = time.monotonic() + FIRST_REPLICA_WAIT_S
    while True:
        urls = await discovery.urls()
        try:
            client = await DiscoveringEngineClient.connect(urls, secret, cache_dir)
            break
        except EngineUnavailable:
            if time.monotonic() > give_up:
                raise
            log.info("waiting for a backend replica behind %s", ", ".join(entries))
            await asyncio.sleep(FIRST_REPLICA_RETRY_S)  # a retry period, not synchronisation
    assert isinstance(client, DiscoveringEngineClient)
    client.follow(discovery, interval_s)
    return client
