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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec

from backend.sampling import SamplingParams
from backend.wire import LINES, ErrorLine, GenerateBody
from bench._common import CACHE, build_random_llama, percentile

SECRET_HEADER = "x-tollgate-secret"
VOCAB = 32000


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

    def ttft(self) -> list[float]:
        return [t.first - t.sent for t in self.chats if t.first is not None]

    def itl(self) -> list[float]:
        return [b - a for t in self.chats for a, b in zip(t.tokens, t.tokens[1:], strict=False)]


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
def server(model_dir: Path, adaptive: bool) -> Any:
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
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            if (await client.get("/healthz")).status_code == 200:
                return
        await asyncio.sleep(0.5)
    raise RuntimeError("the backend did not come up")


# -- the client ------------------------------------------------------------------------


class Client:
    def __init__(self, http: httpx.AsyncClient, seed: int) -> None:
        self.http = http
        self.rng = random.Random(seed)
        self.count = 0

    def prompt(self, low: int, high: int) -> list[int]:
        return [self.rng.randrange(2, VOCAB) for _ in range(self.rng.randint(low, high))]

    async def generate(
        self, tenant: str, prompt: list[int], max_tokens: int, timing: Timing | None = None
    ) -> Timing:
        self.count += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        body = GenerateBody(f"{tenant}-{self.count}", prompt, params, tenant=tenant)
        timing = Timing(time.monotonic(), len(prompt))
        content = msgspec.json.encode(body)
        async with self.http.stream("POST", "/internal/generate", content=content) as response:
            async for line in response.aiter_lines():
                if not line:
                    continue
                out = LINES.decode(line)
                if isinstance(out, ErrorLine):
                    raise RuntimeError(f"{tenant}: {out.message}")
                now = time.monotonic()
                for _ in out.output.token_ids:
                    timing.first = timing.first or now
                    timing.tokens.append(now)
        timing.done = time.monotonic()
        return timing

    async def chat_stream(self, seconds: float, rate: float) -> list[Timing]:
        """Poisson chat arrivals for `seconds`; waits for every chat to finish."""
        tasks = []
        end = time.monotonic() + seconds
        while True:
            await asyncio.sleep(self.rng.expovariate(rate))
            if time.monotonic() >= end:
                break
            prompt = self.prompt(50, 150)
            tasks.append(
                asyncio.create_task(self.generate("chat", prompt, self.rng.randint(32, 64)))
            )
        return list(await asyncio.gather(*tasks))

    async def documents(self, in_flight: int, stop: asyncio.Event) -> None:
        """Keep `in_flight` 1,800-token documents running until `stop`."""

        async def worker() -> None:
            while not stop.is_set():
                await self.generate("docs", self.prompt(1800, 1800), 16)

        workers = [asyncio.create_task(worker()) for _ in range(in_flight)]
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

    async def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = (await self.http.get("/internal/stats")).json()
        return stats


async def run_phases(base: str, secret: str, args: argparse.Namespace) -> list[Phase]:
    timeout = httpx.Timeout(600.0, connect=10.0)
    limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
    headers = {SECRET_HEADER: secret}
    async with httpx.AsyncClient(
        base_url=base, headers=headers, timeout=timeout, limits=limits
    ) as http:
        await wait_ready(http)
        client = Client(http, args.seed)
        await client.burst("warm", 4)  # first requests pay one-time costs
        phases = [Phase("alone", await client.chat_stream(args.seconds, args.chat_rate))]

        stop = asyncio.Event()
        flood = asyncio.create_task(client.documents(8, stop))
        await asyncio.sleep(args.settle)  # the flood is established
        before, started = await client.stats(), time.monotonic()
        chats = await client.chat_stream(args.seconds, args.chat_rate)
        after, elapsed = await client.stats(), time.monotonic() - started
        stop.set()
        await flood
        # The documents' share of the prompt tokens the engine computed meanwhile (the
        # prompts are random: no prefix-cache hits to subtract).
        prefill = after["total_prefill_tokens"] - before["total_prefill_tokens"]
        doc_prefill = prefill - sum(t.prompt_tokens for t in chats)
        phases.append(Phase("docs", chats, doc_tokens_per_s=doc_prefill / elapsed))

        started = time.monotonic()
        alone = await client.burst("chat", args.burst)
        phases.append(Phase("burst alone", alone, makespan_s=time.monotonic() - started))
        loud = asyncio.create_task(client.burst("flood", 10 * args.burst))
        await asyncio.sleep(0.3)
        started = time.monotonic()
        late = await client.burst("chat", args.burst)
        phases.append(Phase("burst + 10x", late, makespan_s=time.monotonic() - started))
        await loud
        return phases


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
    alone, docs = by["alone"], by["docs"]
    ttft_ratio = percentile(docs.ttft(), 90) / percentile(alone.ttft(), 90)
    itl_ratio = percentile(docs.itl(), 95) / percentile(alone.itl(), 95)
    make = (by["burst + 10x"].makespan_s or 0) / (by["burst alone"].makespan_s or 1)
    print(
        f"ratios: chat TTFT p90 docs/alone {ttft_ratio:.2f}x (target <= 3), "
        f"ITL p95 {itl_ratio:.2f}x "
        f"(target <= 3), late tenant makespan {make:.2f}x (target <= 2.5)"
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
    model_dir = build_random_llama(CACHE / "llama-8x512")
    results = {}
    for adaptive in (True, False):
        label = "adaptive" if adaptive else "static"
        if args.only not in (None, label):
            continue
        with server(model_dir, adaptive) as (base, secret):
            results[label] = asyncio.run(run_phases(base, secret, args))
        report(f"{label} step budget", results[label])
    if len(results) == 2:
        docs = {k: next(p for p in v if p.name == "docs") for k, v in results.items()}
        share = (docs["adaptive"].doc_tokens_per_s or 0) / (docs["static"].doc_tokens_per_s or 1)
        print(f"\ndocument throughput, adaptive / static: {share:.0%} (target >= 80%)")


if __name__ == "__main__":
    main()
