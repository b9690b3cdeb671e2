"""A lean HTTP/1.1 client for the upstream calls on the request path: keep-alive
connections per origin on asyncio protocols, responses parsed by httptools (the C parser
uvicorn serves with), the body handed over as it arrives.

httpx costs more CPU per request than everything else the gateway does for it (its
stream setup goes through anyio, httpcore's pool and h11 every time: issue 19's profile),
and the gateway needs little of it: one POST at a time per connection, a streamed body
read line by line, or a small one read whole. Closing a response before its end closes
its connection, which is how an upstream learns that the client left (vLLM aborts then).

Errors are `TransportError` (the connection could not be made, or broke); a request that
fails on a kept-alive connection before any byte of its answer came (the server closed
it while it was idle) is sent once more on a new connection.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

from httptools import HttpParserError, HttpResponseParser

KEEP_IDLE_S = 4.0  # under uvicorn's (vLLM's) 5 s keep-alive: reuse before the server drops
MOST_IDLE = 64  # idle connections kept per origin
HIGH_WATER = 1 << 20  # buffered body bytes at which reading pauses until the reader catches up


class TransportError(Exception):
    """The upstream could not be reached, or the connection broke mid-answer."""


@dataclass(frozen=True)
class Origin:
    scheme: str
    host: str
    port: int

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        return self.host if self.port == default else f"{self.host}:{self.port}"


def split_url(url: str) -> tuple[Origin, str]:
    """The origin and the request target (path and query) of an http(s) URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Origin(parts.scheme, parts.hostname, port), target


class _Connection(asyncio.Protocol):
    """One connection; one request on it at a time. The parser's callbacks fill the
    response's head and body; the reader waits on `_wake`."""

    def __init__(self, origin: Origin) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.lost: BaseException | None = None
        self.idle_since = 0.0
        self._parser: HttpResponseParser | None = None  # while an answer is expected
        self._keep = False  # the last answer allows another request on this connection
        self._wake: asyncio.Future[None] | None = None
        self._paused = False
        self.received = False  # a byte of the current answer came
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_done = False
        self.complete = False
        self.pieces: deque[bytes] = deque()
        self.buffered = 0

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's are not asyncio.Transport subclasses).
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received = True
        if self._parser is None:  # bytes nobody asked for: the connection is unusable
            self._fail(TransportError("unexpected bytes from the upstream"))
            return
        try:
            self._parser.feed_data(data)
        except HttpParserError as exc:
            self._fail(TransportError(f"unreadable upstream answer: {exc}"))
            return
        if self.buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool | None:
        return None  # the transport closes itself; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or TransportError("the upstream closed the connection")
        if self.head_done and not self.complete and self._ends_at_close():
            self.complete = True  # neither a length nor chunks: the body ends with the connection
        self._notify()

    def _ends_at_close(self) -> bool:
        chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        return not chunked and "content-length" not in self.headers

    # -- httptools callbacks -------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        assert self._parser is not None
        self.status = self._parser.get_status_code()
        self.head_done = True
        self._notify()

    def on_body(self, body: bytes) -> None:
        self.pieces.append(body)
        self.buffered += len(body)
        self._notify()

    def on_message_complete(self) -> None:
        assert self._parser is not None
        self._keep = self._parser.should_keep_alive()
        self._parser = None  # whatever comes next unasked makes the connection unusable
        self.complete = True
        self._notify()

    # -- for the pool and the response ---------------------------------------------------

    @property
    def usable(self) -> bool:
        return self.lost is None and self.transport is not None and not self.transport.is_closing()

    def send(self, request: bytes) -> None:
        assert self.transport is not None
        self._parser = HttpResponseParser(self)
        self.received = self.head_done = self.complete = self._keep = False
        self.status, self.headers, self.buffered = 0, {}, 0
        self.pieces.clear()
        self.transport.write(request)

    def keep_alive(self) -> bool:
        return self._keep and self.usable

    async def wait(self) -> None:
        """Until the parser or the connection has news."""
        if self.lost is not None:
            raise TransportError(str(self.lost)) from self.lost
        self._wake = asyncio.get_running_loop().create_future()
        try:
            await self._wake
        finally:
            self._wake = None
        if self.lost is not None and not self.complete and not self.pieces:
            raise TransportError(str(self.lost)) from self.lost

    def take(self) -> bytes:
        """The body bytes that came so far."""
        data = b"".join(self.pieces)
        self.pieces.clear()
        self.buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _notify(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def _fail(self, error: TransportError) -> None:
        self.lost = error
        self.close()
        self._notify()


class Response:
    """An answer whose head has come; its body is read with `read()` or `lines()`.
    `close()` (always, `async with`) gives the connection back, or closes it when the
    body was not read to its end."""

    def __init__(self, pool: Http1Pool, connection: _Connection) -> None:
        self._pool = pool
        self._connection: _Connection | None = connection
        self.status_code = connection.status
        self.headers = connection.headers  # lower-case names

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *_: object) -> None:
        self.close()

    async def chunks(self) -> AsyncIterator[bytes]:
        connection = self._connection
        if connection is None:
            return
        while True:
            if connection.pieces:
                yield connection.take()
                continue
            if connection.complete:
                return
            await connection.wait()

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.chunks()])

    async def lines(self) -> AsyncIterator[bytes]:
        """The body split at newlines (each without its line ending); what follows the
        last newline comes last."""
        async for batch in self.line_batches():
            for line in batch:
                yield line

    async def line_batches(self) -> AsyncIterator[list[bytes]]:
        """lines(), a list at a time: the lines each read from the connection completed."""
        rest = b""
        async for piece in self.chunks():
            *complete, rest = (rest + piece).split(b"\n")
            if complete:
                yield [line.removesuffix(b"\r") for line in complete]
        if rest:
            yield [rest.removesuffix(b"\r")]

    def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        if connection.complete and not connection.pieces and connection.keep_alive():
            self._pool.release(connection)
        else:  # unread body (the caller stopped, or it is a long stream): not reusable
            self._pool.forget(connection)
            connection.close()


class Http1Pool:
    """Keep-alive connections per origin, with headers sent on every request."""

    def __init__(
        self,
        headers: dict[str, str] | None = None,
        connect_timeout_s: float = 2.0,
        keep_idle_s: float = KEEP_IDLE_S,
        most_idle: int = MOST_IDLE,
    ) -> None:
        self.headers = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.connect_timeout_s = connect_timeout_s
        self.keep_idle_s = keep_idle_s
        self.most_idle = most_idle
        self._idle: dict[Origin, list[_Connection]] = {}
        self._busy: set[_Connection] = set()
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    async def request(
        self, method: str, url: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> Response:
        """Send a request and wait for its answer's head."""
        origin, target = split_url(url)
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        head = (
            f"{method} {target} HTTP/1.1\r\nHost: {origin.host_header}\r\n{self.headers}{extra}"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        message = head.encode("latin-1") + body
        connection = self._reusable(origin)
        if connection is not None:
            try:
                return await self._exchange(connection, message)
            except TransportError:
                if connection.received:  # the server did answer: do not send it twice
                    raise
                # The server closed it while idle, before reading this: once more, anew.
        return await self._exchange(await self._connect(origin), message)

    async def _exchange(self, connection: _Connection, message: bytes) -> Response:
        self._busy.add(connection)
        try:
            connection.send(message)
            while not connection.head_done:
                await connection.wait()
        except BaseException:
            self._busy.discard(connection)
            connection.close()
            raise
        return Response(self, connection)

    def _reusable(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        stale_before = time.monotonic() - self.keep_idle_s
        while idle:
            connection = idle.pop()
            if connection.usable and connection.idle_since > stale_before:
                return connection
            connection.close()
        return None

    async def _connect(self, origin: Origin) -> _Connection:
        if self._closed:
            raise TransportError("the client is closed")
        loop = asyncio.get_running_loop()
        secure = origin.scheme == "https"
        if secure and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Connection(origin),
                    origin.host,
                    origin.port,
                    ssl=self._ssl if secure else None,
                ),
                self.connect_timeout_s,
            )
        except (OSError, TimeoutError) as exc:
            raise TransportError(f"cannot connect to {origin.host}:{origin.port}: {exc}") from exc
        return connection

    def release(self, connection: _Connection) -> None:
        self._busy.discard(connection)
        idle = self._idle.setdefault(connection.origin, [])
        if self._closed or not connection.usable or len(idle) >= self.most_idle:
            connection.close()
            return
        connection.idle_since = time.monotonic()
        idle.append(connection)

    def forget(self, connection: _Connection) -> None:
        self._busy.discard(connection)

    async def __aenter__(self) -> Http1Pool:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every connection, idle or in use."""
        self._closed = True
        for connection in [*self._busy, *(c for idle in self._idle.values() for c in idle)]:
            connection.close()
        self._busy.clear()
        self._idle.clear()
