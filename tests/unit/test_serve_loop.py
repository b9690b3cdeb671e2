"""`tollgate serve` runs on uvloop and httptools, its dependencies, where installed, and
freezes what its start-up built once it listens."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from gateway.cli.drain import Drain, DrainingServer
from gateway.cli.serve import _Server, _uvicorn_config
from gateway.settings import Settings


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    pass


def test_serve_uses_uvloop_and_httptools() -> None:
    uvloop = pytest.importorskip("uvloop")
    pytest.importorskip("httptools")
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    config = _uvicorn_config(_app, Settings.from_env({}))
    config.load()
    assert config.http_protocol_class is HttpToolsProtocol
    factory = config.get_loop_factory()
    assert factory is not None
    loop = factory()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


async def test_a_started_server_freezes_what_start_up_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A full collection would walk start-up's objects, stalling every stream."""

    async def listening(self: DrainingServer, sockets: Any = None) -> None:
        self.started = True

    monkeypatch.setattr(DrainingServer, "startup", listening)
    frozen_at_banner: list[int] = []
    server = _Server(
        _uvicorn_config(_app, Settings.from_env({})),
        Drain(1.0),
        lambda: frozen_at_banner.append(gc.get_freeze_count()),
    )
    gc.unfreeze()
    try:
        await server.startup()
        assert frozen_at_banner and frozen_at_banner[0] > 1000
    finally:
        gc.unfreeze()  # the test process's objects stay collectable
