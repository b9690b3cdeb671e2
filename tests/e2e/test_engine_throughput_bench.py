"""bench/engine_throughput.py against a real `tollgate backend serve` (the built-in
model): its HTTP client reads the replica's typed stream and counts every token, and the
server it starts runs at the product's defaults."""

from __future__ import annotations

import argparse

import httpx
import pytest
import torch

from backend.builtin import BUILTIN_MODEL_DIR
from backend.config import EngineConfig
from backend.engine.engine import Engine
from backend.wire import SECRET_HEADER
from bench.engine_throughput import (
    SECRET,
    backend_server,
    engine_config,
    engine_floor,
    in_fresh_process,
    run_http,
    static_dtypes,
    static_in_own_process,
)
from gateway.settings import gateway_engine_defaults


def _defaults(threads: int) -> argparse.Namespace:
    """The bench's command line with no engine knob given."""
    return argparse.Namespace(
        threads=threads,
        kv_cache_bytes=None,
        max_num_seqs=None,
        max_num_batched_tokens=None,
        dtype="auto",
    )


@pytest.mark.e2e
def test_the_bench_streams_every_token_from_a_backend_at_the_product_defaults() -> None:
    config = engine_config(_defaults(threads=1))
    work = [(list(range(2, 40)), 5), (list(range(70, 90)), 3), (list(range(100, 300)), 7)]
    with backend_server(BUILTIN_MODEL_DIR, config) as server:
        kv = httpx.get(f"{server.url}/internal/kv", headers={SECRET_HEADER: SECRET}).json()
        rate = run_http(server, work, "bench-test", priority=5)
    assert rate.tokens == 5 + 3 + 7  # EOS ignored: exactly what each asked for
    defaults = gateway_engine_defaults()
    assert (kv["kv_cache_bytes"], kv["max_num_batched_tokens"]) == (
        defaults.kv_cache_bytes,
        defaults.max_num_batched_tokens,
    )
    steps = int(rate.note.split()[0])  # "<steps> steps, server ... CPU, ..."
    assert steps >= 7  # the longest request alone needs one step per token


@pytest.mark.e2e
def test_both_sides_sample_at_the_temperature_given_and_make_every_token() -> None:
    """--temperature: the engine's requests sample and generate() samples with no top-k
    (a sampled row that stopped early would flatter either side)."""
    work = [(list(range(2, 40)), 6), (list(range(70, 90)), 4)]
    with backend_server(BUILTIN_MODEL_DIR, engine_config(_defaults(threads=1))) as server:
        sampled = run_http(server, work, "bench-sampled", temperature=0.8)
    assert sampled.tokens == 6 + 4
    # In a process of its own, as the bench runs every static configuration.
    static = (work, 2, True, float("inf"), 0.8)
    rate = in_fresh_process(static_in_own_process, BUILTIN_MODEL_DIR, "float32", 1, static)
    assert rate.tokens == 6 + 4
    assert rate.note.startswith("1/1 batches")


def test_the_baseline_runs_in_the_engines_dtype_and_in_float32_each_once() -> None:
    """The strongest generate() may be either precision: on a CPU with AVX512-BF16 its
    bfloat16 rows ran 2.2x its float32 rows (bench/README.md), elsewhere float32 wins."""
    assert static_dtypes("engine,float32", torch.bfloat16) == [torch.bfloat16, torch.float32]
    assert static_dtypes("engine,float32", torch.float32) == [torch.float32]


def test_the_floor_counts_the_longest_request_and_every_prefill_and_leaves_no_work() -> None:
    """--floor: a bound from a lone decode step and each prompt's prefill alone, measured
    on the bench's engine, which is left with no work."""
    engine = Engine(BUILTIN_MODEL_DIR, EngineConfig(dtype="float32"))
    work = [(list(range(2, 40)), 5), (list(range(70, 90)), 9), (list(range(100, 300)), 3)]
    steps = engine.num_steps
    floor = engine_floor(engine, work, "floor-test")
    assert (floor.tokens, floor.longest) == (5 + 9 + 3, 9)
    assert engine.num_steps - steps == 33 + 3  # the lone request's steps, then one per prompt
    assert not engine.has_work()
    assert floor.lone_step_s > 0 and floor.prefill_s >= 0
    rate = floor.rate()
    assert rate.seconds == 9 * floor.lone_step_s + floor.prefill_s
    assert rate.note.startswith("a bound: 9 x ")
