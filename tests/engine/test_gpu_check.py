"""bench/gpu_check.py --dry-run: every section on the CPU with tiny shapes, so the few
minutes of a GPU are not spent on a typo."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_dry_run_runs_every_section(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--dry-run", "--out", str(out)],
        cwd=ROOT,
        # The interpreter flag before anything imports triton: kernels on CPU tensors.
        env={**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    sections = json.loads(out.read_text())["sections"]
    has_kernels = importlib.util.find_spec("backend.kernels") is not None
    for name, entry in sections.items():
        expected = "skipped" if name == "kernels" and not has_kernels else "ok"
        assert entry["status"] == expected, (name, entry)
    assert list(sections) == [
        "build_1b",
        "kernels",
        "greedy_1b",
        "build_8b",
        "decode_8b",
        "decode_1b",
        "ttft_1b",
        "throughput_1b",
    ]
    if has_kernels:
        assert sections["kernels"]["failed"] == [], sections["kernels"]
    greedy = sections["greedy_1b"]
    assert greedy["exact"] == greedy["prompts"] == 4, greedy["rows"]  # float32: no ties
    for name in ("decode_8b", "decode_1b"):
        assert sections[name]["eager"]["tokens_per_s"] > 0
        assert sections[name]["graphs"]["status"].startswith("unavailable")  # no CUDA here
    ttft = sections["ttft_1b"]
    assert all(ttft[f"ttft_{n}"]["ms"] > 0 for n in (64, 256, 1024))
    throughput = sections["throughput_1b"]
    for n in (8, 16):
        assert throughput[f"engine_{n}"]["output_tokens"] > 0
        assert throughput[f"ratio_{n}"] > 0
    assert "greedy == transformers" in done.stdout and "16 concurrent" in done.stdout
