"""Constrained decoding's cost to a batch, in process on the CPU: the engine's step time
for a decode batch of 16 requests where 1 is constrained by a JSON schema, against the
same batch with none constrained (target: at most 10% slower). Built-in model (4,096
tokens of BPE vocabulary: the mask work is large beside so small a forward pass, so
this is close to the worst case). Two engines, one per batch, step in alternation, so a
shared machine's load falls on both alike; the figures are medians of per-step times.

    .venv/bin/python -m bench.constrained_step [--rounds 6] [--steps 48] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from backend.builtin import BUILTIN_MODEL_DIR
from backend.config import EngineConfig
from backend.constraint import Constraint
from backend.engine.engine import Engine
from backend.requests import EngineRequest
from backend.sampling import SamplingParams

BATCH = 16
# Long enough that the constrained request is still generating at the last timed step.
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "items": {
            "type": "array",
            "items": {"type": "string", "maxLength": 20},
            "minItems": 200,
        },
    },
    "required": ["id", "items"],
}


def start_batch(engine: Engine, constrained: bool, steps: int, round_: int) -> None:
    """BATCH requests (the first constrained if asked), prefilled: the next steps decode."""
    for i in range(BATCH):
        constraint = (
            Constraint("json_schema", json.dumps(SCHEMA)) if constrained and i == 0 else None
        )
        params = SamplingParams(
            max_tokens=steps + 8, seed=round_ * BATCH + i, ignore_eos=True, constraint=constraint
        )
        engine.add_request(
            EngineRequest(f"Request {i} of round {round_}:", params, f"{round_}-{i}")
        )
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()


def timed_step(engine: Engine) -> float:
    started = time.perf_counter()
    outputs = engine.step()
    elapsed = time.perf_counter() - started
    assert len(outputs) == BATCH and not any(o.finished for o in outputs), "the batch shrank"
    return elapsed


def finish(engine: Engine) -> None:
    while engine.has_work():
        engine.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    config = EngineConfig(device="cpu", num_kv_blocks=512)
    engines = {False: Engine(BUILTIN_MODEL_DIR, config), True: Engine(BUILTIN_MODEL_DIR, config)}
    times: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(args.rounds + 1):  # round 0 warms up (and compiles the schema)
        for constrained, engine in engines.items():
            start_batch(engine, constrained, args.steps, round_)
        for _ in range(args.steps):
            for constrained, engine in engines.items():
                elapsed = timed_step(engine)
                if round_:
                    times[constrained].append(elapsed)
        for engine in engines.values():
            finish(engine)
    base, with_one = statistics.median(times[False]), statistics.median(times[True])
    print(f"in process, CPU ({args.threads} threads), built-in model, decode batch of {BATCH}")
    print(f"  unconstrained:        {base * 1e3:.3f} ms/step (median of {len(times[False])})")
    print(f"  1 of 16 JSON schema:  {with_one * 1e3:.3f} ms/step (median of {len(times[True])})")
    print(f"  ratio: {with_one / base:.3f} (target <= 1.10)")


if __name__ == "__main__":
    main()
