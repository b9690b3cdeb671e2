"""`tollgate serve`: migrate the embedded database, bootstrap the admin key, run uvicorn
(on uvloop and httptools where they are installed)."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import uvicorn

from gateway.cli.drain import PROBES, SETTLE_S, Drain, DrainGuard, DrainingServer
from gateway.settings import Settings
from gateway.settings.engine_knobs import KnobError
from gateway.telemetry.logs import configure_logging
from gateway.telemetry.tracing import setup_tracing

if TYPE_CHECKING:
    from gateway.cli.bootstrap import AdminKey, ConsoleOwner

log = logging.getLogger(__name__)


def serve(settings: Settings) -> int:
    # The gateway's modules are imported here, not at the top: a backend replica
    # (serve_backend) starts without them.
    from gateway.app import create_app

    configure_logging(settings.log_level, settings.log_format)
    setup_tracing("tollgate-gateway")
    check_engine_device(settings)
    _migrate_or_explain(settings)
    admin = asyncio.run(_bootstrap(settings))
    owner = asyncio.run(_bootstrap_console(settings))
    app = create_app(settings)
    drain = Drain(settings.drain_s)
    app.state.drain = drain  # /readyz reads it
    config = gateway_config(DrainGuard(app, drain), settings)

    def on_started() -> None:
        _banner(settings, admin, app.state.runtime.engine.model_name)
        _console_banner(settings, owner)

    server = _Server(config, drain, on_started)
    server.run()
    return 0 if server.started else 1


def gateway_config(app: Any, settings: Settings) -> uvicorn.Config:
    """uvicorn's settings for the gateway. The gateway logs every request itself (one
    "request finished" line: method, path, status, duration, client address), so
    uvicorn's access line, which would only repeat it, is off. Connections get a header
    deadline and a per-client cap (gateway/cli/connections.py)."""
    options = proxy_options(settings) | connection_limits(settings)
    return _uvicorn_config(app, settings, access_log=False, **options)


def connection_limits(settings: Settings) -> dict[str, Any]:
    """uvicorn's `http` option: its httptools protocol with the limits, where httptools
    is installed (a dependency); else uvicorn's own choice, without them."""
    try:
        from gateway.cli.connections import guarded
    except ImportError:
        log.warning("httptools is not installed: no header timeout nor per-client cap")
        return {}
    return {
        "http": guarded(
            settings.header_timeout_s,
            settings.max_connections_per_client,
            settings.trusted_proxies,
        )
    }


def proxy_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's proxy-header options: the client behind a trusted proxy is the right-most
    untrusted X-Forwarded-For entry. Settings hold the networks normalised (127.0.0.0/8,
    not 127.0.0.1/8), the form uvicorn needs: it ignores a CIDR block with host bits."""
    return {
        "proxy_headers": bool(settings.trusted_proxies),
        "forwarded_allow_ips": list(settings.trusted_proxies),
    }


def _uvicorn_config(app: Any, settings: Settings, **options: Any) -> uvicorn.Config:
    # uvloop and httptools (dependencies) where installed, else asyncio's loop and h11
    options = {"loop": "auto", "http": "auto"} | options
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=None,  # uvicorn's loggers go through ours (JSON lines)
        lifespan="on",
        timeout_graceful_shutdown=SETTLE_S,  # after the drain (gateway/cli/drain.py)
        **options,
    )


class _Server(DrainingServer):
    """Prints the banner once the socket listens, so the printed curl works at once;
    drains on SIGTERM."""

    def __init__(
        self, config: uvicorn.Config, drain: Drain, on_started: Callable[[], None]
    ) -> None:
        super().__init__(config, drain)
        self.on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            freeze_startup_heap()
            self.on_started()


def freeze_startup_heap() -> None:
    """What start-up built (modules, the model, the app: ~300k objects) lives as long as
    the process. Left in the collector's generations, every full collection walks it,
    100 ms and more with the event loop and the step thread stopped, which a stream
    meets as a stall; frozen, a full collection walks only what serving made since."""
    gc.collect()
    gc.freeze()


def serve_backend(settings: Settings) -> int:
    """One engine replica behind the internal HTTP API; gateways reach it by URL."""
    from backend import AsyncEngine
    from backend.builtin import BUILTIN_MODEL_DIR
    from backend.server import create_backend_app

    configure_logging(settings.log_level, settings.log_format)
    setup_tracing("tollgate-backend")
    if not settings.backend_secret:
        sys.exit("tollgate: set TOLLGATE_BACKEND_SECRET, the secret gateways must present")
    check_engine_device(settings)
    model_dir = settings.model_path or BUILTIN_MODEL_DIR
    engine = AsyncEngine.from_pretrained(model_dir, settings.engine)
    app = create_backend_app(engine, model_dir, settings.backend_secret)
    drain = Drain(settings.drain_s)
    app.state.drain = drain  # /readyz and /internal/stats read it
    # Aborts, stats and model info still answer while the running requests finish.
    exempt = PROBES | {"/internal/stats", "/internal/abort", "/internal/info"}
    config = _uvicorn_config(DrainGuard(app, drain, exempt), settings)
    banner = (
        f"Tollgate backend ({engine.model_name}) ready on http://{settings.host}:{settings.port}"
    )
    server = _Server(config, drain, lambda: print(banner, flush=True))
    server.run()
    return 0 if server.started else 1


def check_engine_device(settings: Settings) -> None:
    """Refuse, before anything starts, an engine setting this machine cannot run (fp8
    weights, or an fp8 KV cache on a GPU, without an fp8 GPU): one line and exit 2, not a
    traceback from the engine's load. Only fp8 depends on the device; torch is imported
    only then."""
    engine = settings.engine
    if "fp8" not in (engine.quantization, engine.kv_cache_dtype):
        return
    from backend.layers.kv_quant import check_kv_cache_dtype
    from backend.layers.quant import QuantizationError, check_quantization
    from backend.loader import resolve_device

    device = resolve_device(engine.device)
    try:
        check_quantization(engine.quantization, device)
    except QuantizationError as exc:
        raise KnobError(f"--quantization / TOLLGATE_QUANTIZATION: {exc}") from None
    try:
        check_kv_cache_dtype(engine.kv_cache_dtype, device)
    except QuantizationError as exc:
        raise KnobError(f"--kv-cache-dtype / TOLLGATE_KV_CACHE_DTYPE: {exc}") from None


def _migrate_or_explain(settings: Settings) -> None:
    """The embedded SQLite database migrates itself; a shared PostgreSQL is migrated once,
    by `tollgate db upgrade`, not by every replica at start."""
    from sqlalchemy.engine import make_url

    from tenants import db

    if make_url(settings.database_url).get_backend_name() == "sqlite":
        db.upgrade(settings.database_url)
        return
    if db.current_revision(settings.database_url) is None:
        sys.exit("tollgate: the database has no schema yet; run `tollgate db upgrade` first")


async def _bootstrap(settings: Settings) -> AdminKey:
    from gateway.cli.bootstrap import ensure_admin_key
    from tenants import db

    engine = db.create_engine(settings.database_url)
    try:
        return await ensure_admin_key(settings, db.session_factory(engine))
    finally:
        await engine.dispose()


async def _bootstrap_console(settings: Settings) -> ConsoleOwner | None:
    from gateway.cli.bootstrap import ensure_console_owner
    from tenants import db

    engine = db.create_engine(settings.database_url)
    try:
        return await ensure_console_owner(db.session_factory(engine))
    finally:
        await engine.dispose()


def _console_banner(settings: Settings, owner: ConsoleOwner | None) -> None:
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    lines = [f"Admin console: http://{host}:{settings.port}/admin"]
    if owner is not None and owner.password is not None:
        lines.append(f"  sign in as {owner.email} with password {owner.password}")
        lines.append("  (shown only this once; add administrators with `tollgate admins create`)")
    else:
        lines.append("  sign in as an administrator (`tollgate admins create --role owner ...`)")
    print("\n".join([*lines, ""]), flush=True)


def _banner(settings: Settings, admin: AdminKey, model: str) -> None:
    """Where the gateway listens, and a command to paste: with the admin key itself only
    when it was generated by this start (printed once), else reading it from
    $TOLLGATE_KEY, with the key's prefix and where the key is."""
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    base = f"http://{host}:{settings.port}"
    key = admin.shown or "$TOLLGATE_KEY"
    lines = ["", f"Tollgate is ready on {base}", *_admin_key_lines(settings, admin), ""]
    lines += [
        "Try it:",
        f"  curl -N {base}/v1/chat/completions \\",
        f"    -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' \\",
        f'    -d \'{{"model": "{model}", "stream": true, "max_tokens": 64,'
        ' "messages": [{"role": "user", "content": "What does json.dumps do?"}]}\'',
        "",
    ]
    print("\n".join(lines), flush=True)


def _admin_key_lines(settings: Settings, admin: AdminKey) -> list[str]:
    if admin.shown is not None:
        return [
            f"Admin key (new): {admin.shown}",
            f"  (shown only this once; kept in {settings.admin_key_file}, owner-only)",
        ]
    prefix = f"{admin.prefix}_…" if admin.prefix else "not known here"
    if admin.supplied:
        return [f"Admin key: {prefix} (TOLLGATE_ADMIN_KEY)", "  export TOLLGATE_KEY=<that key>"]
    if admin.secret is not None:
        return [
            f"Admin key: {prefix}",
            f"  export TOLLGATE_KEY=$(cat {settings.admin_key_file})",
        ]
    return [
        "Admin key: an admin key exists; its secret is not kept here",
        "  export TOLLGATE_KEY=<an admin key> (`tollgate keys create --tenant admin --admin`)",
    ]
