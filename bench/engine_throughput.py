"""Throughput: this engine (continuous batching, paged KV, chunked prefill), in process
and through its HTTP API, against the strongest static baseline: transformers'
generate() on length-sorted and on arrival-order batches of 8, 16 and 32, the best of
the six reported. Same random 8-layer, 512-wide Llama, same long-tailed workload
(prompts of 32 to 1,536 tokens, outputs of 16 to 256, EOS ignored, greedy, or both sides
sampling at `--temperature` with no top-k/top-p filter), 32 and 128
requests, each workload drawn with its own seed so that no prompt is in a prefix cache.

Only the tokens each request asked for count as output; static batching also computes
padding and keeps generating for a batch's shorter requests until its longest is done,
which is what continuous batching avoids. The HTTP figure comes from a real
`tollgate backend serve` on loopback that this script starts, with every request
streamed at once by an httpx client in this process (on the same cores). The engine runs
with `tollgate backend serve`'s defaults (a user's settings) at --threads; each HTTP row
notes the server's steps and CPU seconds and this client's CPU seconds, so the cost of
the HTTP path can be read against the in-process engine's.

    .venv/bin/python -m bench.engine_throughput [--workloads 32,128] [--priorities 0,5]
        [--max-num-seqs N] [--max-num-batched-tokens N] [--kv-cache-bytes N] [--profile]
        [--floor]

--floor adds a bound to each workload's table: the best rate any schedule of the
engine's steps could reach on this machine (`Floor`), so a ratio target can be read
against what the hardware allows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import httpx
import msgspec
import torch

from backend.config import EngineConfig
from backend.engine.engine import Engine
from backend.loader import resolve_dtype
from backend.models.config import load_model_config
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from backend.wire import LINES, SECRET_HEADER, ErrorLine, GenerateBody
from bench._common import (
    CACHE,
    Workload,
    build_random_llama,
    generate_static,
    long_tailed,
    static_batches,
)
from gateway.settings import gateway_engine_defaults
from tests.e2e.processes import free_port

T = TypeVar("T")
SECRET = "bench-secret"  # for a loopback server this script starts and stops


def make_workload(num: int, max_prompt: int, max_output: int, seed: int, vocab: int) -> Workload:
    rng = random.Random(seed)
    work = []
    for _ in range(num):
        prompt_len = long_tailed(rng, 32, max_prompt, median=200, sigma=0.9)
        out_len = long_tailed(rng, 16, max_output, median=48, sigma=0.8)
        work.append(([rng.randrange(2, vocab) for _ in range(prompt_len)], out_len))
    return work


def sampling(max_tokens: int, temperature: float = 0.0) -> SamplingParams:
    """A request's sampling: greedy at 0 (the default), else plain temperature sampling."""
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True)


@dataclass(frozen=True)
class Rate:
    tokens: int
    seconds: float
    note: str = ""

    @property
    def per_s(self) -> float:
        return self.tokens / self.seconds


def off_main_thread(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on a worker thread, as `tollgate backend serve` steps its engine: torch
    on the main thread of this process ran 4-5x the CPU time per engine step (2 threads,
    a loaded machine: 0.32 s against 0.06 s for the same steps on a second thread), so
    every side is measured off it alike."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result()


def run_engine(
    engine: Engine, work: Workload, tag: str, priority: int = 0, temperature: float = 0.0
) -> Rate:
    steps, cpu = engine.num_steps, time.process_time()
    start = time.perf_counter()
    for i, (prompt, out_len) in enumerate(work):
        # The tag as tenant salts the prefix cache: no run reuses another's prompts.
        params = sampling(out_len, temperature)
        engine.add_request(
            EngineRequest(prompt, params, f"{tag}-{i}", priority=priority, tenant=tag)
        )
    tokens = 0
    while engine.has_work():
        tokens += sum(len(o.token_ids) for o in engine.step())
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    return Rate(tokens, elapsed, f"{engine.num_steps - steps} steps, {cpu:.1f} s CPU")


WARM_UP = list(range(2, 66))  # a prompt no workload shares a prefix with
BATCH_CLASS = 5  # no latency targets: a prompt alone is one step of the static budget


@dataclass(frozen=True)
class Floor:
    """A bound, not a run: the most any schedule of this engine's steps could reach on
    this machine. Every step costs at least a lone decode step (the weights are read
    once per step), the longest request needs one step per output token, and each
    prompt adds at least its prefill alone less one such step; decode rows beyond the
    first are counted free. So no scheduler does better than
    longest x lone step + sum(prefill alone - lone step)."""

    tokens: int  # the workload's output tokens
    longest: int  # its longest request's
    lone_step_s: float
    prefill_s: float

    def rate(self) -> Rate:
        seconds = self.longest * self.lone_step_s + self.prefill_s
        parts = f"{self.longest} x {self.lone_step_s * 1000:.1f} ms + {self.prefill_s:.1f} s"
        return Rate(self.tokens, seconds, f"a bound: {parts} of prefill")


def engine_floor(engine: Engine, work: Workload, tag: str) -> Floor:
    """Floor's parts, measured on `engine` (its prefix cache salted by `tag`)."""

    def steps_of(request_id: str, prompt: list[int], max_tokens: int) -> list[float]:
        engine.add_request(
            EngineRequest(
                prompt, sampling(max_tokens), request_id, priority=BATCH_CLASS, tenant=tag
            )
        )
        times = []
        while engine.has_work():
            started = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - started)
        return times

    lone = min(steps_of(f"{tag}-lone", [2, 3], 33)[1:])  # its decode steps
    prefills = (sum(steps_of(f"{tag}-{i}", prompt, 1)) for i, (prompt, _) in enumerate(work))
    return Floor(
        tokens=sum(out for _, out in work),
        longest=max(out for _, out in work),
        lone_step_s=lone,
        prefill_s=sum(max(0.0, prefill - lone) for prefill in prefills),
    )


def warm(engine: Engine) -> None:
    engine.add_request(EngineRequest(WARM_UP, sampling(4), "warm-up"))
    while engine.has_work():
        engine.step()


ENGINE_KNOBS = ("kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """What `tollgate backend serve` runs with by default (a user's settings), on the CPU
    with the issue's thread count; a knob given on this command line overrides its own."""
    given = {k: getattr(args, k) for k in ENGINE_KNOBS if getattr(args, k) is not None}
    defaults = gateway_engine_defaults()
    return replace(defaults, device="cpu", cpu_threads=args.threads, dtype=args.dtype, **given)


# -- through the HTTP API --------------------------------------------------------------


def server_flags(config: EngineConfig) -> list[str]:
    return [
        f"--kv-cache-bytes={config.kv_cache_bytes}",
        f"--max-num-seqs={config.max_num_seqs}",
        f"--max-num-batched-tokens={config.max_num_batched_tokens}",
        f"--cpu-threads={config.cpu_threads}",
        f"--dtype={config.dtype}",
        "--device=cpu",
    ]


@dataclass(frozen=True)
class Server:
    url: str
    pid: int

    def num_steps(self) -> int:
        reply = httpx.get(f"{self.url}/internal/stats", headers={SECRET_HEADER: SECRET})
        steps: int = reply.raise_for_status().json()["num_steps"]
        return steps


@contextmanager
def backend_server(model_dir: Path, config: EngineConfig) -> Iterator[Server]:
    """`tollgate backend serve` on a free loopback port, until the block ends."""
    port = free_port()
    env = {**os.environ, "TOLLGATE_BACKEND_SECRET": SECRET, "TOLLGATE_LOG_LEVEL": "warning"}
    args = ["backend", "serve", "--model", str(model_dir), "--port", str(port)]
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", *args, *server_flags(config)],
        env=env,
        stdout=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_healthy(url, process)
        yield Server(url, process.pid)
    finally:
        process.terminate()
        process.wait(timeout=60)


def _wait_until_healthy(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the backend exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)  # polling a process we started; no event to wait on
    raise RuntimeError("the backend did not become healthy in 180 s")


async def _stream_one(
    client: httpx.AsyncClient,
    url: str,
    rid: str,
    prompt: list[int],
    n: int,
    priority: int = 0,
    temperature: float = 0.0,
) -> int:
    tenant = rid.rsplit("-", 1)[0]  # the run's tag: salts the prefix cache
    params = sampling(n, temperature)
    body = msgspec.json.encode(GenerateBody(prompt, params, rid, priority, tenant))
    tokens = 0
    headers = {SECRET_HEADER: SECRET}
    async with client.stream(
        "POST", f"{url}/internal/generate", content=body, headers=headers
    ) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line:
                out = LINES.decode(line)
                if isinstance(out, ErrorLine):
                    raise RuntimeError(f"{rid}: {out.message}")
                tokens += len(out.output.token_ids)
    return tokens


async def _stream_all(
    server: Server, work: Workload, tag: str, priority: int, temperature: float
) -> Rate:
    limits = httpx.Limits(max_connections=len(work) + 4)
    url = server.url
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        await _stream_one(client, url, f"{tag}-warm", WARM_UP, 4)
        steps = server.num_steps()
        server_cpu, client_cpu = process_cpu_s(server.pid), time.process_time()
        start = time.perf_counter()
        counts = await asyncio.gather(
            *(
                _stream_one(client, url, f"{tag}-{i}", p, n, priority, temperature)
                for i, (p, n) in enumerate(work)
            )
        )
        elapsed = time.perf_counter() - start
    server_cpu = process_cpu_s(server.pid) - server_cpu
    client_cpu = time.process_time() - client_cpu
    steps = server.num_steps() - steps
    note = f"{steps} steps, server {server_cpu:.1f} s CPU, this client {client_cpu:.1f} s CPU"
    return Rate(sum(counts), elapsed, note)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc): the server's own cost."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_http(
    server: Server, work: Workload, tag: str, priority: int = 0, temperature: float = 0.0
) -> Rate:
    return asyncio.run(_stream_all(server, work, tag, priority, temperature))


# -- the static baseline ---------------------------------------------------------------


def load_static_model(model_dir: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.eval()


@torch.inference_mode()
def run_static(
    model: Any,
    work: Workload,
    batch_size: int,
    by_length: bool,
    budget_s: float,
    temperature: float = 0.0,
) -> Rate:
    """generate() on fixed batches. With a budget, the batches run in a shuffled order
    until it is spent, and the rate is over those done (a fair sample of all of them)."""
    batches = static_batches(work, batch_size, by_length)
    random.Random(batch_size).shuffle(batches)
    generate_static(model, [(WARM_UP, 2)], torch.device("cpu"))  # warm-up
    start, cpu, tokens, padded, done = time.perf_counter(), time.process_time(), 0, 0, 0
    for batch in batches:
        if time.perf_counter() - start > budget_s:
            break
        padded += generate_static(model, batch, torch.device("cpu"), temperature)
        tokens += sum(n for _, n in batch)
        done += 1
    useful = sum(len(p) + n for b in batches[:done] for p, n in b)
    note = f"{done}/{len(batches)} batches, {padded} padded slots for {useful} useful"
    note += f", {time.process_time() - cpu:.1f} s CPU"
    return Rate(tokens, time.perf_counter() - start, note)


# -- the report ------------------------------------------------------------------------


def line(label: str, rate: Rate, best: float | None = None) -> str:
    ratio = f"  {rate.per_s / best:5.2f}x best static" if best else ""
    figures = f"{rate.per_s:8.1f} tok/s ({rate.tokens} in {rate.seconds:6.1f} s; {rate.note})"
    return f"  {label:<40} {figures}{ratio}"


def profile_engine(model_dir: Path, config: EngineConfig, work: Workload) -> None:
    """The in-process engine under pyinstrument: where each step's time goes."""
    from pyinstrument import Profiler

    engine = Engine(model_dir, config)
    warm(engine)
    profiler = Profiler(interval=0.002)
    with profiler:
        rate = run_engine(engine, work, "profile")
    print(line("engine (profiled)", rate))
    print(profiler.output_text(unicode=False, color=False, show_all=False, short_mode=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="32,128", help="request counts, comma-separated")
    parser.add_argument("--static-batch-sizes", default="8,16,32")
    parser.add_argument(
        "--static-budget-s",
        type=float,
        default=float("inf"),
        help="time per static configuration (rate over the batches done)",
    )
    for knob in ENGINE_KNOBS:
        parser.add_argument(
            f"--{knob.replace('_', '-')}", type=int, help="default: `tollgate backend serve`'s"
        )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="the engine's (default: `tollgate backend serve`'s auto: bfloat16 on a CPU "
        "with AVX512-BF16 or AMX, else float32)",
    )
    parser.add_argument(
        "--static-dtypes",
        default="engine,float32",
        help="generate()'s dtypes, comma-separated, the best row of all counts "
        "(engine: the engine's dtype)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--priorities",
        default="0",
        help="request priorities to run the engine at, comma-separated (0: the interactive "
        "class, with its latency targets; 5: the batch class, none by default)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample every request (both sides) at this temperature; 0: greedy (default)",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also print the engine's floor: the best rate any schedule of its steps "
        "could reach here (a bound from a lone decode step and each prefill alone)",
    )
    parser.add_argument("--skip-static", action="store_true")
    parser.add_argument("--skip-http", action="store_true")
    parser.add_argument("--profile", action="store_true", help="profile the engine and stop")
    parser.add_argument(
        "--model", type=Path, help="checkpoint to profile (default: the random 8x512 Llama)"
    )
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model_dir = build_random_llama(CACHE / "llama-8x512")
    sizes = [int(n) for n in args.workloads.split(",")]
    works = {n: make_workload(n, 1536, 256, args.seed + n, 32000) for n in sizes}
    config = engine_config(args)
    print(f"engine: {', '.join(f'{k}={getattr(config, k)}' for k in ENGINE_KNOBS)}", flush=True)
    if args.profile:
        profiled = args.model or model_dir
        vocab = json.loads((profiled / "config.json").read_text())["vocab_size"]
        profile_engine(profiled, config, make_workload(sizes[0], 1536, 256, args.seed, vocab))
        return
    # generate() runs in processes of its own (in_fresh_process): in this one it left the
    # in-process engine at half speed afterwards (2x the CPU time for the same 261 steps).
    engine = Engine(model_dir, config)
    warm(engine)
    results: dict[int, dict[str, Rate]] = {n: {} for n in sizes}
    priorities = [int(p) for p in args.priorities.split(",")]
    with backend_server(model_dir, config) if not args.skip_http else _nothing() as server:
        for n in sizes:
            for p in priorities:
                tail = "" if p == 0 else f", priority {p}"
                tag = f"w{n}p{p}"
                sampled_at = args.temperature
                rate = off_main_thread(run_engine, engine, works[n], tag, p, sampled_at)
                rates = {f"engine in process{tail}": rate}
                if server:
                    http = run_http(server, works[n], tag, p, sampled_at)
                    rates[f"engine through the HTTP API{tail}"] = http
                if args.floor and p == priorities[0]:
                    floor = off_main_thread(engine_floor, engine, works[n], f"floor{n}")
                    rates["engine floor (in process, a bound)"] = floor.rate()
                for label, rate in rates.items():  # as they come: a run cut short keeps them
                    print(f"  ({n} requests) {line(label, rate)}", flush=True)
                results[n].update(rates)
    del engine
    if not args.skip_static:
        for dtype in static_dtypes(args.static_dtypes, engine_dtype(model_dir, config)):
            for n in sizes:
                results[n].update(run_statics(model_dir, works[n], args, dtype))
    for n in sizes:
        report(n, works[n], results[n], args.threads)


@contextmanager
def _nothing() -> Iterator[None]:
    yield None


def engine_dtype(model_dir: Path, config: EngineConfig) -> torch.dtype:
    return resolve_dtype(config.dtype, torch.device("cpu"), load_model_config(model_dir))


def in_fresh_process(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) in a new Python process: generate() measured after the engine in the
    same process ran at 0.73x its own rate alone (86 against 117 tok/s, same CPU
    seconds, one core left idle), and the engine after generate() at half speed, so no
    side runs where the other ran."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(fn, *args).result()


def static_in_own_process(
    model_dir: Path, dtype: str, threads: int, static_args: tuple[Any, ...]
) -> Rate:
    torch.set_num_threads(threads)
    model = load_static_model(model_dir, getattr(torch, dtype))
    return off_main_thread(run_static, model, *static_args)


def static_dtypes(names: str, engine: torch.dtype) -> list[torch.dtype]:
    """The baseline's dtypes, each once: "engine" is the engine's own."""
    dtypes = [engine if name == "engine" else getattr(torch, name) for name in names.split(",")]
    return list(dict.fromkeys(dtypes))


def run_statics(model_dir: Path, work: Workload, args: Any, dtype: torch.dtype) -> dict[str, Rate]:
    statics = {}
    short = str(dtype).removeprefix("torch.")
    for size in (int(s) for s in args.static_batch_sizes.split(",")):
        for by_length in (True, False):
            order = "sorted" if by_length else "arrival"
            label = f"static {short} {order} batches of {size}"
            budget = args.static_budget_s
            statics[label] = in_fresh_process(
                static_in_own_process,
                model_dir,
                short,
                args.threads,
                (work, size, by_length, budget, args.temperature),
            )
            print(f"  ({len(work)} requests) {line(label, statics[label])}", flush=True)
    return statics


def report(n: int, work: Workload, results: dict[str, Rate], threads: int) -> None:
    print(
        f"\n{n} requests: {sum(len(p) for p, _ in work)} prompt tokens "
        f"(max {max(len(p) for p, _ in work)}), {sum(k for _, k in work)} output tokens "
        f"(max {max(k for _, k in work)}); {threads} threads"
    )
    statics = {k: r for k, r in results.items() if k.startswith("static")}
    best = max((r.per_s for r in statics.values()), default=None)
    for label, rate in results.items():
        print(line(label, rate, None if label in statics else best))
    if best:
        print(f"  best static: {max(statics, key=lambda k: statics[k].per_s)}, {best:.1f} tok/s")


if __name__ == "__main__":
    main()
