"""gateway.api.generation.Deadline: one timer for a stream's awaits, which cancels only
the wait for the next item."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.api.generation import Deadline

SOON_S = 0.05


async def _items(
    gate: asyncio.Event, closed: list[bool], count: int = 3, at_gate: asyncio.Event | None = None
) -> AsyncIterator[int]:
    """`count` items at once, then one more once `gate` is set (`at_gate` says it waits)."""
    try:
        for item in range(count):
            yield item
        if at_gate is not None:
            at_gate.set()
        await gate.wait()
        yield count
    finally:
        closed.append(True)


async def test_items_in_time_pass_and_a_late_one_times_out_closing_the_stream() -> None:
    loop = asyncio.get_running_loop()
    gate, closed = asyncio.Event(), list[bool]()
    items = _items(gate, closed)
    deadline = Deadline(loop.time() + SOON_S)
    try:
        assert [await deadline.next(items) for _ in range(3)] == [0, 1, 2]
        with pytest.raises(TimeoutError):
            await deadline.next(items)  # the gate never opens
        assert closed == [True]  # the wait was cancelled: the stream's cleanup ran
    finally:
        deadline.close()


async def test_a_deadline_passing_while_the_item_is_handed_on_cancels_nothing() -> None:
    """Past due while the consumer awaits something else: that await completes, and the
    next wait fails at once."""
    loop = asyncio.get_running_loop()
    gate, closed = asyncio.Event(), list[bool]()
    items = _items(gate, closed)
    deadline = Deadline(loop.time() + SOON_S)
    try:
        assert await deadline.next(items) == 0
        handed_on = asyncio.Event()
        loop.call_at(loop.time() + 2 * SOON_S, handed_on.set)  # after the due time
        await handed_on.wait()  # not cancelled by the deadline
        with pytest.raises(TimeoutError):
            await deadline.next(items)
        assert closed == []  # nothing was waiting: the stream was not touched
    finally:
        deadline.close()


async def test_moving_the_deadline_later_lets_a_slower_item_through() -> None:
    loop = asyncio.get_running_loop()
    gate, closed = asyncio.Event(), list[bool]()
    items = _items(gate, closed, count=1)
    deadline = Deadline(loop.time() + SOON_S)
    try:
        assert await deadline.next(items) == 0
        deadline.move(loop.time() + 60)
        loop.call_at(loop.time() + 2 * SOON_S, gate.set)  # past the first due time
        assert await deadline.next(items) == 1
    finally:
        deadline.close()


async def test_a_cancellation_from_outside_stays_a_cancellation() -> None:
    loop = asyncio.get_running_loop()
    gate, closed, at_gate = asyncio.Event(), list[bool](), asyncio.Event()
    items = _items(gate, closed, count=0, at_gate=at_gate)
    deadline = Deadline(loop.time() + 60)
    waiting = asyncio.ensure_future(deadline.next(items))
    try:
        await at_gate.wait()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert closed == [True]
    finally:
        deadline.close()
