"""`tollgate capacity check` against the in-process engine on the built-in model: the
engine's real KV pool beside the planner's arithmetic, timed steps beside the roofline,
and the fit that turns them into a calibration for `plan`. (Timings on a shared CPU are
noisy; nothing here asserts a speed.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from backend.builtin import BUILTIN_MODEL_DIR
from backend.capacity.calibration import Calibration
from backend.capacity.check import (
    DECODE_BATCHES,
    PREFILL_LENGTHS,
    Sample,
    check_config,
    fit,
)
from backend.capacity.model import TORCH_NAMES
from backend.capacity.remote import check_remote_async
from backend.config import EngineConfig
from backend.engine.async_engine import AsyncEngine
from backend.server import create_backend_app
from backend.sim.cost import CostModel, GpuSpec, ModelSpec
from gateway.cli.commands import main
from tests.conftest import serving
from tests.engine.engine_support import builtin_kv_block


def test_check_reads_the_real_pool_times_steps_and_saves_a_calibration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "calibration.json"
    assert main(["capacity", "check", "--save", str(saved)]) == 0
    out = capsys.readouterr().out
    dtype, per_block = builtin_kv_block()  # what the check runs
    blocks = EngineConfig().kv_cache_bytes // per_block
    # The engine's block bytes and pool, each beside the planner's own arithmetic.
    assert f"KV block: 16 tokens, {per_block:,} B (planner: {per_block:,} B)" in out
    assert (
        f"KV pool: {blocks:,} blocks, {blocks * per_block:,} B in the cache tensor "
        f"(planner: {blocks:,} blocks" in out
    )
    assert "predicted ms" in out and "measured ms" in out
    name = TORCH_NAMES[str(dtype).removeprefix("torch.")]
    assert f"calibrated on cpu: a 1024x1024 {name} matmul" in out

    cal = Calibration.load(saved)
    shapes = [(p.kind, p.batch if p.kind == "decode" else p.tokens) for p in cal.points]
    assert shapes == [("decode", b) for b in DECODE_BATCHES] + [
        ("prefill", n) for n in PREFILL_LENGTHS
    ]
    assert all(p.measured_s > 0 for p in cal.points)
    assert cal.peak_flops > 0 and cal.hbm_bandwidth > 0
    assert cal.mean_abs_error <= cal.floor_error  # the fit never does worse than the floor


def test_check_of_a_folder_without_a_model_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["capacity", "check", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "config.json" in err and "\n" not in err


def test_the_fit_recovers_known_factors() -> None:
    """Step times made by a cost model with known factors come back out of the fit
    (to within the fine grids' steps)."""
    spec = ModelSpec(
        "m",
        50e6,
        num_layers=8,
        hidden_size=512,
        num_kv_heads=8,
        head_dim=64,
        bytes_per_param=4,
        kv_bytes_per_element=4,
    )
    floor = CostModel(spec, GpuSpec("dev", 1e12, 1e10, 1e9), mfu=1, mbu=1, step_overhead_s=0)
    truth = CostModel(
        spec, floor.gpu, mfu=0.4, mbu=0.6, step_overhead_s=0.003, seq_overhead_s=0.0002
    )
    shapes = [[(99, 1)] * b for b in (1, 8, 64)] + [[(0, n)] for n in (256, 1024, 4096)]
    samples = [
        Sample("decode" if c[0][1] == 1 else "prefill", len(c), 0, c, truth.step_time(c))
        for c in shapes
    ]
    fitted = fit(samples, floor)
    assert fitted.mfu == pytest.approx(0.4, rel=0.02)
    assert fitted.mbu == pytest.approx(0.6, rel=0.02)
    assert fitted.step_overhead_s == pytest.approx(0.003, rel=0.2)
    assert fitted.seq_overhead_s == pytest.approx(0.0002, rel=0.2)
    assert all(fitted.step_time(c) == pytest.approx(truth.step_time(c), rel=0.05) for c in shapes)


async def test_check_against_a_running_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real backend on loopback: its pool from /internal/info, its step times from the
    engine's token timestamps, through the CLI in its own thread (and event loop)."""
    engine = AsyncEngine.from_pretrained(BUILTIN_MODEL_DIR, check_config("cpu"))
    app = create_backend_app(engine, BUILTIN_MODEL_DIR, secret="s3cret")
    async with serving(app) as url:
        facts, peaks, cal = await check_remote_async(url, "s3cret")
        monkeypatch.setenv("TOLLGATE_BACKEND_SECRET", "wrong")
        code = await asyncio.to_thread(main, ["capacity", "check", "--url", url])
    stats = engine.stats()
    _, per_block = builtin_kv_block()  # what the check runs
    assert facts.bytes_per_block == facts.planner_bytes_per_block == per_block
    assert facts.num_blocks == stats.kv_blocks_total == facts.planner_num_blocks
    assert facts.kv_tensor_bytes == stats.kv_blocks_total * per_block
    assert facts.block_size == stats.block_size
    assert [p.kind for p in cal.points] == ["decode"] * 3 + ["prefill"] * 3
    assert all(p.measured_s > 0 for p in cal.points) and peaks.flops > 0
    assert cal.mean_abs_error <= cal.floor_error
    assert code == 2
    assert "--url" in capsys.readouterr().err
