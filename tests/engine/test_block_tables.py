"""The device block tables (backend/engine/block_tables.py), written by difference, equal
freshly built tables: for random changes of every kind, and after every step of an
engine run that preempts, hits the prefix cache and finishes requests."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from backend.engine.batch import ScheduledRequest
from backend.engine.block_tables import DeviceBlockTables
from backend.engine.engine import Engine
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from tests.engine.engine_support import make_engine

GREEDY = SamplingParams(max_tokens=1, temperature=0)


def _scheduled(request_id: str, blocks: list[int]) -> ScheduledRequest:
    return ScheduledRequest(request_id, [1], 0, list(blocks), GREEDY, True, [1], [])


def _row(tables: DeviceBlockTables, rows: list[int], i: int, n: int) -> list[int]:
    return tables.gather(torch.tensor(rows))[i, :n].tolist()


def test_random_changes_equal_a_fresh_table() -> None:
    rng = random.Random(7)
    tables = DeviceBlockTables(width=32, device=torch.device("cpu"), rows=2)
    live: dict[str, list[int]] = {}
    for step in range(300):
        for rid in list(live):
            op = rng.random()
            blocks = live[rid]
            if op < 0.4:
                live[rid] = [*blocks, rng.randrange(1000)]  # a new block
            elif op < 0.5 and blocks:
                live[rid] = blocks[: rng.randrange(len(blocks))]  # trimmed drafts
            elif op < 0.6:  # preempted, readmitted: a cached prefix, then other blocks
                keep = rng.randrange(len(blocks) + 1)
                live[rid] = blocks[:keep] + [rng.randrange(1000) for _ in range(rng.randrange(4))]
            elif op < 0.7:
                del live[rid]
                tables.release([rid])
        if rng.random() < 0.5 or not live:
            live[f"r{step}"] = [rng.randrange(1000) for _ in range(rng.randrange(1, 8))]
        live = {k: v[:32] for k, v in live.items()}
        reqs = [
            ScheduledRequest(k, [1], 0, list(v), GREEDY, True, [1], []) for k, v in live.items()
        ]
        rows, changes = tables.plan(reqs)
        assert len(set(rows)) == len(rows)
        tables.apply(torch.tensor(changes, dtype=torch.int64))
        for i, r in enumerate(reqs):
            assert _row(tables, rows, i, len(r.block_ids)) == r.block_ids
    assert tables.table.shape[0] > 2  # it grew past its first rows


def test_unchanged_rows_stage_nothing() -> None:
    tables = DeviceBlockTables(width=16, device=torch.device("cpu"))
    reqs = [_scheduled(f"r{i}", [i, i + 1]) for i in range(4)]
    assert len(tables.plan(reqs)[1]) == 4 * 2 * 3
    assert tables.plan(reqs)[1] == []
    grown = [_scheduled("r0", [0, 1, 9])]
    assert tables.plan(grown)[1] == [0, 2, 9]  # only the new entry


def _check_tables(engine: Engine) -> None:
    """Every running request's device row holds its blocks."""
    tables = engine.runner.block_tables
    for req in engine.scheduler.running:
        blocks = engine.block_manager.block_ids(req.request_id)
        row = tables._row_of.get(req.request_id)
        if row is not None and req.num_computed_tokens:
            assert tables.table[row, : len(blocks)].tolist() == list(blocks)


def test_engine_tables_match_after_every_step(llama_dir: Path) -> None:
    """A small pool (preemption), shared prefixes (cache hits), varied lengths."""
    engine = make_engine(llama_dir, block_size=16, num_kv_blocks=24, max_model_len=256)
    rng = random.Random(3)
    vocab = engine.model_config.vocab_size
    shared = [rng.randrange(2, vocab) for _ in range(40)]
    for i in range(12):
        own = [rng.randrange(2, vocab) for _ in range(rng.randrange(3, 60))]
        prompt = shared + own if i % 2 else own
        params = SamplingParams(max_tokens=rng.randrange(4, 40), temperature=0, ignore_eos=True)
        engine.add_request(EngineRequest(prompt, params, f"r{i}"))
    steps = 0
    while engine.has_work():
        engine.step()
        _check_tables(engine)
        steps += 1
    assert engine.stats().num_preemptions > 0
    assert engine.stats().prefix_cache_hits > 0
    assert steps > 20
