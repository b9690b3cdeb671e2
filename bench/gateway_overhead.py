"""Gateway overhead (issue 19, section 4): what a request pays for going through a gateway.

In one run, interleaved round by round: instant upstreams called directly; a bare
pass-through proxy (Litestar + httpx, bearer check only, no database: the floor for a
Python gateway) in front of the OpenAI-compatible one; and `tollgate serve` with full
admission (key, plan limits, reservation, usage row) on the embedded default and on
PostgreSQL + Redis. Each gateway runs pinned to core 0; the bench, its upstreams and its
Redis run on the other cores.

    python -m bench.gateway_overhead [--quick] [--skip-stack] [--dry-run]
        [--tollgate-upstream openai|replica]
    python -m bench.gateway_overhead --profile [--profile-stack] [--profile-c1] [--quick]

By default (`--tollgate-upstream openai`) Tollgate fronts the same instant OpenAI mock as
the bare proxy, as a registry model of kind openai (priced, the one model the tenant's
plan allows, counted with a local tokenizer), so both gateways' added latency is counted
against the same upstream; `--tollgate-upstream replica` fronts an instant Tollgate
backend replica (backend/server.py's NDJSON protocol) instead. Reported: latency p50/p99
and what each gateway adds to its upstream's, at concurrency 1 and 16, streaming and
not; time to first byte; CPU ms per request of the gateway process (/proc); the highest
Poisson rate each sustains with p99 <= 500 ms and < 1% errors, with how busy the gateway's
core was at it (far below 100%: the rest of the machine set the limit, not the gateway:
on 2 cores, PostgreSQL and Redis share the other core with the load); and the issue's targets
(added p50 at c=1 within 1.5x of the bare proxy's; sustained rate >= 60% of its).

Tollgate's usage row is on disk before its answer (on either store), so every c=1 request
waits for one flush of the disk's write cache, which the bare proxy never does. The disk's
flush latency on this VM moved between ~0.08 and ~0.9 ms within an hour (stop 32), so
the bench measures it in the same run (an fdatasync of a 4 KiB write in the gateways'
data folder, before and after the c=1 cells) and prints what each Tollgate adds beyond
one flush: a diagnostic of the request path, not the target.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
from litestar import Litestar, Request, Response, post
from litestar.response import Stream

from bench._common import percentile

MODEL = "bench-instant"
OPENAI_MODEL = "bench-openai"  # the mock's model in Tollgate's registry
TOKENS = 16  # per answer: the mock
TOKEN_ID, TOKEN_TEXT = 300, " tok"
MESSAGES = [{"role": "user", "content": "Say sixteen words."}]
PROMPT_IDS = list(range(10, 20))
BACKEND_SECRET = "bench-overhead-secret"  # loopback only
GATEWAY_CORE = 0
P99_LIMIT_S = 0.5
ERROR_LIMIT = 0.01
REQUEST_TIMEOUT_S = 10.0
STARTUP_TIMEOUT_S = 120
PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/tollgate_bench_overhead"
CLK_TCK = os.sysconf("SC_CLK_TCK")
ROOT = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------- a tiny HTTP/1.1 server
# The upstreams answer at once from prepared bytes: a framework there would only add
# noise to the figure being measured (the gateway's).

Reply = tuple[int, bytes, bytes | list[bytes]]  # status, content type, body or chunks
Handler = Callable[[bytes], Reply]


def render_reply(status: int, content_type: bytes, payload: bytes | list[bytes]) -> bytes:
    head = b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\n" % (status, content_type)
    if isinstance(payload, bytes):
        return head + b"content-length: %d\r\n\r\n" % len(payload) + payload
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in payload)
    return head + b"transfer-encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"


async def serve_routes(routes: dict[tuple[bytes, bytes], Handler], port: int) -> asyncio.Server:
    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, target, _ = head.split(b"\r\n", 1)[0].split(b" ", 2)
                length = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                body = await reader.readexactly(length) if length else b""
                handler = routes.get((method, target.split(b"?")[0]))
                reply = handler(body) if handler else (404, b"text/plain", b"no such route")
                writer.write(render_reply(*reply))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(connection, "127.0.0.1", port, backlog=1024)


def _json(value: Any) -> Reply:
    return 200, b"application/json", msgspec.json.encode(value)


def prompt_tokens() -> int:
    """MESSAGES' tokens as Tollgate counts them with the tokenizer its registry model names
    (the built-in one: chat template, then encode), so the mock's usage agrees, as that of
    an upstream serving the model would: a disagreement costs Tollgate a log line per
    request (gateway.dispatch.upstream's compare), which the bench would count as overhead."""
    from backend.builtin import BUILTIN_MODEL_DIR
    from backend.tokenizer import Tokenizer

    tokenizer = Tokenizer(BUILTIN_MODEL_DIR)
    return len(tokenizer.encode(tokenizer.apply_chat_template(MESSAGES)))


def openai_routes() -> dict[tuple[bytes, bytes], Handler]:
    """An OpenAI-compatible upstream that answers at once: 16 tokens, streamed (with
    vLLM's usage chunk) or whole."""
    head = {"id": "chatcmpl-bench", "created": 0, "model": MODEL}
    prompt = prompt_tokens()
    usage = {"prompt_tokens": prompt, "completion_tokens": TOKENS, "total_tokens": prompt + TOKENS}
    message = {"role": "assistant", "content": TOKEN_TEXT * TOKENS}
    whole = msgspec.json.encode(
        {
            **head,
            "object": "chat.completion",
            "usage": usage,
            "choices": [{"index": 0, "message": message, "finish_reason": "length"}],
        }
    )
    chunk = {**head, "object": "chat.completion.chunk"}

    def event(choices: list[Any], **extra: Any) -> bytes:
        return b"data: " + msgspec.json.encode({**chunk, "choices": choices, **extra}) + b"\n\n"

    events = [event([{"index": 0, "delta": {"role": "assistant", "content": ""}}])]
    for i in range(TOKENS):
        reason = "length" if i == TOKENS - 1 else None
        events.append(
            event([{"index": 0, "delta": {"content": TOKEN_TEXT}, "finish_reason": reason}])
        )
    events += [event([], usage=usage), b"data: [DONE]\n\n"]

    def chat(body: bytes) -> Reply:
        streaming = msgspec.json.decode(body).get("stream")
        return (
            (200, b"text/event-stream", events) if streaming else (200, b"application/json", whole)
        )

    models = {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]}
    metrics = b"vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n"  # what routing reads
    return {
        (b"POST", b"/v1/chat/completions"): chat,
        (b"GET", b"/v1/models"): lambda _: _json(models),
        (b"GET", b"/health"): lambda _: (200, b"text/plain", b""),
        (b"GET", b"/metrics"): lambda _: (200, b"text/plain", metrics),
    }


class _GenerateBody(msgspec.Struct):
    request_id: str
    prompt: list[int]


def replica_routes() -> dict[tuple[bytes, bytes], Handler]:
    """A Tollgate backend replica (backend/wire.py's protocol) that answers at once: 16
    output lines of one token each."""
    from backend.builtin import BUILTIN_MODEL_DIR
    from backend.outputs import RequestOutput
    from backend.server import TOKENIZER_FILES
    from backend.wire import OutputLine

    files = {
        name: (BUILTIN_MODEL_DIR / name).read_text(encoding="utf-8")
        for name in TOKENIZER_FILES
        if (BUILTIN_MODEL_DIR / name).is_file()
    }
    info = {"model": MODEL, "max_model_len": 2048, "files": files}
    stats = {
        "running": True,
        "num_running": 0,
        "num_waiting": 0,
        "kv_blocks_total": 1024,
        "kv_blocks_used": 0,
        "prefix_cache_queries": 0,
        "prefix_cache_hits": 0,
    }
    decode = msgspec.json.Decoder(type=_GenerateBody).decode
    encode = msgspec.json.Encoder().encode

    def generate(body: bytes) -> Reply:
        request = decode(body)
        now = time.monotonic()
        lines = []
        for i in range(1, TOKENS + 1):
            last = i == TOKENS
            out = RequestOutput(
                request.request_id,
                TOKEN_TEXT,
                [TOKEN_ID],
                last,
                "length" if last else None,
                len(request.prompt),
                i,
                arrival_time=now,
                first_scheduled_time=now,
                first_token_time=now,
                token_times=[now],
            )
            lines.append(encode(OutputLine(out)) + b"\n")
        return 200, b"application/x-ndjson", lines

    ok = {"status": "ready"}
    return {
        (b"POST", b"/internal/generate"): generate,
        (b"POST", b"/internal/abort"): lambda _: _json({"ok": True}),
        (b"GET", b"/internal/info"): lambda _: _json(info),
        (b"GET", b"/internal/stats"): lambda _: _json(stats),
        (b"GET", b"/healthz"): lambda _: _json(ok),
        (b"GET", b"/readyz"): lambda _: _json(ok),
        (b"GET", b"/metrics"): lambda _: (200, b"text/plain", b""),
    }


async def serve_upstreams(openai_port: int, replica_port: int) -> None:
    """The upstream process: both instant upstreams, until killed."""
    servers = [
        await serve_routes(openai_routes(), openai_port),
        await serve_routes(replica_routes(), replica_port),
    ]
    print("upstreams ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


# ---------------------------------------------------------------- the bare proxy


def bare_proxy_app(upstream: str, key: str) -> Litestar:
    """The floor for a Python gateway: bearer check, then pass the body and the answer
    through (streamed as it comes), no database, no accounting."""
    http = httpx.AsyncClient(
        base_url=upstream,
        timeout=httpx.Timeout(None, connect=2.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
    )
    expected = f"Bearer {key}"

    @post("/v1/chat/completions", status_code=200)
    async def chat(request: Request[Any, Any, Any]) -> Response[Any]:
        if request.headers.get("authorization") != expected:
            return Response({"error": {"message": "bad key", "type": "auth"}}, status_code=401)
        upstream_request = http.build_request(
            "POST",
            "/v1/chat/completions",
            content=await request.body(),
            headers={"content-type": "application/json"},
        )
        response = await http.send(upstream_request, stream=True)
        content_type = response.headers.get("content-type", "application/json")
        if content_type.startswith("text/event-stream"):
            return Stream(_relay(response), media_type=content_type)
        body = await response.aread()
        return Response(body, status_code=response.status_code, media_type=content_type)

    async def _relay(response: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for piece in response.aiter_raw():
                yield piece
        finally:
            await response.aclose()

    return Litestar([chat], openapi_config=None, logging_config=None)


def serve_bare_proxy(port: int, upstream: str, key: str) -> None:
    import uvicorn

    app = bare_proxy_app(upstream, key)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# ---------------------------------------------------------------- a lean load client
# httpx costs about as much CPU per request as the gateways measured here; this client
# (keep-alive connections, prepared request bytes) keeps the load generator cheap.


@dataclass
class Sample:
    ok: bool
    latency_s: float
    ttfb_s: float


def raw_request(path: str, body: dict[str, Any], headers: dict[str, str]) -> bytes:
    payload = json.dumps(body).encode()
    lines = [
        f"POST {path} HTTP/1.1",
        "host: 127.0.0.1",
        "content-type: application/json",
        f"content-length: {len(payload)}",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


class Client:
    """A pool of keep-alive connections to one port; one request per connection at once."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def send(self, request: bytes, due: float | None = None) -> Sample:
        """One request; its latency counts from `due` (open loop: when it should have
        been sent, so a late send is not hidden) or from now."""
        started = time.perf_counter() if due is None else due
        for attempt in range(2):  # a kept-alive connection the server closed: a new one
            reused = bool(self.idle) and attempt == 0
            try:
                reader, writer = self.idle.pop() if reused else await self._connect()
            except OSError:
                return Sample(False, time.perf_counter() - started, 0.0)
            try:
                writer.write(request)
                status, ttfb, keep = await asyncio.wait_for(
                    _read_response(reader, started), REQUEST_TIMEOUT_S
                )
            except (asyncio.IncompleteReadError, ConnectionError, TimeoutError) as exc:
                writer.close()
                if reused and not isinstance(exc, TimeoutError):
                    self.close()  # idle past the server's keep-alive: so are the others
                    continue
                return Sample(False, time.perf_counter() - started, 0.0)
            if keep:
                self.idle.append((reader, writer))
            else:
                writer.close()
            return Sample(status == 200, time.perf_counter() - started, ttfb)
        raise AssertionError("unreachable")

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return reader, writer

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


async def _read_response(reader: asyncio.StreamReader, started: float) -> tuple[int, float, bool]:
    """Read one whole response; (status, seconds to the first body bytes, keep-alive)."""
    head = (await reader.readuntil(b"\r\n\r\n")).lower()
    status = int(head[9:12])
    keep = b"connection: close" not in head
    if b"transfer-encoding: chunked" in head:
        ttfb = 0.0
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if not ttfb:
                ttfb = time.perf_counter() - started
            if size == 0:
                return status, ttfb, keep
    length = (
        int(head.split(b"content-length:")[1].split(b"\r\n")[0])
        if b"content-length:" in head
        else 0
    )
    await reader.readexactly(length)
    return status, time.perf_counter() - started, keep


# ---------------------------------------------------------------- processes


def _pin(cores: set[int]) -> Callable[[], None]:
    return lambda: os.sched_setaffinity(0, cores)


def other_cores() -> set[int]:
    cores = set(os.sched_getaffinity(0))
    return cores - {GATEWAY_CORE} or cores


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads), from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


@dataclass
class Processes:
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)
    folder: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="tg-overhead-")))

    def start(
        self, command: list[str], env: dict[str, str] | None = None, *, gateway: bool = False
    ) -> subprocess.Popen[bytes]:
        log = (self.folder / f"{len(self.started)}.log").open("wb")
        process = subprocess.Popen(
            command,
            env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_pin({GATEWAY_CORE} if gateway else other_cores()),
            cwd=ROOT,
        )
        self.started.append(process)
        return process

    def stop_all(self) -> None:
        for process in reversed(self.started):
            if process.poll() is None:
                process.terminate()
        for process in self.started:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
        shutil.rmtree(self.folder, ignore_errors=True)

    async def ready(
        self, process: subprocess.Popen[bytes], check: Callable[[], Awaitable[bool]], what: str
    ) -> None:
        """Wait for a process that is starting; its log in the error if it exits."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not await check():
            if process.poll() is not None:
                log = self.folder / f"{self.started.index(process)}.log"
                raise RuntimeError(f"{what} exited: {log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not come up within {STARTUP_TIMEOUT_S} s")
            await asyncio.sleep(0.1)  # polling, bounded by the deadline


def answers(url: str) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        try:
            async with httpx.AsyncClient(timeout=2) as http:
                return (await http.get(url)).status_code < 500
        except httpx.HTTPError:
            return False

    return check


# ---------------------------------------------------------------- targets


@dataclass
class Target:
    name: str
    port: int
    requests: dict[bool, bytes]  # stream? -> the prepared request
    baseline: str | None = None  # the direct upstream whose latency this one adds to
    pid: int | None = None  # the gateway process (CPU per request)
    client: Client = field(init=False)

    def __post_init__(self) -> None:
        self.client = Client(self.port)


def chat_requests(key: str | None, model: str = MODEL) -> dict[bool, bytes]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return {
        stream: raw_request(
            "/v1/chat/completions",
            {"model": model, "messages": MESSAGES, "max_tokens": TOKENS, "stream": stream},
            headers,
        )
        for stream in (False, True)
    }


def replica_requests() -> dict[bool, bytes]:
    """The replica protocol has no non-streaming form: both are the same NDJSON stream."""
    body = {"request_id": "bench", "prompt": PROMPT_IDS, "params": {"max_tokens": TOKENS}}
    request = raw_request("/internal/generate", body, {"x-tollgate-secret": BACKEND_SECRET})
    return {False: request, True: request}


async def start_tollgate(
    processes: Processes,
    name: str,
    upstream: str,
    upstreams: Upstreams,
    stack: dict[str, str],
    profile_to: Path | None = None,
) -> Target:
    """`tollgate serve` pinned to the gateway core, a plan with every limit on (high), a
    tenant on it and its key. `upstream` "openai": a registry model of kind openai on the
    instant OpenAI mock (priced, the only model the plan allows), so Tollgate's added
    latency is counted against the same upstream as the bare proxy's; "replica": the
    default entry, the instant Tollgate-protocol replica."""
    from tenants import keys

    admin, _ = keys.generate_key()
    port = free_port()
    data_dir = processes.folder / name
    env = {
        "TOLLGATE_DATA_DIR": str(data_dir),
        "TOLLGATE_DATABASE_URL": "",
        "TOLLGATE_REDIS_URL": "",
        **stack,
        "TOLLGATE_ADMIN_KEY": admin,
        # The default entry (a replica) either way: without one the gateway loads its own engine.
        "TOLLGATE_BACKENDS": upstreams.replica_url,
        "TOLLGATE_BACKEND_SECRET": BACKEND_SECRET,
        "TOLLGATE_PORT": str(port),
        "TOLLGATE_DRAIN_S": "1",
    }
    tollgate = [str(Path(sys.executable).parent / "tollgate"), "serve"]
    if profile_to is not None:
        tollgate = [
            sys.executable,
            "-m",
            "pyinstrument",
            "-r",
            "pyisession",
            "-o",
            str(profile_to),
            "-i",
            "0.0005",
            *tollgate,
        ]
    process = processes.start(tollgate, env, gateway=True)
    base = f"http://127.0.0.1:{port}"
    await processes.ready(process, answers(f"{base}/readyz"), f"tollgate serve ({name})")
    if upstream == "openai":
        key = await _tenant_key(base, admin, OPENAI_MODEL, upstreams.openai_url)
        requests, baseline = chat_requests(key, OPENAI_MODEL), "direct openai mock"
    else:
        key = await _tenant_key(base, admin)
        requests, baseline = chat_requests(key), "direct replica"
    await processes.ready(process, _serves(port, requests[False]), f"{name}'s model")
    return Target(name, port, requests, baseline=baseline, pid=process.pid)


async def _tenant_key(
    base: str, admin: str, model: str | None = None, upstream_url: str | None = None
) -> str:
    """A plan, a tenant on it and its key; with `model`, first that model in the registry
    (kind openai, on `upstream_url`), its price, and the plan allowing it alone."""
    from backend.builtin import BUILTIN_MODEL_DIR

    auth = {"Authorization": f"Bearer {admin}"}
    plan: dict[str, Any] = {"name": "bench", "rpm": 10**9, "tpm": 10**9,
            "max_concurrent": 10**5, "monthly_budget_micros": 10**12,
            "max_tokens_per_request": 4096}  # fmt: skip
    steps: list[tuple[str, dict[str, Any]]] = []
    if model is not None:
        registered = {"name": model, "kind": "openai", "targets": [{"url": upstream_url}],
                      "tokenizer": str(BUILTIN_MODEL_DIR), "upstream_model": MODEL,
                      "context_length": 2048}  # fmt: skip
        price = {"model": model, "input_micros_per_mtok": 100_000,
                 "cached_input_micros_per_mtok": 50_000,
                 "output_micros_per_mtok": 400_000}  # fmt: skip
        steps += [("/admin/api/models", registered), ("/admin/api/prices", price)]
        plan["allowed_models"] = [model]
    tenant = {"name": "bench", "plan": "bench"}
    steps += [("/admin/api/plans", plan), ("/admin/api/tenants", tenant),
              ("/admin/api/tenants/bench/keys", {})]  # fmt: skip
    async with httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as http:
        for path, body in steps:
            response = await http.post(path, json=body)
            if response.status_code >= 300:
                raise RuntimeError(f"{path}: {response.status_code} {response.text}")
    return str(response.json()["key"])


def _serves(port: int, request: bytes) -> Callable[[], Awaitable[bool]]:
    """The gateway answers the bench's request (a registry model is served a few seconds
    after it is added: the directory's refresh)."""

    async def check() -> bool:
        client = Client(port)
        try:
            return (await client.send(request)).ok
        finally:
            client.close()

    return check


def prepare_postgres() -> str:
    """An empty, migrated database of the bench's own on the shared PostgreSQL."""
    import sqlalchemy

    from tenants import db

    server = sqlalchemy.create_engine(
        db.sync_url(PG_URL.rsplit("/", 1)[0] + "/postgres"), isolation_level="AUTOCOMMIT"
    )
    with server.connect() as connection:
        exists = connection.execute(
            sqlalchemy.text("SELECT 1 FROM pg_database WHERE datname = 'tollgate_bench_overhead'")
        ).first()
        if not exists:
            connection.execute(sqlalchemy.text("CREATE DATABASE tollgate_bench_overhead"))
    server.dispose()
    db.reset_schema(PG_URL)
    db.upgrade(PG_URL)
    return PG_URL


async def start_redis(processes: Processes) -> str:
    port = free_port()
    redis = processes.start(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
    )
    from redis.asyncio import Redis

    async def pong() -> bool:
        client = Redis(port=port, socket_connect_timeout=0.5)
        try:
            return bool(await client.ping())
        except Exception:  # redis' ConnectionError while it starts
            return False
        finally:
            await client.aclose()

    await processes.ready(redis, pong, "redis-server")
    return f"redis://127.0.0.1:{port}/0"


BENCH = [sys.executable, "-m", "bench.gateway_overhead"]


@dataclass(frozen=True)
class Upstreams:
    openai_port: int
    replica_port: int

    @property
    def openai_url(self) -> str:
        return f"http://127.0.0.1:{self.openai_port}"

    @property
    def replica_url(self) -> str:
        return f"http://127.0.0.1:{self.replica_port}"


async def start_upstreams(processes: Processes) -> Upstreams:
    """Both instant upstreams in one process off the gateway core."""
    upstreams = Upstreams(free_port(), free_port())
    process = processes.start(
        [*BENCH, "--serve-upstreams", str(upstreams.openai_port), str(upstreams.replica_port)]
    )
    await processes.ready(process, answers(f"{upstreams.replica_url}/healthz"), "upstreams")
    return upstreams


async def start_targets(processes: Processes, args: argparse.Namespace) -> list[Target]:
    upstreams = await start_upstreams(processes)
    proxy_port = free_port()
    proxy_key = "bench-" + secrets.token_hex(8)
    proxy = processes.start(
        [*BENCH, "--serve-proxy", str(proxy_port), upstreams.openai_url, proxy_key], gateway=True
    )
    targets = [Target("direct openai mock", upstreams.openai_port, chat_requests(None))]
    if args.tollgate_upstream == "replica":
        targets.append(Target("direct replica", upstreams.replica_port, replica_requests()))
    targets.append(
        Target("bare proxy", proxy_port, chat_requests(proxy_key), "direct openai mock", proxy.pid)
    )
    await processes.ready(proxy, _proxy_answers(proxy_port), "the bare proxy")
    targets.append(
        await start_tollgate(processes, "tollgate embedded", args.tollgate_upstream, upstreams, {})
    )
    if not args.skip_stack:
        stack = await start_stack(processes)
        targets.append(
            await start_tollgate(
                processes, "tollgate pg+redis", args.tollgate_upstream, upstreams, stack
            )
        )
    return targets


async def start_stack(processes: Processes) -> dict[str, str]:
    """The environment of a Tollgate on PostgreSQL (a fresh database) and Redis."""
    return {
        "TOLLGATE_DATABASE_URL": prepare_postgres(),
        "TOLLGATE_REDIS_URL": await start_redis(processes),
    }


def _proxy_answers(port: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        try:
            async with httpx.AsyncClient(timeout=2) as http:
                response = await http.post(f"http://127.0.0.1:{port}/v1/chat/completions")
                return response.status_code == 401
        except httpx.HTTPError:
            return False

    return check


# ---------------------------------------------------------------- measurements


@dataclass
class Cell:
    samples: list[Sample] = field(default_factory=list)
    cpu_s: float = 0.0

    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.ok]

    def latency(self, q: float) -> float:
        return percentile([s.latency_s for s in self.ok()] or [float("nan")], q)

    def ttfb(self, q: float) -> float:
        return percentile([s.ttfb_s for s in self.ok()] or [float("nan")], q)

    @property
    def errors(self) -> int:
        return len(self.samples) - len(self.ok())


async def closed_loop(
    target: Target, concurrency: int, stream: bool, requests: int, cell: Cell
) -> None:
    """`concurrency` workers, each sending its share one after another."""
    request = target.requests[stream]
    cpu_before = cpu_seconds(target.pid) if target.pid else 0.0

    async def worker() -> None:
        for _ in range(max(1, requests // concurrency)):
            cell.samples.append(await target.client.send(request))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    if target.pid:
        cell.cpu_s += cpu_seconds(target.pid) - cpu_before


async def open_loop(target: Target, rate: float, seconds: float, seed: int) -> Cell:
    """Poisson arrivals at `rate`/s for `seconds`, latency counted from each arrival."""
    rng, cell, tasks = random.Random(seed), Cell(), []
    request = target.requests[False]

    async def one(due: float) -> None:
        cell.samples.append(await target.client.send(request, due))

    due = started = time.perf_counter()
    while due - started < seconds:
        due += rng.expovariate(rate)
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(due)))
    await asyncio.gather(*tasks)
    return cell


def sustains(cell: Cell) -> bool:
    total = len(cell.samples)
    return total > 0 and cell.errors / total < ERROR_LIMIT and cell.latency(99) <= P99_LIMIT_S


async def highest_rate(
    target: Target, seconds: float, steps: int, most_rounds: int = 40
) -> tuple[float, float, str]:
    """Grow the rate by 1.5x while it is sustained, then bisect between the last good and
    the first bad rate for `steps` more rounds. Returns the rate, the share of its core
    the gateway was busy at it (well below 100%: something else on the machine set the
    limit), and the steps."""
    good, busy_at_good, bad, rate, log = 0.0, 0.0, None, 20.0, []
    for step in range(most_rounds):
        cpu_before, started = cpu_seconds(target.pid) if target.pid else 0.0, time.perf_counter()
        cell = await open_loop(target, rate, seconds, seed=step)
        busy = (cpu_seconds(target.pid) - cpu_before if target.pid else 0.0) / (
            time.perf_counter() - started
        )
        passed = sustains(cell)
        log.append(
            f"{rate:.0f}:{'ok' if passed else 'no'}(p99 {cell.latency(99) * 1e3:.0f}ms,"
            f" err {cell.errors}, core {busy:.0%})"
        )
        if passed:
            good, busy_at_good = rate, busy
        else:
            bad = rate
        if bad is None:
            rate *= 1.5
        elif steps == 0 or (good and bad / good < 1.08):
            break
        else:
            steps -= 1
            rate = (good + bad) / 2 if good else bad / 2
        target.client.close()  # a fresh pool: the last step's backlog is gone
    return good, busy_at_good, " ".join(log)


@dataclass
class Plan:
    rounds: int
    requests: dict[int, int]  # concurrency -> requests per round
    rate_seconds: float
    rate_steps: int  # bisection rounds after the first rate that fails
    rate_rounds: int = 40  # rates tried at most
    flushes: int = 200  # disk flushes timed, before and after the c=1 cells


PLANS = {
    "dry": Plan(
        rounds=1, requests={1: 8, 16: 16}, rate_seconds=0.5, rate_steps=0, rate_rounds=1, flushes=5
    ),
    "quick": Plan(rounds=3, requests={1: 100, 16: 320}, rate_seconds=3.0, rate_steps=2),
    "full": Plan(rounds=6, requests={1: 300, 16: 960}, rate_seconds=8.0, rate_steps=4),
}


def disk_flush_ms(folder: Path, count: int) -> list[float]:
    """What one durable row costs at least: `count` fdatasyncs of a 4 KiB overwrite in a
    preallocated file in `folder` (no block allocation, as in a reused WAL), 1 ms apart."""
    path, page, times = folder / "flush-probe", os.urandom(4096), []
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(descriptor, bytes(64 * 4096))
        os.fsync(descriptor)
        for i in range(count):
            started = time.perf_counter()
            os.pwrite(descriptor, page, (i % 64) * 4096)
            os.fdatasync(descriptor)
            times.append((time.perf_counter() - started) * 1e3)
            time.sleep(0.001)  # paced as rows are, not back to back
    finally:
        os.close(descriptor)
        path.unlink()
    return times


async def measure(targets: list[Target], plan: Plan, folder: Path) -> dict[str, Any]:
    by_name = {t.name: t for t in targets}
    cells: dict[tuple[str, int, bool], Cell] = {}
    for target in targets:  # warm: connections, caches, the gateways' first requests
        await closed_loop(target, 16, False, 64, Cell())
    flushes = disk_flush_ms(folder, plan.flushes)
    for concurrency in (1, 16):
        if concurrency == 16:  # after the c=1 cells: the disk may have moved meanwhile
            flushes += disk_flush_ms(folder, plan.flushes)
        for stream in (False, True):
            for _ in range(plan.rounds):  # interleaved: every target once per round
                for target in targets:
                    cell = cells.setdefault((target.name, concurrency, stream), Cell())
                    await closed_loop(target, concurrency, stream, plan.requests[concurrency], cell)
    rows = []
    for (name, concurrency, stream), cell in cells.items():
        target = by_name[name]
        base = cells[(target.baseline, concurrency, stream)] if target.baseline else None
        rows.append(
            {
                "target": name,
                "concurrency": concurrency,
                "stream": stream,
                "requests": len(cell.samples),
                "errors": cell.errors,
                "p50_ms": cell.latency(50) * 1e3,
                "p99_ms": cell.latency(99) * 1e3,
                "added_p50_ms": (cell.latency(50) - base.latency(50)) * 1e3 if base else None,
                "added_p99_ms": (cell.latency(99) - base.latency(99)) * 1e3 if base else None,
                "ttfb_p50_ms": cell.ttfb(50) * 1e3,
                "cpu_ms_per_request": cell.cpu_s * 1e3 / len(cell.samples) if target.pid else None,
            }
        )
    rates = {}
    for target in targets:
        if target.baseline is None:
            continue
        rate, busy, log = await highest_rate(
            target, plan.rate_seconds, plan.rate_steps, plan.rate_rounds
        )
        rates[target.name] = {"sustained_rps": rate, "core_busy": busy, "steps": log}
    flush = {"p50_ms": percentile(flushes, 50), "p90_ms": percentile(flushes, 90)}
    return {"rows": rows, "sustained": rates, "disk_flush": flush}


def report(result: dict[str, Any], header: str) -> None:
    print(header)
    print(
        f"{'target':<20} {'c':>3} {'stream':>6} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} "
        f"{'+p99 ms':>8} {'ttfb50':>7} {'cpu ms/req':>10} {'err':>4}"
    )

    def cell(value: float | None, width: int) -> str:
        return f"{value:>{width}.2f}" if value is not None else f"{'-':>{width}}"

    for row in sorted(result["rows"], key=lambda r: (r["concurrency"], r["stream"])):
        print(
            f"{row['target']:<20} {row['concurrency']:>3} {row['stream']!s:>6} "
            f"{row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f} {cell(row['added_p50_ms'], 8)} "
            f"{cell(row['added_p99_ms'], 8)} {row['ttfb_p50_ms']:>7.2f} "
            f"{cell(row['cpu_ms_per_request'], 10)} {row['errors']:>4}"
        )
    print("\nsustained non-streaming rate (Poisson, p99 <= 500 ms, < 1% errors, one core):")
    for name, rate in result["sustained"].items():
        print(
            f"  {name:<20} {rate['sustained_rps']:7.0f} req/s, its core {rate['core_busy']:.0%}"
            f" busy   [{rate['steps']}]"
        )
    added = {
        r["target"]: r["added_p50_ms"]
        for r in result["rows"]
        if r["concurrency"] == 1 and not r["stream"] and r["added_p50_ms"] is not None
    }
    floor, floor_rate = added["bare proxy"], result["sustained"]["bare proxy"]["sustained_rps"]
    print("\ntargets (issue 19): added p50 at c=1 <= 1.5x the bare proxy's; rate >= 60% of its")
    for name in (n for n in added if n.startswith("tollgate")):
        rate = result["sustained"][name]["sustained_rps"]
        print(
            f"  {name:<20} added p50 {added[name]:.2f} ms = {added[name] / floor:.2f}x "
            f"(bare {floor:.2f} ms); rate {rate:.0f} = {rate / max(floor_rate, 1e-9):.0%} "
            f"of {floor_rate:.0f} req/s"
        )
    flush = result["disk_flush"]
    print(
        f"\ndisk flush (fdatasync of a 4 KiB write in the gateways' data folder, same run): "
        f"p50 {flush['p50_ms']:.2f} ms, p90 {flush['p90_ms']:.2f} ms. Every Tollgate request "
        "at c=1 waits for one (its row on disk before its answer); the bare proxy for none."
    )
    print("  diagnostic, not the target: added p50 less one flush p50, against the bare proxy")
    for name in (n for n in added if n.startswith("tollgate")):
        beyond = added[name] - flush["p50_ms"]
        print(f"  {name:<20} {beyond:.2f} ms = {beyond / floor:.2f}x")


# ---------------------------------------------------------------- profile


async def profile(processes: Processes, args: argparse.Namespace, plan: Plan) -> None:
    """Tollgate (embedded, or on PostgreSQL + Redis with --profile-stack) under
    pyinstrument through a closed-loop load phase; prints the functions with the most self
    time and the request path's call tree."""
    upstreams = await start_upstreams(processes)
    session_file = Path(args.profile_out)
    session_file.parent.mkdir(parents=True, exist_ok=True)
    stack = await start_stack(processes) if args.profile_stack else {}
    target = await start_tollgate(
        processes,
        "tollgate pg+redis" if stack else "tollgate embedded",
        args.tollgate_upstream,
        upstreams,
        stack,
        profile_to=session_file,
    )
    # --profile-c1: the target's own cell (non-streamed, one at a time), where the
    # request path's CPU is the latency; else c=16, half streamed.
    concurrency, streams = (1, (False,)) if args.profile_c1 else (16, (False, True))
    requests = plan.requests[16] * plan.rounds
    started = time.perf_counter()
    for stream in streams:
        await closed_loop(target, concurrency, stream, requests, Cell())
    elapsed = time.perf_counter() - started
    print(f"profiled {len(streams) * requests} requests at c={concurrency} in {elapsed:.1f} s")
    gateway = processes.started[-1]
    gateway.terminate()
    gateway.wait(timeout=60)
    summarize_profile(session_file, top=args.top)


# The process's own frames around every request: not the request path.
_ENTRY_POINTS = frozenset(
    {
        "main (gateway/cli/__init__.py)",
        "main (gateway/cli/commands.py)",
        "_serve (gateway/cli/commands.py)",
        "serve (gateway/cli/serve.py)",
    }
)
# Starting and stopping (imports, the app, migrations, the engine's connection): left out.
_START_UP = frozenset(
    {
        "<module> (gateway/cli/commands.py)",
        "<module> (gateway/cli/serve.py)",
        "create_app (gateway/app.py)",
        "_migrate_or_explain (gateway/cli/serve.py)",
        "lifespan (gateway/app.py)",
    }
)


def summarize_profile(path: Path, top: int) -> None:
    """Three views of the main thread's time serving (start-up left out): self time by
    library, inclusive time of Tollgate's own functions, and the call tree."""
    from pyinstrument.renderers import ConsoleRenderer
    from pyinstrument.session import Session

    session = Session.load(str(path))
    root = session.root_frame()
    if root is None:
        raise SystemExit("the profile is empty")
    by_library: dict[str, float] = {}
    inclusive: dict[str, float] = {}
    startup = 0.0
    stack: list[tuple[Any, frozenset[str]]] = [(root, frozenset())]
    while stack:
        frame, above = stack.pop()
        label = f"{frame.function} ({_short(frame.file_path)})"
        if label in _START_UP:
            startup += frame.time
            continue
        library = _library(frame.file_path, frame.function)
        by_library[library] = by_library.get(library, 0.0) + frame.total_self_time
        if library in ("gateway", "tenants") and label not in above | _ENTRY_POINTS:
            inclusive[label] = inclusive.get(label, 0.0) + frame.time
        children = [c for c in frame.children if not c.is_synthetic]  # counted in the parent
        stack.extend((child, above | {label}) for child in children)
    idle = by_library.pop("idle (epoll)", 0.0)
    busy = max(sum(by_library.values()), 1e-9)
    print(f"\nmain thread: {busy:.1f} s busy serving ({idle:.1f} s idle, {startup:.1f} s start-up)")
    print("self time by library, % of busy:")
    for library, seconds in sorted(by_library.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {100 * seconds / busy:5.1f}%  {library}")
    print("Tollgate's functions, inclusive time, % of busy:")
    for label, seconds in sorted(inclusive.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {100 * seconds / busy:5.1f}%  {label}")
    print(
        ConsoleRenderer(
            unicode=False,
            color=False,
            short_mode=True,
            processor_options={"filter_threshold": 0.02},
        ).render(session)
    )


def _library(path: str | None, function: str) -> str:
    if function in ("epoll.poll", "select"):
        return "idle (epoll)"
    if not path:
        return "other"
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1].split("/", 1)[0].removesuffix(".py")
    for package in ("gateway", "tenants", "backend"):
        if f"/{package}/" in path:
            return package
    if "<built-in>" in path:
        return "builtins (C calls: sockets, queues, json)"
    return "python stdlib (asyncio, ...)" if "/lib/python3" in path else "other"


def _short(path: str | None) -> str:
    if not path:
        return "?"
    for marker in ("site-packages/", "/gateway/", "/tenants/", "/backend/", "/lib/python3"):
        if marker in path:
            return (
                path.split(marker, 1)[1]
                if marker == "site-packages/"
                else marker.strip("/") + "/" + path.split(marker, 1)[1]
            )
    return path


# ---------------------------------------------------------------- main


async def run(args: argparse.Namespace) -> dict[str, Any] | None:
    plan = PLANS["dry" if args.dry_run else "quick" if args.quick else "full"]
    if len(other_cores()) == len(os.sched_getaffinity(0)):
        print("warning: one core only; the gateways are not isolated from the load generator")
    os.sched_setaffinity(0, other_cores())
    processes = Processes()
    try:
        if args.profile:
            await profile(processes, args, plan)
            return None
        targets = await start_targets(processes, args)
        started = time.perf_counter()
        result = await measure(targets, plan, processes.folder)
        load = os.getloadavg()
        fronts = (
            "the same instant OpenAI-compatible mock as the bare proxy (a registry model of "
            "kind openai)"
            if args.tollgate_upstream == "openai"
            else "an instant Tollgate-protocol replica; the bare proxy an instant "
            "OpenAI-compatible mock"
        )
        header = (
            f"gateway overhead (--tollgate-upstream {args.tollgate_upstream}): Tollgate fronts "
            f"{fronts}; {TOKENS} tokens per answer; gateways pinned to core "
            f"{GATEWAY_CORE}; {os.cpu_count()} CPUs, load average {load[0]:.1f}; "
            f"{time.perf_counter() - started:.0f} s"
        )
        report(result, header)
        return result
    finally:
        processes.stop_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests, short rate steps")
    parser.add_argument("--dry-run", action="store_true", help="a few requests of everything")
    parser.add_argument("--skip-stack", action="store_true", help="no PostgreSQL + Redis Tollgate")
    parser.add_argument(
        "--tollgate-upstream",
        choices=["openai", "replica"],
        default="openai",
        help="what Tollgate fronts: the bare proxy's OpenAI mock (a registry model), or an "
        "instant Tollgate-protocol replica (the default entry)",
    )
    parser.add_argument("--profile", action="store_true", help="pyinstrument on Tollgate's path")
    parser.add_argument(
        "--profile-stack", action="store_true", help="--profile Tollgate on PostgreSQL + Redis"
    )
    parser.add_argument(
        "--profile-c1",
        action="store_true",
        help="--profile non-streamed requests one at a time (the c=1 target's cell)",
    )
    parser.add_argument(
        "--profile-out",
        default=str(ROOT / ".bench_cache" / "gateway_overhead.pyisession"),
        help="where --profile keeps its pyinstrument session (pyinstrument --load=FILE)",
    )
    parser.add_argument("--top", type=int, default=25, help="functions listed by --profile")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument(
        "--serve-upstreams",
        nargs=2,
        type=int,
        metavar=("OPENAI", "REPLICA"),
        help=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--serve-proxy", nargs=3, metavar=("PORT", "UPSTREAM", "KEY"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.serve_upstreams:
        asyncio.run(serve_upstreams(*args.serve_upstreams))
    elif args.serve_proxy:
        port, upstream, key = args.serve_proxy
        serve_bare_proxy(int(port), upstream, key)
    else:
        result = asyncio.run(run(args))
        if result is not None and args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
