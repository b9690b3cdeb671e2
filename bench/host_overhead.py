"""Host overhead per engine step at 256 running requests, in process, with async
scheduling off and on: where the host's time goes (scheduling, staging the step's
inputs, processing its outputs), beside the time of the whole step.

Every request decodes (prompts of 16 to 48 tokens, `--prompt` 32, EOS ignored, greedy) on a random
2-layer, 128-wide Llama with the bench models' 32,000-token vocabulary (host work does
not depend on the model's width; a small one keeps the CPU's forward pass short; `--wide`
takes the 8-layer, 512-wide bench Llama); only steps where all 256 rows decode are
measured, after one unreported warm-up run per mode. The
phases are timed by wrapping the engine's own methods:

- schedule: Scheduler.schedule
- prepare: the runner's step inputs (ids, positions, slots, lengths, block tables:
  ModelRunner._prepare) and sampling's (SamplingTensors.stage, _stage_logit_work)
- outputs: the scheduler's bookkeeping of the sampled tokens (update_from_output, or
  advance + resolve) and Engine._process_tokens (detokenize, stop checks, outputs)
- compute: the rest of ModelRunner.launch, forward pass and sampling (the GPU's share
  on a GPU; on this CPU it runs inline)

On the CPU the forward pass runs on the calling thread, so async scheduling cannot hide
the host's time here: what it can do on a GPU is read from the host figures (a step
becomes max(device, host) instead of device + host). Two runs in one process; in each,
the two engines (async off, on) step in turn, one step each, so a neighbour's load on a
shared machine falls on both alike.

    .venv/bin/python -m bench.host_overhead [--requests 256] [--steps 40] [--threads 1] [--wide]
        [--prompt 32] [--no-adaptive]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from backend.config import EngineConfig
from backend.engine.engine import Engine
from backend.layers.sampler import SamplingTensors
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from bench._common import CACHE, build_random_llama

PHASES = ("schedule", "prepare", "outputs", "compute", "step")


class Timers:
    """Seconds per phase within the current step."""

    def __init__(self) -> None:
        self.step: dict[str, float] = defaultdict(float)

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.step[phase] += time.perf_counter() - started

        setattr(owner, name, timed)


_ACTIVE: list[Timers] = []  # the timers of the engine stepping now


@contextmanager
def sampling_staging_timed() -> Iterator[None]:
    """SamplingTensors.stage is a static method: timed (for the engine stepping) for the
    run, then restored."""
    original = SamplingTensors.__dict__["stage"]
    stage: Callable[..., Any] = SamplingTensors.stage

    def timed(*args: Any) -> Any:
        started = time.perf_counter()
        try:
            return stage(*args)
        finally:
            _ACTIVE[-1].step["prepare"] += time.perf_counter() - started

    SamplingTensors.stage = staticmethod(timed)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        SamplingTensors.stage = original  # type: ignore[method-assign]


def instrument(engine: Engine) -> Timers:
    timers = Timers()
    timers.wrap(engine.scheduler, "schedule", "schedule")
    for name in ("update_from_output", "advance", "resolve"):
        timers.wrap(engine.scheduler, name, "outputs")
    timers.wrap(engine, "_process_tokens", "outputs")
    for name in ("_prepare", "_stage_logit_work"):
        timers.wrap(engine.runner, name, "prepare")
    timers.wrap(engine.runner, "launch", "launch")
    return timers


def one_step(engine: Engine, timers: Timers, num: int) -> dict[str, float] | None:
    """One step's phases in milliseconds; None unless all `num` rows decoded in it."""
    timers.step.clear()
    _ACTIVE.append(timers)
    started = time.perf_counter()
    engine.step()
    elapsed = time.perf_counter() - started
    _ACTIVE.pop()
    stats = engine.stats()
    if stats.step_decode_tokens != num or stats.step_prefill_tokens:
        return None  # still admitting, or a prefill in the step
    phase = {name: timers.step[name] * 1e3 for name in ("schedule", "prepare", "outputs")}
    phase["compute"] = (timers.step["launch"] - timers.step["prepare"]) * 1e3
    phase["step"] = elapsed * 1e3
    return phase


def measure(
    engines: dict[str, tuple[Engine, Timers]], num: int, steps: int, seed: int, prompt: int
) -> dict[str, dict[str, list[float]]]:
    """Per-mode, per-phase milliseconds of `steps` steps in which all `num` requests
    decode. The engines step in turn, one step each, so a neighbour's load on a shared
    machine falls on both alike."""
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=4 * steps + 64, temperature=0, ignore_eos=True)
    vocab = next(iter(engines.values()))[0].model_config.vocab_size
    prompts = []
    for _ in range(num):
        length = rng.randrange(prompt // 2, prompt * 3 // 2 + 1)
        prompts.append([rng.randrange(2, vocab) for _ in range(length)])
    ids = [f"r{seed}-{i}" for i in range(num)]
    for engine, _ in engines.values():
        for rid, ids_ in zip(ids, prompts, strict=True):
            engine.add_request(EngineRequest(ids_, params, rid))
    series: dict[str, dict[str, list[float]]] = {mode: defaultdict(list) for mode in engines}
    while min(len(s["step"]) for s in series.values()) < steps:
        for mode, (engine, timers) in engines.items():
            phase = one_step(engine, timers, num)
            if phase is not None and len(series[mode]["step"]) < steps:
                for name, ms in phase.items():
                    series[mode][name].append(ms)
    for engine, _ in engines.values():
        for rid in ids:
            engine.abort(rid)
        while engine.has_work():
            engine.step()
    return series


def report(label: str, series: dict[str, list[float]]) -> dict[str, float]:
    medians = {name: statistics.median(series[name]) for name in PHASES}
    host = medians["schedule"] + medians["prepare"] + medians["outputs"]
    cells = "  ".join(f"{name} {medians[name]:6.2f}" for name in PHASES)
    steps = len(series["step"])
    print(f"  {label:<22} {cells}  host {host:5.2f} ms  (medians of {steps})", flush=True)
    return {**medians, "host": host}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40, help="measured steps per run")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--wide", action="store_true", help="the 8-layer, 512-wide Llama")
    parser.add_argument(
        "--prompt", type=int, default=32, help="mean prompt tokens (from half to 1.5x)"
    )
    parser.add_argument(
        "--no-adaptive",
        dest="adaptive",
        action="store_false",
        help="no adaptive step budget (with long prompts it admits them at the floor, "
        "32 tokens a step, while the first ones decode)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.wide:
        model_dir = build_random_llama(CACHE / "llama-8x512")
    else:
        small = {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "intermediate": 256}
        model_dir = build_random_llama(CACHE / "llama-2x128", **small)
    longest = args.prompt * 3 // 2 + 4 * args.steps + 64
    blocks = args.requests * -(-longest // 16) + 64
    engines = {
        mode: Engine(
            model_dir,
            EngineConfig(
                max_num_seqs=args.requests,
                max_num_batched_tokens=max(2048, args.requests),
                num_kv_blocks=blocks,
                max_model_len=longest,
                max_waiting_tokens=2**30,
                adaptive_step_budget=args.adaptive,
                device="cpu",
                async_scheduling=mode,
            ),
        )
        for mode in ("off", "on")
    }
    timed = {mode: (engine, instrument(engine)) for mode, engine in engines.items()}
    print(
        f"host overhead per step, {args.requests} decoding rows, ms (in process, CPU):", flush=True
    )
    results: dict[str, list[dict[str, float]]] = defaultdict(list)
    with sampling_staging_timed():
        measure(timed, args.requests, 5, 0, args.prompt)  # warm-up: first-touch, allocator
        for run in (1, 2):
            series = measure(timed, args.requests, args.steps, run, args.prompt)
            for mode in engines:
                results[mode].append(report(f"run {run}, async {mode}", series[mode]))
    for run in (0, 1):
        off, on = results["off"][run], results["on"][run]
        print(
            f"  run {run + 1}: step async on / off {on['step'] / off['step']:.2f}; "
            f"host share of a synchronous step {off['host'] / off['step']:.0%}; "
            f"a GPU step: sync = device + {off['host']:.2f} ms, async = max(device, "
            f"{on['host']:.2f} ms)"
        )


if __name__ == "__main__":
    main()
