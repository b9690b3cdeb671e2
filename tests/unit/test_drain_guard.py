"""gateway.cli.drain.DrainGuard: a request waiting for its client's next message when the
drain's grace period ends sees a disconnect; other cancellations stay cancellations."""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any

import pytest

from gateway.cli.drain import DISCONNECT, Drain, DrainGuard

Message = dict[str, Any]


class Client:
    """The ASGI server's side: the body at once, then nothing until the test says."""

    def __init__(self) -> None:
        self.messages: asyncio.Queue[Message] = asyncio.Queue()
        self.messages.put_nowait({"type": "http.request", "body": b"", "more_body": False})

    async def receive(self) -> Message:
        return await self.messages.get()

    async def send(self, message: MutableMapping[str, Any]) -> None:
        pass


def _app(seen: list[Message], waiting: asyncio.Event) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(await receive())  # the body
        waiting.set()
        seen.append(await receive())  # blocks: the client says nothing more

    return app


async def _waiting_request(drain: Drain, seen: list[Message]) -> asyncio.Future[None]:
    """A request served through the guard, once it waits for the client's next message."""
    waiting, client = asyncio.Event(), Client()
    guard = DrainGuard(_app(seen, waiting), drain)
    served = asyncio.ensure_future(
        guard({"type": "http", "path": "/v1/x"}, client.receive, client.send)
    )
    await waiting.wait()
    return served


async def test_a_wait_under_way_at_the_cut_ends_as_a_disconnect() -> None:
    drain, seen = Drain(grace_s=0.0), list[Message]()
    served = await _waiting_request(drain, seen)
    drain.begin()
    assert drain.over() is False  # one in flight: cut now, settling still allowed
    await asyncio.wait_for(served, 10)  # a bound, should the cut not reach the wait
    assert seen[0]["type"] == "http.request" and seen[1] == DISCONNECT
    assert drain.cut and drain.in_flight == 0 and not drain.receiving


async def test_a_cancellation_that_is_not_the_cut_stays_one() -> None:
    drain, seen = Drain(grace_s=60.0), list[Message]()
    served = await _waiting_request(drain, seen)
    served.cancel()
    with pytest.raises(asyncio.CancelledError):
        await served
    assert len(seen) == 1 and drain.in_flight == 0 and not drain.receiving
