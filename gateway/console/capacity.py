"""The console's Capacity page: each live replica's KV pool and headroom, and a what-if
form over the planner (backend/capacity) with two charts drawn as inline SVG."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

import httpx
from litestar import Controller, Request, Response, get
from litestar.di import NamedDependency

from backend.capacity.errors import CapacityInputError
from backend.capacity.model import DTYPE_BYTES
from backend.capacity.planner import Inputs, Plan, plan, show
from backend.capacity.presets import gpu_preset, gpu_presets, model_preset, model_presets
from backend.wire import SECRET_HEADER
from gateway.console.context import ConsolePage
from gateway.console.render import query_text
from gateway.dispatch.engine_client import IN_PROCESS, EngineClient, InProcessEngineClient
from gateway.dispatch.remote import RemoteEngineClient

POLL_TIMEOUT_S = 1.0
# Form fields, by the planner flag each one sets (errors name the flag).
FIELDS = {
    "--preset": ("model", "Model"),
    "--gpu": ("gpu", "GPU"),
    "--tensor-parallel": ("tp", "GPUs (tensor parallel)"),
    "--dtype": ("dtype", "Weights precision"),
    "--kv-dtype": ("kv_dtype", "KV cache precision"),
    "--context": ("context", "Context (tokens)"),
    "--rate": ("rate", "Rate (requests/s)"),
    "--output-tokens": ("output", "Output tokens"),
}


@dataclass(frozen=True)
class ReplicaCapacity:
    name: str
    model: str
    healthy: bool
    context: int  # max_model_len
    block_size: int
    blocks_total: int
    blocks_used: int
    blocks_free: int  # free or holding a reusable cached prefix
    bytes_per_block: int | None
    running: int
    waiting: int

    @property
    def blocks_per_sequence(self) -> int:
        return max(1, math.ceil(self.context / self.block_size))

    @property
    def max_sequences(self) -> int:
        """Sequences of the full context the whole pool holds."""
        return self.blocks_total // self.blocks_per_sequence

    @property
    def headroom(self) -> int:
        """More full-context sequences the free blocks hold now."""
        return self.blocks_free // self.blocks_per_sequence

    @property
    def used_fraction(self) -> float:
        return self.blocks_used / max(1, self.blocks_total)


def _in_process(client: InProcessEngineClient) -> ReplicaCapacity:
    from backend.engine.model_runner import kv_bytes_per_block

    engine = client.engine.engine
    stats = engine.stats()
    per_block = kv_bytes_per_block(engine.model_config, stats.block_size, engine.runner.kv_dtype)
    return ReplicaCapacity(
        name=IN_PROCESS,
        model=client.engine.model_name,
        healthy=client.is_ready(),
        context=engine.max_model_len,
        block_size=stats.block_size,
        blocks_total=stats.kv_blocks_total,
        blocks_used=stats.kv_blocks_used,
        blocks_free=stats.kv_blocks_free + stats.kv_blocks_cached,
        bytes_per_block=per_block,
        running=stats.num_running,
        waiting=stats.num_waiting,
    )


async def _remote(http: httpx.AsyncClient, url: str, client: RemoteEngineClient) -> ReplicaCapacity:
    down = ReplicaCapacity(
        url, client.model_name, False, client.max_model_len, 1, 0, 0, 0, None, 0, 0
    )
    try:
        stats_reply, kv_reply = await asyncio.gather(
            http.get(f"{url}/internal/stats"), http.get(f"{url}/internal/kv")
        )
        stats, kv = stats_reply.json(), kv_reply.json()
    except (httpx.HTTPError, ValueError):
        return down
    if stats_reply.status_code != 200 or not stats.get("running"):
        return down
    if kv_reply.status_code != 200:
        kv = {}
    total = int(stats.get("kv_blocks_total", 0))
    return ReplicaCapacity(
        name=url,
        model=str(kv.get("model", client.model_name)),
        healthy=True,
        context=int(kv.get("max_model_len", client.max_model_len)),
        block_size=int(stats.get("block_size", 16)),
        blocks_total=total,
        blocks_used=int(stats.get("kv_blocks_used", 0)),
        blocks_free=int(stats.get("kv_blocks_free", 0)) + int(stats.get("kv_blocks_cached", 0)),
        bytes_per_block=kv["tensor_bytes"] // max(1, total) if "tensor_bytes" in kv else None,
        running=int(stats.get("num_running", 0)),
        waiting=int(stats.get("num_waiting", 0)),
    )


async def live_replicas(client: EngineClient | None, secret: str | None) -> list[ReplicaCapacity]:
    """What each replica's engine reports now (remote ones polled on /internal/stats and
    /internal/kv with the backend secret)."""
    if isinstance(client, InProcessEngineClient):
        return [_in_process(client)]
    if isinstance(client, RemoteEngineClient):
        headers = {SECRET_HEADER: secret or ""}
        async with httpx.AsyncClient(headers=headers, timeout=POLL_TIMEOUT_S) as http:
            urls = [r.url for r in client.replicas]
            return list(await asyncio.gather(*(_remote(http, url, client) for url in urls)))
    return []


# -- the what-if form -------------------------------------------------------------------


@dataclass(frozen=True)
class WhatIf:
    model: str = "llama-3-8b"
    gpu: str = "H100-SXM"
    tp: str = "1"
    dtype: str = ""  # "": the checkpoint's
    kv_dtype: str = ""
    context: str = "8192"
    rate: str = ""
    output: str = ""

    @classmethod
    def from_query(cls, request: Request[Any, Any, Any]) -> WhatIf:
        given = {name: query_text(request, name) for name in cls.__dataclass_fields__}
        defaults = cls()
        return cls(
            **{
                k: v if k in request.query_params else getattr(defaults, k)
                for k, v in given.items()
            }
        )

    def inputs(self) -> Inputs:
        return Inputs(
            gpu=gpu_preset(self.gpu),
            arch=model_preset(self.model),
            tensor_parallel=_number(self.tp, "--tensor-parallel", int),
            dtype=self.dtype or None,
            kv_dtype=self.kv_dtype or None,
            context=_number(self.context, "--context", int),
            rate=_number(self.rate, "--rate", float) if self.rate else None,
            output_tokens=_number(self.output, "--output-tokens", int) if self.output else None,
        )


def _number(text: str, flag: str, kind: type[int] | type[float]) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise CapacityInputError(flag, f"{flag} must be a number, got {text!r}") from None


@dataclass(frozen=True)
class Chart:
    """A line chart in SVG coordinates: a polyline, a dot per point with its label, and
    the axes' tick labels."""

    title: str
    points: list[tuple[float, float, str]]  # x, y, label
    x_ticks: list[tuple[float, str]]
    y_ticks: list[tuple[float, str]]

    @property
    def polyline(self) -> str:
        return " ".join(f"{x:.1f},{y:.1f}" for x, y, _ in self.points)


WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 600, 180, 56, 12, 10, 26


def chart(title: str, data: list[tuple[int, float]], x_name: str, y_unit: str) -> Chart:
    """x evenly spaced (the x values are powers of two or so), y linear from zero."""
    top = max((y for _, y in data), default=1.0) or 1.0
    span = max(1, len(data) - 1)

    def sx(i: int) -> float:
        return LEFT + (WIDTH - LEFT - RIGHT) * i / span

    def sy(y: float) -> float:
        return TOP + (HEIGHT - TOP - BOTTOM) * (1 - y / top)

    points = [(sx(i), sy(y), f"{x_name} {x:,}: {y:,.0f} {y_unit}") for i, (x, y) in enumerate(data)]
    x_ticks = [(sx(i), _tokens(x)) for i, (x, _) in enumerate(data)]
    y_ticks = [(sy(v), _short(v)) for v in (0.0, top / 2, top)]
    return Chart(title, points, x_ticks, y_ticks)


def _short(value: float) -> str:
    for scale, unit in ((1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"


def _tokens(value: int) -> str:
    """Token counts as people write them: 512, 4k, 128k."""
    if value >= 1024 and value % 1024 == 0:
        return f"{value // 1024}k"
    return f"{value:,}"


def _doubling(low: int, high: int) -> list[int]:
    values = []
    v = low
    while v < high:
        values.append(v)
        v *= 2
    return [*values, high]


def charts(result: Plan) -> list[Chart]:
    cost, context = result.cost, result.context
    max_seqs = int(result.number("max_concurrent_sequences"))
    batches = _doubling(1, max_seqs)
    decode = [(b, b / cost.decode_step(b, context)) for b in batches]
    tokens = int(result.number("max_kv_tokens"))
    arch = result.inputs.arch
    longest = max(context, (arch.max_context if arch else None) or 0)
    contexts = [c for c in _doubling(512, longest) if tokens // c >= 1]
    concurrency = [(c, float(tokens // c)) for c in contexts]
    return [
        chart(
            f"Decode tokens/s against batch size (context {context:,})", decode, "batch", "tok/s"
        ),
        chart(
            "Max concurrent sequences against context length", concurrency, "context", "sequences"
        ),
    ]


class CapacityController(Controller):
    path = "/capacity"

    @get("/")
    async def capacity(self, ctx: NamedDependency[ConsolePage]) -> Response[str]:
        replicas = await live_replicas(ctx.engine_client, ctx.settings.backend_secret)
        form = WhatIf.from_query(ctx.request)
        result, error, field = None, None, None
        try:
            result = plan(form.inputs())
        except CapacityInputError as exc:
            field, label = FIELDS.get(exc.flag, ("", ""))
            error = str(exc).replace(exc.flag, label, 1) if label else str(exc)
        return ctx.render(
            "capacity.html",
            title="Capacity",
            replicas=replicas,
            form=form,
            models=model_presets(),
            gpus=gpu_presets(),
            dtypes=list(DTYPE_BYTES),
            result=result,
            lines=[(line, show(line)) for line in result.lines] if result else [],
            charts=charts(result) if result else [],
            error=error,
            error_field=field,
            status_code=400 if error else 200,
        )
