"""TOLLGATE_TRUSTED_PROXIES as uvicorn applies it: the options `tollgate serve` builds,
loaded by uvicorn's own config, in front of an app that reports the client it sees."""

from __future__ import annotations

from typing import Any

import pytest
import uvicorn

from gateway.cli.serve import proxy_options
from gateway.settings import Settings


async def client_seen(trusted: str | None, peer: str, forwarded_for: str) -> tuple[str, str]:
    """(client host, scheme) the app sees for a request from `peer` naming a client;
    `trusted` None: TOLLGATE_TRUSTED_PROXIES unset."""
    seen: dict[str, Any] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.update(client=scope["client"][0], scheme=scope["scheme"])

    env = {} if trusted is None else {"TOLLGATE_TRUSTED_PROXIES": trusted}
    settings = Settings.from_env(env)
    config = uvicorn.Config(app, **proxy_options(settings))
    config.load()
    scope = {
        "type": "http",
        "scheme": "http",
        "client": (peer, 40000),
        "headers": [(b"x-forwarded-for", forwarded_for.encode()), (b"x-forwarded-proto", b"https")],
    }
    await config.loaded_app(scope, None, None)
    return seen["client"], seen["scheme"]


async def test_a_cidr_with_host_bits_still_trusts_its_network() -> None:
    """127.0.0.1/8 means 127.0.0.0/8 (as the setting's validation reads it), not nothing."""
    assert await client_seen("127.0.0.1/8", "127.0.0.5", "203.0.113.7") == ("203.0.113.7", "https")
    assert await client_seen("::1/64", "::2", "203.0.113.7") == ("203.0.113.7", "https")


async def test_peers_outside_the_trusted_networks_are_not_believed() -> None:
    assert await client_seen("127.0.0.1/8", "192.0.2.1", "203.0.113.7") == ("192.0.2.1", "http")
    assert await client_seen("", "127.0.0.1", "203.0.113.7") == ("127.0.0.1", "http")


async def test_no_proxy_is_believed_unless_one_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """With nothing in front, a loopback client rotating X-Forwarded-For would be a new
    address each time to the console's per-address sign-in limits: by default every
    peer is the client itself (uvicorn's own FORWARDED_ALLOW_IPS default, 127.0.0.1,
    must not apply either)."""
    monkeypatch.delenv("FORWARDED_ALLOW_IPS", raising=False)
    for forwarded in ("203.0.113.7", "198.51.100.9"):
        assert await client_seen(None, "127.0.0.1", forwarded) == ("127.0.0.1", "http")
    assert await client_seen("127.0.0.1", "127.0.0.1", "203.0.113.7") == ("203.0.113.7", "https")


def test_trusted_proxies_are_stored_normalised() -> None:
    given = {"TOLLGATE_TRUSTED_PROXIES": "127.0.0.1/8, 10.1.2.3/16, ::1/64, 0:0::1"}
    assert Settings.from_env(given).trusted_proxies == (
        "127.0.0.0/8",
        "10.1.0.0/16",
        "::/64",
        "::1",
    )
