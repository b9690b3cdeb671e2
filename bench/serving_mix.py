"""Chat latency beside document and request floods, through the backend's HTTP API.

Starts a real backend server on loopback (the engine behind /internal/generate, default
EngineConfig but a 1 GiB KV pool) with the random 8-layer, 512-wide Llama built on the
CPU, once with the adaptive step budget (the default) and once with the static budget,
and runs the same phases against each:

    alone     a chat tenant: Poisson arrivals, 50-150-token prompts, 32-64 tokens out
    docs      the same chats beside a document tenant that keeps 8 requests of
              1,800-token prompts (16 tokens out) in flight
    burst     the chat tenant fires 16 requests at once, alone; then again 0.3 s after
              a third tenant fired 160 (10x) of the same size

It prints chat TTFT and inter-token gaps (p50/p90/p95/p99, measured by the client on the
streamed lines), the document tenant's prefill throughput (prompt tokens/s, from the
engine's counters), the burst's makespan, and the ratios the issue 15 targets are about.
Benchmark figures, not tests: on a shared machine they move from run to run.

The phases run against a `Target`: the HTTP API (`HttpTarget`, this script) or an
AsyncEngine in the caller's process (`EngineTarget`: bench/gpu_check.py's serving_mix_8b,
whose device image has no web stack). The traffic's sizes and durations are a `Mix`.

    .venv/bin/python -m bench.serving_mix [--quick] [--only adaptive|static]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, Collection, Iterator
from contextlib import aclosing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from bench._common import CACHE, build_random_llama, percentile

if TYPE_CHECKING:  # the HTTP client and the engine are imported where they are used
    import httpx

    from backend.engine.async_engine import AsyncEngine

SECRET_HEADER = "x-tollgate-secret"
VOCAB = 32000
PHASES = ("alone", "docs", "burst")
# Issue 15's targets: loaded / alone at most (TTFT p90, ITL p95, late makespan), and the
# adaptive budget's document throughput at least this share of the static budget's.
TARGETS = {"ttft_p90": 3.0, "itl_p95": 3.0, "makespan": 2.5, "doc_share": 0.8}


@dataclass(frozen=True)
class Mix:
    """The traffic of the phases: sizes, rates and durations."""

    seconds: float = 20.0  # each chat phase
    chat_rate: float = 1.0  # chats per second, Poisson
    chat_prompt: tuple[int, int] = (50, 150)
    chat_output: tuple[int, int] = (32, 64)
    docs_in_flight: int = 8
    doc_prompt: int = 1800
    doc_output: int = 16
    settle: float = 5.0  # seconds of document flood before the chats start
    burst: int = 16  # the late tenant's requests; the loud tenant fires 10x
    vocab: int = VOCAB
    seed: int = 0


@dataclass
class Timing:
    sent: float
    prompt_tokens: int = 0
    first: float | None = None
    tokens: list[float] = field(default_factory=list)  # receive time of each token
    done: float | None = None


@dataclass
class Phase:
    name: str
    chats: list[Timing]
    doc_tokens_per_s: float | None = None
    makespan_s: float | None = None
    fit: dict[str, Any] | None = None  # the engine's step-cost fit at the phase's end

    def ttft(self) -> list[float]:
        return [t.first - t.sent for t in self.chats if t.first is not None]

    def itl(self) -> list[float]:
        return [b - a for t in self.chats for a, b in zip(t.tokens, t.tokens[1:], strict=False)]

    def summary(self) -> dict[str, Any]:
        """The phase's figures, in milliseconds, for a JSON report."""
        ttft, itl = self.ttft(), self.itl()
        figures: dict[str, Any] = {
            "chats": len(self.chats),
            "ttft_ms": {f"p{q}": _ms(percentile(ttft, q)) for q in (50, 90, 95, 99)},
            "itl_ms": {f"p{q}": _ms(percentile(itl, q)) for q in (50, 95, 99)},
        }
        if self.doc_tokens_per_s is not None:
            figures["doc_prefill_tokens_per_s"] = round(self.doc_tokens_per_s, 1)
        if self.makespan_s is not None:
            figures["makespan_s"] = round(self.makespan_s, 3)
        if self.fit is not None:
            figures["step_cost_fit"] = self.fit
        return figures


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def latency_ratios(alone: Phase, loaded: Phase) -> dict[str, float]:
    """Chat TTFT p90 and inter-token p95 under load, as multiples of the same alone."""
    return {
        "ttft_p90": round(percentile(loaded.ttft(), 90) / percentile(alone.ttft(), 90), 2),
        "itl_p95": round(percentile(loaded.itl(), 95) / percentile(alone.itl(), 95), 2),
    }


def doc_share(adaptive: Phase, static: Phase) -> float:
    """The adaptive budget's document throughput as a share of the static budget's."""
    return round((adaptive.doc_tokens_per_s or 0) / (static.doc_tokens_per_s or 1), 3)


# -- where the requests go -------------------------------------------------------------


class Target(Protocol):
    def stream(
        self, request_id: str, tenant: str, prompt: list[int], max_tokens: int
    ) -> AsyncGenerator[int, None]:
        """Generates greedily, EOS ignored; yields the number of tokens of each delta."""
        ...

    async def stats(self) -> dict[str, Any]:
        """The engine's EngineStats, as a dict."""
        ...


class HttpTarget:
    """A backend server's HTTP API: POST /internal/generate, streamed NDJSON lines."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http

    async def stream(
        self, request_id: str, tenant: str, prompt: list[int], max_tokens: int
    ) -> AsyncGenerator[int, None]:
        import msgspec  # not on the device image: bench/gpu_check.py drives an EngineTarget

        from backend.wire import LINES, ErrorLine, GenerateBody

        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        body = msgspec.json.encode(GenerateBody(prompt, params, request_id, tenant=tenant))
        async with self.http.stream("POST", "/internal/generate", content=body) as response:
            async for line in response.aiter_lines():
                if not line:
                    continue
                out = LINES.decode(line)
                if isinstance(out, ErrorLine):
                    raise RuntimeError(f"{tenant}: {out.message}")
                yield len(out.output.token_ids)

    async def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = (await self.http.get("/internal/stats")).json()
        return stats


class EngineTarget:
    """An AsyncEngine in this process: no HTTP server, no serialisation, the same
    requests (priority 0, the tenant named)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def stream(
        self, request_id: str, tenant: str, prompt: list[int], max_tokens: int
    ) -> AsyncGenerator[int, None]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        outputs = self.engine.generate(EngineRequest(prompt, params, request_id, tenant=tenant))
        async with aclosing(outputs):  # leaving early aborts the request
            async for out in outputs:
                yield len(out.token_ids)

    async def stats(self) -> dict[str, Any]:
        return asdict(self.engine.stats())


# -- the server ------------------------------------------------------------------------


def serve(model_dir: Path, port: int, adaptive: bool) -> None:
    """The child process: one engine behind the backend app, until killed."""
    import uvicorn

    from backend.config import EngineConfig
    from backend.engine.async_engine import AsyncEngine
    from backend.server import create_backend_app

    config = EngineConfig(kv_cache_bytes=2**30, adaptive_step_budget=adaptive)
    engine = AsyncEngine.from_pretrained(model_dir, config)
    app = create_backend_app(engine, model_dir, os.environ["TOLLGATE_BACKEND_SECRET"])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def server(model_dir: Path, adaptive: bool) -> Iterator[tuple[str, str]]:
    port, secret = free_port(), secrets.token_hex(16)
    env = {**os.environ, "TOLLGATE_BACKEND_SECRET": secret}
    cmd = [sys.executable, "-m", "bench.serving_mix", "--serve", str(model_dir), str(port)]
    if not adaptive:
        cmd.append("--static")
    proc = subprocess.Popen(cmd, env=env)
    try:
        yield f"http://127.0.0.1:{port}", secret
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def wait_ready(client: httpx.AsyncClient) -> None:
    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            if (await client.get("/healthz")).status_code == 200:
                return
        await asyncio.sleep(0.5)
    raise RuntimeError("the backend did not come up")


# -- the client ------------------------------------------------------------------------


class Client:
    def __init__(self, target: Target, mix: Mix) -> None:
        self.target = target
        self.mix = mix
        self.rng = random.Random(mix.seed)
        self.count = 0

    def prompt(self, low: int, high: int) -> list[int]:
        vocab = self.mix.vocab
        return [self.rng.randrange(2, vocab) for _ in range(self.rng.randint(low, high))]

    async def generate(self, tenant: str, prompt: list[int], max_tokens: int) -> Timing:
        self.count += 1
        timing = Timing(time.monotonic(), len(prompt))
        deltas = self.target.stream(f"{tenant}-{self.count}", tenant, prompt, max_tokens)
        async with aclosing(deltas):  # a cancelled request is closed, hence aborted
            async for tokens in deltas:
                now = time.monotonic()
                timing.first = timing.first or (now if tokens else None)
                timing.tokens.extend([now] * tokens)
        timing.done = time.monotonic()
        return timing

    async def chat_stream(self) -> list[Timing]:
        """Poisson chat arrivals for the mix's seconds; waits for every chat to finish."""
        mix, tasks = self.mix, []
        end = time.monotonic() + mix.seconds
        while True:
            await asyncio.sleep(self.rng.expovariate(mix.chat_rate))
            if time.monotonic() >= end:
                break
            prompt = self.prompt(*mix.chat_prompt)
            out = self.rng.randint(*mix.chat_output)
            tasks.append(asyncio.create_task(self.generate("chat", prompt, out)))
        return list(await asyncio.gather(*tasks))

    async def documents(self, stop: asyncio.Event) -> None:
        """Keep the mix's documents in flight until `stop`."""
        mix = self.mix

        async def worker() -> None:
            while not stop.is_set():
                prompt = self.prompt(mix.doc_prompt, mix.doc_prompt)
                await self.generate("docs", prompt, mix.doc_output)

        workers = [asyncio.create_task(worker()) for _ in range(mix.docs_in_flight)]
        await stop.wait()
        for w in workers:
            w.cancel()  # closing the stream aborts the request in the engine
        await asyncio.gather(*workers, return_exceptions=True)

    async def burst(self, tenant: str, count: int) -> list[Timing]:
        jobs = [
            self.generate(tenant, self.prompt(32, 64), self.rng.randint(16, 32))
            for _ in range(count)
        ]
        return list(await asyncio.gather(*jobs))


async def beside_documents(client: Client) -> Phase:
    """The chats again, while the document tenant keeps its flood in flight."""
    stop = asyncio.Event()
    flood = asyncio.create_task(client.documents(stop))
    await asyncio.sleep(client.mix.settle)  # the flood is established
    before, started = await client.target.stats(), time.monotonic()
    chats = await client.chat_stream()
    after, elapsed = await client.target.stats(), time.monotonic() - started
    stop.set()
    await flood
    # The documents' share of the prompt tokens the engine computed meanwhile (the
    # prompts are random: no prefix-cache hits to subtract).
    prefill = after["total_prefill_tokens"] - before["total_prefill_tokens"]
    doc_prefill = prefill - sum(t.prompt_tokens for t in chats)
    fit = {k: after[k] for k in ("step_time_error_ratio", "step_cost_s", "step_prefill_budget")}
    return Phase("docs", chats, doc_tokens_per_s=doc_prefill / elapsed, fit=fit)


async def bursts(client: Client) -> list[Phase]:
    """The chat tenant's burst alone, then 0.3 s after a tenant that fired 10x as many."""
    count = client.mix.burst
    started = time.monotonic()
    alone = await client.burst("chat", count)
    phases = [Phase("burst alone", alone, makespan_s=time.monotonic() - started)]
    loud = asyncio.create_task(client.burst("flood", 10 * count))
    await asyncio.sleep(0.3)
    started = time.monotonic()
    late = await client.burst("chat", count)
    phases.append(Phase("burst + 10x", late, makespan_s=time.monotonic() - started))
    await loud
    return phases


async def run_phases(target: Target, mix: Mix, phases: Collection[str] = PHASES) -> list[Phase]:
    """The named phases (of PHASES), in that order, after a warm-up burst."""
    client = Client(target, mix)
    await client.burst("warm", 4)  # first requests pay one-time costs
    done = []
    if "alone" in phases:
        done.append(Phase("alone", await client.chat_stream()))
    if "docs" in phases:
        done.append(await beside_documents(client))
    if "burst" in phases:
        done.extend(await bursts(client))
    return done


async def over_http(base: str, secret: str, mix: Mix) -> list[Phase]:
    import httpx

    timeout = httpx.Timeout(600.0, connect=10.0)
    limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
    headers = {SECRET_HEADER: secret}
    async with httpx.AsyncClient(
        base_url=base, headers=headers, timeout=timeout, limits=limits
    ) as http:
        await wait_ready(http)
        return await run_phases(HttpTarget(http), mix)


def report(label: str, phases: list[Phase]) -> None:
    print(f"\n== {label}")
    print(f"{'phase':<13}{'n':>4}  TTFT p50/p90/p95/p99 ms      ITL p50/p95/p99 ms   other")
    for p in phases:
        ttft, itl = p.ttft(), p.itl()
        t = "/".join(f"{percentile(ttft, q) * 1000:.0f}" for q in (50, 90, 95, 99))
        i = "/".join(f"{percentile(itl, q) * 1000:.0f}" for q in (50, 95, 99))
        other = ""
        if p.doc_tokens_per_s is not None:
            other = f"documents {p.doc_tokens_per_s:.0f} prefill tok/s"
        if p.makespan_s is not None:
            other = f"makespan {p.makespan_s:.2f} s"
        print(f"{p.name:<13}{len(p.chats):>4}  {t:<28}{i:<21}{other}")
    by = {p.name: p for p in phases}
    ratios = latency_ratios(by["alone"], by["docs"])
    make = (by["burst + 10x"].makespan_s or 0) / (by["burst alone"].makespan_s or 1)
    print(
        f"ratios: chat TTFT p90 docs/alone {ratios['ttft_p90']:.2f}x "
        f"(target <= {TARGETS['ttft_p90']:g}), ITL p95 {ratios['itl_p95']:.2f}x "
        f"(target <= {TARGETS['itl_p95']:g}), late tenant makespan {make:.2f}x "
        f"(target <= {TARGETS['makespan']:g})"
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(Path(sys.argv[2]), int(sys.argv[3]), adaptive="--static" not in sys.argv)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 s chat phases, bursts of 8")
    parser.add_argument("--only", choices=("adaptive", "static"))
    parser.add_argument("--seconds", type=float, default=20.0, help="chat phase length")
    parser.add_argument("--chat-rate", type=float, default=1.0, help="chats per second")
    parser.add_argument("--burst", type=int, default=16, help="the late tenant's requests")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds of flood first")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.burst, args.settle = 10.0, 8, 3.0
    mix = Mix(
        seconds=args.seconds,
        chat_rate=args.chat_rate,
        burst=args.burst,
        settle=args.settle,
        seed=args.seed,
    )
    model_dir = build_random_llama(CACHE / "llama-8x512")
    results = {}
    for adaptive in (True, False):
        label = "adaptive" if adaptive else "static"
        if args.only not in (None, label):
            continue
        with server(model_dir, adaptive) as (base, secret):
            results[label] = asyncio.run(over_http(base, secret, mix))
        report(f"{label} step budget", results[label])
    if len(results) == 2:
        docs = {k: next(p for p in v if p.name == "docs") for k, v in results.items()}
        share = doc_share(docs["adaptive"], docs["static"])
        target = TARGETS["doc_share"]
        print(f"\ndocument throughput, adaptive / static: {share:.0%} (target >= {target:.0%})")


if __name__ == "__main__":
    main()
