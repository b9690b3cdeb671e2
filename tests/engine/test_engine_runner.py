"""The model runner's set-up: the start-up line, the device and dtype it resolves and the
KV budget it takes on a GPU (from a fake memory reading: there is no GPU here)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from backend.config import EngineConfig
from backend.engine.model_runner import ModelRunner
from backend.loader import load_model_config
from tests.engine.engine_support import make_engine


def test_start_line_names_device_dtype_kv_and_graphs(
    llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="backend.engine.engine"):
        engine = make_engine(llama_dir, num_kv_blocks=100, max_model_len=96, device="auto")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine:")]
    assert len(lines) == 1
    cfg = load_model_config(llama_dir)
    # K and V, per layer, per block of 4 slots, per KV head and dimension, float32.
    kv_bytes = 2 * cfg.num_layers * 100 * 4 * cfg.num_kv_heads * cfg.head_dim * 4
    for part in (
        "device=cpu",
        "dtype=float32",
        "attention=",
        "kv_blocks=100",
        f"kv_bytes={kv_bytes}",
        f"max_seqs_at_max_model_len={100 // (96 // 4)}",
        "max_model_len=96",
        "cuda_graphs=off",
    ):
        assert part in lines[0], (part, lines[0])
    assert engine.runner.device == torch.device("cpu")  # 'auto' without a GPU


def test_kv_budget_on_a_gpu_is_the_utilization_less_what_is_in_use(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gib = 2**30
    runner: ModelRunner = make_engine(llama_dir, kv_cache_bytes=3 * gib).runner
    assert runner._kv_budget() == 3 * gib  # the CPU: the configured bytes
    readings: list[torch.device] = []

    def mem_get_info(device: torch.device) -> tuple[int, int]:
        readings.append(device)
        return 30 * gib, 80 * gib  # free, total: 50 GiB in use (weights, context, others)

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(runner, "device", torch.device("cuda:0"))
    monkeypatch.setattr(runner, "config", EngineConfig(gpu_memory_utilization=0.9))
    assert runner._kv_budget() == 72 * gib - 50 * gib
    assert readings == [torch.device("cuda:0")]
    monkeypatch.setattr(runner, "config", EngineConfig(gpu_memory_utilization=0.5))
    assert runner._kv_budget() == 0  # more than half is in use already: no room for KV
