"""bench/gpu_check.py --dry-run: every section on the CPU with tiny shapes, so the few
minutes of a GPU are not spent on a typo."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# The device image has torch, triton, transformers, safetensors, tokenizers and numpy,
# and none of these (issue 33: llguidance once failed the check at import there): the
# check runs with them unimportable (None in sys.modules), as it would there.
DEVICE_IMAGE_LACKS = ("llguidance", "msgspec", "litestar", "sqlalchemy", "psycopg", "uvicorn")
WITHOUT_WEB_STACK = f"""
import runpy, sys
sys.modules.update(dict.fromkeys({DEVICE_IMAGE_LACKS!r}))
runpy.run_module("bench.gpu_check", run_name="__main__", alter_sys=True)
"""


def test_the_dry_run_runs_every_section(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_WEB_STACK, "--dry-run", "--out", str(out)],
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
        "speculative_1b",
        "kv_quant_1b",
        "serving_mix_8b",
    ]
    if has_kernels:
        assert sections["kernels"]["failed"] == [], sections["kernels"]
    greedy = sections["greedy_1b"]
    assert greedy["exact"] == greedy["prompts"] == 4, greedy["rows"]  # float32: no ties
    environment = json.loads(out.read_text())["environment"]
    assert environment["copy_bytes_per_s"] > 0 and environment["hbm_peak_bytes_per_s"] is None
    for name in ("decode_8b", "decode_1b"):
        assert sections[name]["eager"]["tokens_per_s"] > 0
        assert sections[name]["eager"]["copy_fraction"] > 0
        assert sections[name]["eager"]["hbm_fraction"] is None  # a CPU has no vendor peak
        assert sections[name]["graphs"]["status"].startswith("unavailable")  # no CUDA here
    ttft = sections["ttft_1b"]
    assert all(ttft[f"ttft_{n}"]["ms"] > 0 for n in (64, 256, 1024))
    throughput = sections["throughput_1b"]
    for n in (8, 16):
        assert throughput[f"engine_{n}"]["output_tokens"] > 0
        assert throughput[f"ratio_{n}"] > 0
    steps = throughput["async"]
    assert steps["greedy_equal"] is True
    assert steps["off"]["step_ms"] > 0 and steps["on"]["step_ms"] > 0 and steps["speedup"] > 0
    spec = sections["speculative_1b"]
    assert spec["greedy_equal"] is True and spec["greedy_equal_draft"] is True
    assert spec["ngram"]["c8"]["tokens_per_s"] > 0 and spec["speedup_c1"] > 0
    assert spec["draft"]["c8"]["tokens_per_s"] > 0 and spec["speedup_c1_draft"] > 0
    assert spec["draft"]["tokens_per_step"] >= 1
    mix = sections["serving_mix_8b"]
    assert mix["api"].startswith("in-process")
    assert mix["mix"]["docs_in_flight"] == 8 and mix["mix"]["vocab"] == 512  # the tiny 8B
    assert mix["adaptive_engine"]["kv_blocks"] > 0 and mix["static_engine"]["kv_blocks"] > 0
    phases = [("adaptive", "alone"), ("adaptive", "docs"), ("static", "docs")]
    assert sorted(mix["adaptive"]) == ["alone", "docs"] and list(mix["static"]) == ["docs"]
    for budget, phase in phases:
        figures = mix[budget][phase]
        assert figures["chats"] > 0, (budget, phase)
        assert list(figures["ttft_ms"]) == ["p50", "p90", "p95", "p99"]
        assert list(figures["itl_ms"]) == ["p50", "p95", "p99"]
        assert 0 < figures["ttft_ms"]["p50"] <= figures["ttft_ms"]["p99"]
        assert 0 < figures["itl_ms"]["p50"] <= figures["itl_ms"]["p99"]
    for budget in ("adaptive", "static"):
        docs = mix[budget]["docs"]
        assert docs["doc_prefill_tokens_per_s"] > 0
        assert set(docs["step_cost_fit"]) == {
            "step_time_error_ratio",
            "step_cost_s",
            "step_prefill_budget",
        }
        assert set(mix["ratios"][budget]) == {"ttft_p90", "itl_p95"}
        assert all(r > 0 for r in mix["ratios"][budget].values())
    assert mix["ratios"]["doc_share"] > 0
    assert set(mix["targets_met"]) == {"ttft_p90", "itl_p95", "doc_share"}
    assert all(isinstance(met, bool) for met in mix["targets_met"].values())
    assert "greedy == transformers" in done.stdout and "16 concurrent" in done.stdout
    assert "8B mix adaptive: chat TTFT p90" in done.stdout
    assert "8B mix: document prefill tok/s" in done.stdout


def test_the_peak_bandwidth_is_the_devices_own() -> None:
    """Issue 33: 4.8 TB/s (H200) was hard-coded; an H100 SXM would have read 30% low."""
    from bench.gpu_check import hbm_peak

    assert hbm_peak("NVIDIA H100 80GB HBM3") == 3.35e12  # the SXM part's name
    assert hbm_peak("NVIDIA H200") == 4.8e12
    assert hbm_peak("NVIDIA H100 PCIe") == 2.0e12
    assert hbm_peak("NVIDIA H100 NVL") == 3.9e12
    assert hbm_peak("Tesla T4") is None


GPU_TESTS_ON_THE_DEVICE_IMAGE = f"""
import sys
sys.modules.update(dict.fromkeys({DEVICE_IMAGE_LACKS!r}))
import pytest
sys.exit(pytest.main(["tests/gpu", "--noconftest", "-q", "-p", "no:cacheprovider"]))
"""


def test_the_gpu_tests_collect_with_the_device_images_packages() -> None:
    """tests/gpu runs on the device as `python3 -m pytest tests/gpu --noconftest`: none of
    its imports may need the gateway's packages (here every test skips: no CUDA)."""
    done = subprocess.run(
        [sys.executable, "-c", GPU_TESTS_ON_THE_DEVICE_IMAGE],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert " skipped" in done.stdout and "error" not in done.stdout.lower(), done.stdout[-2000:]


def test_a_section_that_overruns_or_fails_keeps_what_it_measured() -> None:
    """Issue 33: an overrun section was recorded as a bare `timeout`, its figures lost."""
    from bench.gpu_check import SectionTimeout, _bounded

    def measures_then(failure: BaseException) -> Callable[[], dict[str, Any]]:
        def work() -> dict[str, Any]:
            partial["graphs"] = {"tokens_per_s": 123.0}
            raise failure

        return work

    partial: dict[str, Any] = {}
    entry = _bounded(measures_then(SectionTimeout()), 40.0, partial)
    assert entry == {"graphs": {"tokens_per_s": 123.0}, "status": "timeout", "budget_s": 40.0}
    entry = _bounded(measures_then(RuntimeError("CUDA error")), 40.0, partial)
    assert entry["status"] == "error" and entry["graphs"] == {"tokens_per_s": 123.0}
    assert entry["error"] == "RuntimeError: CUDA error"
