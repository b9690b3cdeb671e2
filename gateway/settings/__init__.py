"""Settings from environment variables, read when the app or CLI starts, never at import."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from backend.config import EngineConfig
from gateway.settings import engine_knobs
from gateway.settings.errors import ConfigError
from tenants.blobs import S3Location

PriorityOrder = Literal["lower-first", "higher-first"]
PRIORITY_ORDERS: tuple[PriorityOrder, ...] = ("lower-first", "higher-first")

DEFAULT_DATA_DIR = Path(".tollgate")


class SettingsError(ConfigError):
    """A setting has a value that cannot be used; the message names the variable."""


def gateway_engine_defaults() -> EngineConfig:
    """The engine's defaults when the gateway starts it: one CPU thread fewer than the
    cores, so the event loop can stream."""
    return EngineConfig(cpu_threads=max(1, (os.cpu_count() or 2) - 1))


@dataclass(frozen=True)
class Settings:
    database_url: str
    redis_url: str | None
    model_path: Path | None  # None: the built-in model
    host: str
    port: int
    data_dir: Path
    admin_key: str | None  # bootstrap: ensure this admin key exists
    request_timeout_s: float
    idempotency_retention_s: int
    lease_s: int
    backends: tuple[str, ...]  # empty: the in-process engine
    backend_secret: str | None
    log_level: str
    stripe_api_key: str | None = None  # None: ledger only, no Stripe export
    stripe_base_url: str | None = None  # None: api.stripe.com (tests: a local fake)
    stripe_meter_event: str = "tollgate_usage_micros"
    stripe_timeout_s: float = 20.0
    stripe_retry_base_ms: int = 200  # first backoff before jitter; doubles per retry
    checkpoint_ms: int = 2000  # running streams' delivered tokens recorded this often
    export_interval_s: int = 30  # embedded mode: how often the gateway runs the relay
    export_retry_s: int = 30  # a row Stripe deferred waits this long, doubling per try (<= 1 h)
    celery_queue: str = "tollgate"
    # The batch tasks' own queue: a batch run holds a worker slot for minutes
    # (batch_task_s), so they get workers of their own and the billing tasks never wait.
    celery_batch_queue: str = "tollgate-batches"
    console_idle_s: int = 1800  # admin console sessions end after this long unused
    log_format: str = "json"  # one JSON object per line, or "text"
    metrics_token: str | None = None  # None: /metrics answers loopback clients only
    metrics_top_tenants: int = 20  # tenants with a metrics label of their own
    # The in-process engine's (or `tollgate backend serve`'s) knobs: TOLLGATE_<FIELD>.
    engine: EngineConfig = field(default_factory=gateway_engine_defaults)
    # Peers whose X-Forwarded-For / X-Forwarded-Proto are believed (IPs or CIDRs; "*": all).
    # The audit log, rate-limit failures and /metrics' loopback check see the client behind.
    # None by default: with no proxy in front, a loopback peer's rotating X-Forwarded-For
    # would dodge the console's per-address sign-in limits.
    trusted_proxies: tuple[str, ...] = ()
    # A request's headers must arrive within this (slow-header sockets are closed, 408);
    # one client address (not a trusted proxy) holds at most this many connections.
    header_timeout_s: float = 10.0
    max_connections_per_client: int = 256
    # Browser origins that may call /v1/* (scheme://host[:port], or "*"); empty: no CORS.
    cors_origins: tuple[str, ...] = ()
    # The largest request body: a 128k-token context is about 0.5 MB of text, or 1 MB of
    # token ids, so 4 MiB leaves room for JSON escaping and multi-byte text.
    max_body_bytes: int = 4 * 2**20
    # On SIGTERM: seconds in-flight requests get to finish before the process exits anyway.
    drain_s: float = 30.0
    # `tollgate admins create`'s password, when not piped or prompted. A secret: not in repr.
    admin_password: str | None = field(default=None, repr=False)
    # OpenAI-compatible upstreams (registry models of kind `openai`). Each tenant's requests
    # carry cache_salt = HMAC(this secret, tenant id), so tenants never share an upstream
    # prefix cache; every gateway replica needs the same secret for a tenant's requests to
    # share theirs. Unset: TOLLGATE_BACKEND_SECRET, else a random one per process.
    cache_salt_secret: str | None = field(default=None, repr=False)
    # Models whose upstream schedules by priority, and its convention: "lower-first" (vLLM
    # with --scheduling-policy priority, as the gateway's) or "higher-first" (SGLang's
    # default): they get the request's priority in that convention; others, never (vLLM
    # refuses a non-zero priority unless so started).
    upstream_priority_models: Mapping[str, PriorityOrder] = field(default_factory=dict)
    # Models whose tenants share the upstream's prefix cache: no cache_salt is sent.
    upstream_shared_cache_models: frozenset[str] = frozenset()
    upstream_probe_s: float = 1.0  # how often each upstream's /health and /metrics are read
    # Where uploaded files' bytes live: None, the data folder; a bucket (TOLLGATE_S3_*), an
    # S3-compatible store every gateway and Celery worker reaches (stack mode).
    s3: S3Location | None = None
    # Batches (stack mode: Celery workers run them). A line's claim lapses this long after
    # its runner last renewed it (a runner that died): another runner takes the line over.
    batch_lease_s: int = 60
    batch_task_s: int = 300  # one Celery task runs a batch this long, then queues its sequel
    batch_sweep_s: int = 10  # beat queues a task for every unfinished batch this often
    # The most one tenant's uploaded and result files may hold together (a plan's
    # max_file_bytes overrides it): one tenant cannot fill the data folder or the bucket.
    files_max_bytes_per_tenant: int = 10 * 2**30

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        data_dir = Path(env.get("TOLLGATE_DATA_DIR", str(DEFAULT_DATA_DIR)))
        model = env.get("TOLLGATE_MODEL", "").strip()
        return cls(
            database_url=env.get("TOLLGATE_DATABASE_URL", "").strip()
            or f"sqlite:///{data_dir / 'tollgate.db'}",
            redis_url=env.get("TOLLGATE_REDIS_URL", "").strip() or None,
            model_path=Path(model) if model else None,
            host=env.get("TOLLGATE_HOST", "127.0.0.1"),
            port=_int(env, "TOLLGATE_PORT", 8000, low=0, high=65535),
            max_body_bytes=_int(env, "TOLLGATE_MAX_BODY_BYTES", 4 * 2**20, low=2**10),
            data_dir=data_dir,
            admin_key=env.get("TOLLGATE_ADMIN_KEY", "").strip() or None,
            engine=_engine(env),
            log_level=env.get("TOLLGATE_LOG_LEVEL", "info").lower(),
            log_format=_log_format(env),
            metrics_token=env.get("TOLLGATE_METRICS_TOKEN", "").strip() or None,
            metrics_top_tenants=_int(env, "TOLLGATE_METRICS_TOP_TENANTS", 20, low=1, high=1000),
            request_timeout_s=float(_int(env, "TOLLGATE_REQUEST_TIMEOUT_S", 600, low=1)),
            idempotency_retention_s=_int(
                env, "TOLLGATE_IDEMPOTENCY_RETENTION_S", 24 * 3600, low=60
            ),
            lease_s=_int(env, "TOLLGATE_LEASE_S", 30, low=1, high=3600),
            checkpoint_ms=_int(env, "TOLLGATE_CHECKPOINT_MS", 2000, low=100, high=5000),
            backends=tuple(
                url.strip().rstrip("/")
                for url in env.get("TOLLGATE_BACKENDS", "").split(",")
                if url.strip()
            ),
            backend_secret=env.get("TOLLGATE_BACKEND_SECRET", "").strip() or None,
            stripe_api_key=env.get("TOLLGATE_STRIPE_API_KEY", "").strip() or None,
            stripe_base_url=env.get("TOLLGATE_STRIPE_BASE_URL", "").strip().rstrip("/") or None,
            stripe_meter_event=env.get("TOLLGATE_STRIPE_METER_EVENT", "").strip()
            or "tollgate_usage_micros",
            stripe_timeout_s=float(_int(env, "TOLLGATE_STRIPE_TIMEOUT_S", 20, low=1, high=300)),
            stripe_retry_base_ms=_int(env, "TOLLGATE_STRIPE_RETRY_BASE_MS", 200, low=1),
            export_interval_s=_int(env, "TOLLGATE_EXPORT_INTERVAL_S", 30, low=1, high=86400),
            export_retry_s=_int(env, "TOLLGATE_EXPORT_RETRY_S", 30, low=1, high=3600),
            celery_queue=(queue := env.get("TOLLGATE_CELERY_QUEUE", "").strip() or "tollgate"),
            celery_batch_queue=env.get("TOLLGATE_CELERY_BATCH_QUEUE", "").strip()
            or f"{queue}-batches",
            console_idle_s=_int(env, "TOLLGATE_CONSOLE_IDLE_S", 1800, low=60),
            trusted_proxies=_proxies(env.get("TOLLGATE_TRUSTED_PROXIES", "")),
            header_timeout_s=float(_int(env, "TOLLGATE_HEADER_TIMEOUT_S", 10, low=1, high=300)),
            max_connections_per_client=_int(
                env, "TOLLGATE_MAX_CONNECTIONS_PER_CLIENT", 256, low=1, high=1_000_000
            ),
            cors_origins=tuple(
                o.strip().rstrip("/")
                for o in env.get("TOLLGATE_CORS_ORIGINS", "").split(",")
                if o.strip()
            ),
            drain_s=float(_int(env, "TOLLGATE_DRAIN_S", 30, low=0, high=3600)),
            admin_password=env.get("TOLLGATE_ADMIN_PASSWORD") or None,
            cache_salt_secret=env.get("TOLLGATE_CACHE_SALT_SECRET", "").strip() or None,
            upstream_priority_models=_priority_models(
                env.get("TOLLGATE_UPSTREAM_PRIORITY_MODELS", "")
            ),
            upstream_shared_cache_models=frozenset(
                _names(env.get("TOLLGATE_UPSTREAM_SHARED_CACHE_MODELS", ""))
            ),
            upstream_probe_s=_int(env, "TOLLGATE_UPSTREAM_PROBE_MS", 1000, low=100, high=60000)
            / 1000,
            s3=_s3(env),
            batch_lease_s=_int(env, "TOLLGATE_BATCH_LEASE_S", 60, low=1, high=3600),
            batch_task_s=_int(env, "TOLLGATE_BATCH_TASK_S", 300, low=1, high=3000),
            batch_sweep_s=_int(env, "TOLLGATE_BATCH_SWEEP_S", 10, low=1, high=3600),
            files_max_bytes_per_tenant=_int(
                env, "TOLLGATE_FILES_MAX_BYTES_PER_TENANT", 10 * 2**30, low=0
            ),
        )

    def with_overrides(self, **changes: object) -> Settings:
        """A copy with command-line flags applied (None means: keep the env value)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        if self.backends and not self.backend_secret:
            raise SettingsError("TOLLGATE_BACKENDS needs TOLLGATE_BACKEND_SECRET (shared secret)")

    @property
    def admin_key_file(self) -> Path:
        return self.data_dir / "admin-key"


def _engine(env: Mapping[str, str]) -> EngineConfig:
    try:
        return engine_knobs.from_env(env, gateway_engine_defaults())
    except engine_knobs.KnobError as exc:
        raise SettingsError(str(exc)) from None


S3_VARIABLES = (
    "TOLLGATE_S3_ENDPOINT_URL",
    "TOLLGATE_S3_REGION",
    "TOLLGATE_S3_PREFIX",
    "TOLLGATE_S3_ACCESS_KEY_ID",
    "TOLLGATE_S3_SECRET_ACCESS_KEY",
)


def _s3(env: Mapping[str, str]) -> S3Location | None:
    """TOLLGATE_S3_BUCKET selects the S3 file store; the other TOLLGATE_S3_* refine it."""
    values = {name: env.get(name, "").strip() for name in ("TOLLGATE_S3_BUCKET", *S3_VARIABLES)}
    if not values["TOLLGATE_S3_BUCKET"]:
        stray = [name for name in S3_VARIABLES if values[name]]
        if stray:
            raise SettingsError(f"{stray[0]} is set without TOLLGATE_S3_BUCKET")
        return None
    key_id, secret = values["TOLLGATE_S3_ACCESS_KEY_ID"], values["TOLLGATE_S3_SECRET_ACCESS_KEY"]
    if bool(key_id) != bool(secret):
        raise SettingsError(
            "TOLLGATE_S3_ACCESS_KEY_ID and TOLLGATE_S3_SECRET_ACCESS_KEY go together"
        )
    prefix = values["TOLLGATE_S3_PREFIX"] or "files/"
    return S3Location(
        bucket=values["TOLLGATE_S3_BUCKET"],
        endpoint_url=values["TOLLGATE_S3_ENDPOINT_URL"].rstrip("/") or None,
        region=values["TOLLGATE_S3_REGION"] or "us-east-1",
        prefix=prefix if prefix.endswith("/") else prefix + "/",
        access_key_id=key_id or None,
        secret_access_key=secret or None,
    )


def _log_format(env: Mapping[str, str]) -> str:
    fmt = env.get("TOLLGATE_LOG_FORMAT", "").strip().lower() or "json"
    if fmt not in ("json", "text"):
        raise SettingsError(f"TOLLGATE_LOG_FORMAT must be json or text, got {fmt!r}")
    return fmt


def _proxies(raw: str) -> tuple[str, ...]:
    """Comma-separated IPs or CIDR blocks, or "*"; empty: trust no proxy header. Each is
    kept in its normal form (127.0.0.1/8 becomes 127.0.0.0/8), which is what uvicorn
    matches against: it silently ignores a block with host bits set."""
    entries = tuple(item.strip() for item in raw.split(",") if item.strip())
    return tuple(entry if entry == "*" else _proxy(entry) for entry in entries)


def _proxy(entry: str) -> str:
    try:
        if "/" in entry:
            return str(ipaddress.ip_network(entry, strict=False))
        return str(ipaddress.ip_address(entry))
    except ValueError:
        raise SettingsError(
            f"TOLLGATE_TRUSTED_PROXIES: {entry!r} is not an IP address or CIDR block"
        ) from None


def _names(raw: str) -> list[str]:
    return [name.strip() for name in raw.split(",") if name.strip()]


def _priority_models(raw: str) -> dict[str, PriorityOrder]:
    """`name[:lower-first|higher-first]`, comma-separated; the order defaults to vLLM's."""
    models: dict[str, PriorityOrder] = {}
    for entry in _names(raw):
        name, _, order = (part.strip() for part in entry.partition(":"))
        order = order or "lower-first"
        if order not in PRIORITY_ORDERS:
            raise SettingsError(
                f"TOLLGATE_UPSTREAM_PRIORITY_MODELS: {entry!r}: the order after ':' must be "
                f"one of {', '.join(PRIORITY_ORDERS)}"
            )
        models[name] = order  # type: ignore[assignment]  # checked against PRIORITY_ORDERS
    return models


def _int(env: Mapping[str, str], name: str, default: int, low: int, high: int | None = None) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name} must be an integer, got {raw!r}") from None
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise SettingsError(f"{name} must be {bound}, got {value}")
    return value
