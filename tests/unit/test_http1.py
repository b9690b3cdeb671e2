"""gateway/dispatch/http1.py against small HTTP/1.1 servers of the test's own on loopback:
keep-alive reuse, bodies by length, chunks and connection close, streamed lines as they
come, a response closed early closing its connection, and a stale kept-alive
connection replaced."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
import uvloop

from gateway.dispatch.http1 import Http1Pool, TransportError, split_url

Handler = Callable[[bytes, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]


@dataclass
class Server:
    url: str
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)  # each request's head and body
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # a connection ended


@contextlib.asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[Server]:
    """Reads each request (head and Content-Length body), lets `handler` answer; the
    connection stays open while the handler returns True."""
    server = Server("")

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        server.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                request = head + await reader.readexactly(length)
                server.requests.append(request)
                if not await handler(request, reader, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            server.closed.set()

    listening = await asyncio.start_server(connection, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    server.url = f"http://127.0.0.1:{port}"
    try:
        yield server
    finally:
        listening.close()
        await listening.wait_closed()


def answer(body: bytes, status: str = "200 OK", extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: application/json\r\n" + extra
        + b"content-length: %d\r\n\r\n" % len(body) + body
    )  # fmt: skip


async def test_a_kept_alive_connection_serves_the_next_request() -> None:
    await _keep_alive()


def test_the_pool_runs_on_uvloop_as_tollgate_serve_does() -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_keep_alive())


async def _keep_alive() -> None:
    async def handler(request: bytes, _: asyncio.StreamReader, out: asyncio.StreamWriter) -> bool:
        out.write(answer(request.rsplit(b"\r\n\r\n", 1)[1]))
        return True

    async with serving(handler) as server, Http1Pool({"Authorization": "Bearer k"}) as pool:
        for body in (b'{"a":1}', b'{"b":2}'):
            async with await pool.request("POST", f"{server.url}/x?q=1", body) as response:
                assert response.status_code == 200
                assert response.headers["content-type"] == "application/json"
                assert await response.read() == body
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /x?q=1 HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer k\r\n" in first
    assert f"\r\nHost: {server.url.removeprefix('http://')}\r\n".encode() in first


async def test_streamed_lines_come_as_they_are_sent() -> None:
    more = asyncio.Event()

    async def handler(_: bytes, __: asyncio.StreamReader, out: asyncio.StreamWriter) -> bool:
        out.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        out.write(b"b\r\ndata: one\n\n\r\n")
        await out.drain()
        await more.wait()  # the client has read the first line before the rest is sent
        for piece in (b"data: t", b"wo\r\n\r\ndata: [DONE]\n\n"):
            out.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        out.write(b"0\r\n\r\n")
        return True

    async with serving(handler) as server, Http1Pool() as pool:
        lines = []
        async with await pool.request("POST", server.url + "/s", b"{}") as response:
            async for line in response.lines():
                lines.append(line)
                more.set()
        assert lines == [b"data: one", b"", b"data: two", b"", b"data: [DONE]", b""]
        async with await pool.request("POST", server.url + "/s", b"{}") as response:
            assert (await response.read()).endswith(b"data: [DONE]\n\n")
    assert server.connections == 1  # the chunked answer was read to its end: reused


async def test_closing_a_response_before_its_end_closes_the_connection() -> None:
    async def handler(_: bytes, reader: asyncio.StreamReader, out: asyncio.StreamWriter) -> bool:
        out.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await out.drain()
        await reader.read()  # until the client closes: what vLLM takes as an abort
        return False

    async with serving(handler) as server, Http1Pool() as pool:
        response = await pool.request("POST", server.url, b"{}")
        assert await anext(response.chunks()) == b"first"
        response.close()
        await asyncio.wait_for(server.closed.wait(), 5)


async def test_a_body_without_length_ends_with_the_connection() -> None:
    async def handler(_: bytes, __: asyncio.StreamReader, out: asyncio.StreamWriter) -> bool:
        out.write(b"HTTP/1.1 502 Bad Gateway\r\nconnection: close\r\n\r\nno upstream")
        return False

    async with (
        serving(handler) as server,
        Http1Pool() as pool,
        await pool.request("POST", server.url, b"") as response,
    ):
        assert response.status_code == 502
        assert await response.read() == b"no upstream"


async def test_a_connection_the_server_closed_while_idle_is_replaced() -> None:
    async def handler(_: bytes, __: asyncio.StreamReader, out: asyncio.StreamWriter) -> bool:
        out.write(answer(b"ok"))  # keep-alive by HTTP/1.1's default, yet the server closes
        await out.drain()
        return False

    async with serving(handler) as server, Http1Pool() as pool:
        for _ in range(2):
            async with await pool.request("POST", server.url, b"") as response:
                assert await response.read() == b"ok"
            await asyncio.wait_for(server.closed.wait(), 5)
            server.closed.clear()
    assert server.connections == 2
    assert len(server.requests) == 2  # each request sent once


async def test_a_dropped_answer_is_a_transport_error_and_never_sent_twice() -> None:
    async def handler(_: bytes, __: asyncio.StreamReader, out: asyncio.StreamWriter) -> bool:
        out.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        return False  # closes mid-body

    async with serving(handler) as server, Http1Pool() as pool:
        response = await pool.request("POST", server.url, b"")
        with pytest.raises(TransportError):
            await response.read()
        response.close()
    assert len(server.requests) == 1


async def test_a_refused_connection_is_a_transport_error() -> None:
    async with serving(lambda *_: asyncio.sleep(0, False)) as server:
        url = server.url
    async with Http1Pool(connect_timeout_s=2.0) as pool:
        with pytest.raises(TransportError):
            await pool.request("POST", url, b"")


def test_urls_split_into_origin_and_target() -> None:
    origin, target = split_url("https://api.example.com/v1/chat/completions?x=1")
    assert (origin.scheme, origin.host, origin.port) == ("https", "api.example.com", 443)
    assert origin.host_header == "api.example.com"
    assert target == "/v1/chat/completions?x=1"
    origin, target = split_url("http://127.0.0.1:8000")
    assert (origin.port, origin.host_header, target) == (8000, "127.0.0.1:8000", "/")
    with pytest.raises(ValueError, match="not an http"):
        split_url("ftp://example.com/")


async def test_a_request_dropped_unanswered_on_a_kept_alive_connection_goes_anew() -> None:
    async def handler(_: bytes, __: asyncio.StreamReader, out: asyncio.StreamWriter) -> bool:
        if len(server.requests) == 2:  # the second one: closed as if it came too late
            return False
        out.write(answer(b"ok"))
        return True

    async with serving(handler) as server, Http1Pool() as pool:
        for _ in range(2):
            async with await pool.request("POST", server.url, b"") as response:
                assert await response.read() == b"ok"
    assert server.connections == 2
    assert len(server.requests) == 3
