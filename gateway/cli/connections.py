"""Connection limits uvicorn lacks, for `tollgate serve`: a deadline for each request's
headers, and a cap on one client's open connections.

uvicorn closes an idle keep-alive connection, but never one that opened and sends its
headers slowly or not at all: 200 such sockets were held for as long as their clients
liked. Here a request's headers must be complete within `header_timeout_s` of the
connection opening (or of the request's first byte, on a kept-alive connection), else
the connection is answered 408 and closed; and a client (its peer address; a trusted
proxy is not one client, so it is not capped) holding `max_per_client` connections has
its next one answered 429 and closed at once.

Built on uvicorn's httptools protocol (a dependency); without httptools, `tollgate serve`
runs uvicorn's defaults (gateway/cli/serve.py says so in the log).
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections import Counter
from typing import Any, ClassVar

import msgspec
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEADER_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"


def _refusal(status: bytes, message: str, code: str, headers: bytes = b"") -> bytes:
    """A whole HTTP/1.1 answer with an OpenAI-shaped error, for a connection closed before
    any request of it reached the app; `headers`: more header lines, each ending CRLF."""
    body = msgspec.json.encode(
        {"error": {"message": message, "type": "rate_limit_error", "param": None, "code": code}}
    )
    head = (
        b"HTTP/1.1 "
        + status
        + b"\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
        + headers
        + b"Connection: close\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
    )
    return head + body


def too_many(cap: int) -> bytes:
    """The refusal of a connection past `cap`, naming the limit that refused it."""
    limit = f"x-ratelimit-limit-connections: {cap}\r\nx-ratelimit-remaining-connections: 0\r\n"
    return _refusal(
        b"429 Too Many Requests",
        "too many open connections from this address",
        "too_many_connections",
        limit.encode(),
    )


class ClientConnections:
    """Open connections per client address, capped; proxies trusted to forward for many
    clients are not counted."""

    def __init__(self, cap: int, trusted_proxies: tuple[str, ...] = ()) -> None:
        self.cap = cap
        self.refusal = too_many(cap)
        self.open: Counter[str] = Counter()
        self._all_trusted = "*" in trusted_proxies
        self._trusted = [ipaddress.ip_network(p) for p in trusted_proxies if p != "*"]

    def admit(self, host: str) -> bool:
        """Count a new connection from `host`; False (not counted) past the cap."""
        if self._is_proxy(host):
            return True
        if self.open[host] >= self.cap:
            return False
        self.open[host] += 1
        return True

    def release(self, host: str) -> None:
        if self.open[host] > 1:
            self.open[host] -= 1
        else:
            self.open.pop(host, None)

    def _is_proxy(self, host: str) -> bool:
        if self._all_trusted:
            return True
        try:
            address = ipaddress.ip_address(host)
        except ValueError:  # a Unix socket's peer, or no address at all
            return True
        return any(address in network for network in self._trusted)


class GuardedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header deadline and a per-client cap (set on
    the subclass `guarded()` makes)."""

    header_timeout_s: ClassVar[float]
    clients: ClassVar[ClientConnections]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._counted: str | None = None  # the address this connection is counted under

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        host = self.client[0] if self.client else ""
        if not self.clients.admit(host):
            transport.write(self.clients.refusal)
            transport.close()
            return
        self._counted = host
        self._await_headers()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_deadline is None:  # a kept-alive connection's next request
            self._await_headers()

    def on_headers_complete(self) -> None:
        self._stop_waiting()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        if self._counted is not None:
            self.clients.release(self._counted)
            self._counted = None
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _stop_waiting(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_late(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._await_headers()  # a pipelined request behind an answer still going out
            return
        self.transport.write(HEADER_TIMEOUT)
        self.transport.close()


def guarded(
    header_timeout_s: float, max_per_client: int, trusted_proxies: tuple[str, ...]
) -> type[GuardedHttpTools]:
    """The protocol class one server uses: its own count of clients' connections."""
    clients = ClientConnections(max_per_client, trusted_proxies)
    attributes = {"header_timeout_s": header_timeout_s, "clients": clients}
    return type("GatewayHttpProtocol", (GuardedHttpTools,), attributes)
