"""`tollgate capacity plan`: the simulator at increasing replica counts, checked against
the planner's own bounds (no replica count beats the prefill floor or the decode
throughput ceiling) and against itself (a saved trace replays to the same answer)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from backend.capacity.calibration import Calibration, Point
from backend.capacity.cluster import deal, parse_class
from backend.capacity.planner import Efficiency, Inputs, plan
from backend.capacity.presets import gpu_preset, model_preset
from backend.sim.trace import load_trace, make_trace, save_trace
from gateway.cli.commands import main

MODEL = ["--preset", "llama-3-8b", "--gpu", "H100-SXM"]
CHAT = "chat:rate=40,prompt=100-300,output=50-150,ttft=0.5,itl=0.05"
SHORT = ["--duration", "5", "--max-num-seqs", "32"]


def sizing(capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, dict[str, object]]:
    code = main(["capacity", "plan", *MODEL, *flags, "--json"])
    data: dict[str, object] = json.loads(capsys.readouterr().out)
    return code, data


def test_the_smallest_count_meets_every_slo_and_respects_the_throughput_ceiling(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, data = sizing(capsys, "--class", CHAT, *SHORT)
    assert code == 0
    counts: list[dict[str, object]] = data["counts"]  # type: ignore[assignment]
    smallest = data["smallest_replicas"]
    assert isinstance(smallest, int) and smallest > 1
    assert [c["replicas"] for c in counts] == list(range(1, smallest + 1))
    assert counts[-1]["meets_slos"] is True
    assert all(c["meets_slos"] is False for c in counts[:-1])
    # Lower bound from the planner: output tokens asked per second over what one replica
    # decodes at its batch limit (32) with the simulator's assumed efficiencies.
    i = Inputs(
        gpu_preset("H100-SXM"),
        model_preset("llama-3-8b"),
        context=300 + 150,
        efficiency=Efficiency(0.5, 0.8, 0.002),
    )
    ceiling = 32 / plan(i).cost.decode_step(32, 300)
    demand = 40 * 100  # requests/s x mean output tokens
    assert smallest >= math.ceil(demand / ceiling)
    last: dict[str, object] = counts[-1]
    assert 0 < float(last["kv_peak"]) <= 1  # type: ignore[arg-type]
    assert float(last["goodput_rps"]) > 0  # type: ignore[arg-type]


def test_a_ttft_slo_below_the_prefill_floor_is_never_met(
    capsys: pytest.CaptureFixture[str],
) -> None:
    floor = plan(
        Inputs(gpu_preset("H100-SXM"), model_preset("llama-3-8b"), prompt_tokens=100, context=400)
    ).number("prefill_s")
    strict = f"chat:rate=2,prompt=100-300,output=10-20,ttft={floor / 2},itl=1"
    assert (
        main(
            [
                "capacity",
                "plan",
                *MODEL,
                "--class",
                strict,
                "--duration",
                "3",
                "--max-replicas",
                "3",
            ]
        )
        == 1
    )
    captured = capsys.readouterr()
    assert "no count up to 3 meets every SLO" in captured.out
    assert "roofline model" in captured.out and "unchecked against measurement" in captured.out
    assert "[" + "#" * 30 + "] 3 of up to 3 replica counts simulated\n" in captured.err


def test_a_saved_trace_plans_like_the_classes_it_came_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stream, _ = parse_class(CHAT, 5.0)
    trace_file = tmp_path / "trace.jsonl"
    save_trace(make_trace([stream], seed=3), trace_file)
    loaded = load_trace(trace_file)
    assert [(a.time, a.prompt_tokens) for a in loaded] == [
        (a.time, a.prompt_tokens) for a in make_trace([stream], seed=3)
    ]
    _, from_classes = sizing(capsys, "--class", CHAT, "--seed", "3", *SHORT)
    _, from_trace = sizing(
        capsys, "--trace", str(trace_file), "--slo", "chat:ttft=0.5,itl=0.05", *SHORT
    )
    assert from_trace["smallest_replicas"] == from_classes["smallest_replicas"]
    assert from_trace["counts"] == from_classes["counts"]


def test_arrivals_are_dealt_once_each() -> None:
    stream, _ = parse_class(CHAT, 2.0)
    trace = make_trace([stream])
    parts = deal(trace, 3)
    assert sorted(a.request_id for p in parts for a in p) == sorted(a.request_id for a in trace)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_a_calibration_replaces_the_assumed_factors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cal = Calibration(
        "test device",
        "tollgate-tiny",
        1e12,
        1e11,
        0.25,
        0.5,
        0.004,
        "2026-12-01T00:00:00Z",
        [Point("decode", 1, 10, 0.001, 0.0045, 0.005)],
    )
    path = tmp_path / "cal.json"
    cal.save(path)
    assert Calibration.load(path) == cal
    _, data = sizing(
        capsys, "--class", CHAT, *SHORT, "--max-replicas", "1", "--calibration", str(path)
    )
    model: dict[str, dict[str, object]] = data["model"]  # type: ignore[assignment]
    used = {k: model["inputs"][k] for k in ("mfu", "mbu", "step_overhead_s")}
    assert used == {"mfu": 0.25, "mbu": 0.5, "step_overhead_s": 0.004}
    notes = " ".join(data["notes"])  # type: ignore[arg-type]
    assert "measured by `tollgate capacity check` on test device" in notes
    assert "the calibrated one 10%" in notes


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        (["--class", "chat:rate=1"], "--class"),
        (["--class", "chat:rate=1,prompt=9-3,output=1"], "--class"),
        ([], "--trace"),
        (["--class", CHAT, "--trace", "x.jsonl"], "--trace"),
        (["--class", CHAT, "--slo", "chat:p99=1"], "--slo"),
        (["--class", CHAT, "--max-replicas", "0"], "--max-replicas"),
    ],
)
def test_bad_plan_input_names_the_flag(
    capsys: pytest.CaptureFixture[str], flags: list[str], flag: str
) -> None:
    assert main(["capacity", "plan", *MODEL, *flags]) == 2
    assert flag in capsys.readouterr().err


def test_plan_needs_a_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capacity", "plan", "--params", "7e9", "--gpu", "L4", "--class", CHAT]) == 2
    assert "--params" in capsys.readouterr().err
