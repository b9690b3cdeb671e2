"""SQLite's pool keeps the connections a busy gateway needs at once: a new aiosqlite
connection starts a thread (the event loop waits for it) and opens the file."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncEngine

from tenants.db import create_direct_engine, create_engine


async def _check_out_together(engine: AsyncEngine, count: int) -> None:
    together = asyncio.Barrier(count)

    async def one() -> None:
        async with engine.connect() as connection:
            await connection.execute(text("SELECT 1"))
            await together.wait()  # all of them checked out at once

    await asyncio.gather(*(one() for _ in range(count)))


@pytest.mark.parametrize("create", [create_engine, create_direct_engine])
async def test_concurrent_sessions_reuse_their_connections(
    tmp_path: Path, create: Callable[[str], AsyncEngine]
) -> None:
    engine = create(f"sqlite:///{tmp_path / 'gateway.db'}")
    opened: list[object] = []
    event.listen(engine.sync_engine, "connect", lambda connection, _: opened.append(connection))
    try:
        await _check_out_together(engine, 20)
        await _check_out_together(engine, 20)
    finally:
        await engine.dispose()
    assert len(opened) == 20  # the second round opened none


async def test_an_in_memory_database_still_opens() -> None:
    engine = create_engine("sqlite://")
    try:
        async with engine.connect() as connection:
            assert (await connection.execute(text("SELECT 1"))).scalar() == 1
    finally:
        await engine.dispose()
