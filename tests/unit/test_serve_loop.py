"""`tollgate serve` runs on uvloop and httptools, its dependencies, where installed."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.cli.serve import _uvicorn_config
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
