"""The Capacity page's live figures for remote replicas: a real backend on loopback,
polled the way the page polls it."""

from __future__ import annotations

import math
from pathlib import Path

from backend.builtin import BUILTIN_MODEL_DIR
from backend.config import EngineConfig
from backend.engine.async_engine import AsyncEngine
from backend.server import create_backend_app
from gateway.console.capacity import live_replicas
from gateway.dispatch.remote import RemoteEngineClient
from tests.conftest import serving
from tests.engine.engine_support import builtin_kv_block


async def test_a_remote_replicas_pool_and_headroom(tmp_path: Path) -> None:
    engine = AsyncEngine.from_pretrained(BUILTIN_MODEL_DIR, EngineConfig(max_model_len=1000))
    app = create_backend_app(engine, BUILTIN_MODEL_DIR, secret="s3cret")
    async with serving(app) as url:
        client = await RemoteEngineClient.connect([url], "s3cret", tmp_path)
        try:
            [live] = await live_replicas(client, "s3cret")
            [refused] = await live_replicas(client, "wrong")
        finally:
            await client.close()
    stats = engine.stats()
    assert live.healthy and live.name == url and live.model == "tollgate-tiny"
    assert live.context == 1000 and live.block_size == stats.block_size
    assert live.blocks_total == stats.kv_blocks_total
    assert live.blocks_used + live.blocks_free == stats.kv_blocks_total
    _, per_block = builtin_kv_block()  # in the engine's dtype
    assert live.bytes_per_block == per_block
    assert live.max_sequences == stats.kv_blocks_total // math.ceil(1000 / 16)
    assert live.headroom == live.blocks_free // math.ceil(1000 / 16)
    assert not refused.healthy and refused.blocks_total == 0
