"""`tollgate capacity`: size a deployment from the seeds' formulas (backend/capacity);
`capacity plan` sizes a cluster through the simulator; `capacity check` measures the
running engine against the model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from backend.capacity.errors import CapacityInputError
from backend.capacity.model import DTYPE_BYTES, GIB

SHAPE_FLAGS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab")


def add_commands(commands: Any) -> None:
    """Register `capacity` (and its `plan` and `check`) on the CLI's subparsers."""
    capacity = commands.add_parser(
        "capacity",
        help="weights, KV budget, max concurrency, decode floor, TTFT (roofline formulas)",
        description="Each output line shows its formula with its inputs. Memory flags are "
        "GiB (2^30 bytes). Flags go after `plan` or `check` for those commands.",
    )
    model_flags(capacity)
    capacity.add_argument("--json", action="store_true", help="one JSON object")
    capacity.set_defaults(handler=_capacity)


def _count(text: str) -> int:
    """A parameter count: 6738415616, 7e9, 7B or 350M."""
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}.get(text[-1:].lower(), 1.0)
    number = text[:-1] if scale != 1.0 else text
    try:
        return int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count like 7e9 or 7B, got {text!r}") from None


def model_flags(p: argparse.ArgumentParser) -> None:
    model = p.add_argument_group("model (one of)")
    model.add_argument("--preset", help="a named architecture (e.g. llama-3-8b; see --list)")
    model.add_argument("--model-dir", type=Path, help="a Hugging Face folder with config.json")
    for name in SHAPE_FLAGS:
        model.add_argument(f"--{name.replace('_', '-')}", type=int, dest=name)
    model.add_argument("--params", type=_count, help="weights only (or override the count)")
    model.add_argument("--list", action="store_true", help="print the presets and exit")
    gpu = p.add_argument_group("GPU (a preset, or the three figures)")
    gpu.add_argument("--gpu", help="A10G, L4, A100-40GB, A100-80GB, H100-SXM, H200")
    gpu.add_argument("--gpu-memory-gb", type=float, help="GiB per GPU")
    gpu.add_argument("--bandwidth-tbs", type=float, help="HBM TB/s per GPU")
    gpu.add_argument("--tflops", type=float, help="dense TFLOP/s per GPU at the weights' dtype")
    gpu.add_argument("--tensor-parallel", type=int, default=1, metavar="N")
    mem = p.add_argument_group("precision and memory")
    mem.add_argument("--dtype", choices=list(DTYPE_BYTES), help="weights (default: checkpoint's)")
    mem.add_argument("--kv-dtype", choices=list(DTYPE_BYTES), help="KV cache (default: --dtype)")
    mem.add_argument("--context", type=int, help="tokens per sequence (default: model's)")
    mem.add_argument("--gpu-memory-utilization", type=float, help="as the engine: default 0.9")
    mem.add_argument("--activation-gb", type=float, help="GiB per GPU kept for activations")
    mem.add_argument("--margin-gb", type=float, help="GiB per GPU kept as a safety margin")
    load = p.add_argument_group("workload and efficiency")
    load.add_argument("--prompt-tokens", type=int, help="for prefill/TTFT (default: context)")
    load.add_argument("--output-tokens", type=int)
    load.add_argument("--rate", type=float, help="requests/s, for Little's law")
    load.add_argument("--duration-s", type=float, help="each request's time in the system")
    load.add_argument("--mfu", type=float, default=1.0, help="share of peak FLOP/s (default 1)")
    load.add_argument("--mbu", type=float, default=1.0, help="share of peak bandwidth (default 1)")
    load.add_argument("--step-overhead-ms", type=float, default=0.0)
    load.add_argument("--calibration", type=Path, help="factors saved by `capacity check --save`")


def plan_flags(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload, SLOs and cluster")
    w.add_argument("--trace", type=Path, help="JSON Lines arrivals (backend/sim/trace.py)")
    w.add_argument(
        "--class",
        dest="classes",
        action="append",
        default=[],
        metavar="SPEC",
        help="NAME:rate=R,prompt=LO-HI,output=LO-HI[,ttft=S][,itl=S] (repeatable)",
    )
    w.add_argument("--slo", action="append", default=[], metavar="NAME:ttft=S,itl=S")
    w.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--max-replicas", type=int, default=16)
    w.add_argument("--max-num-seqs", type=int, default=None, help="engine (default 64)")
    w.add_argument("--max-num-batched-tokens", type=int, default=None, help="engine (2048)")
    w.add_argument("--json", action="store_true")


def check_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="a running backend (TOLLGATE_BACKEND_SECRET); default: in-process")
    p.add_argument("--model", type=Path, help="in-process checkpoint (default: built-in)")
    p.add_argument("--device", default="cpu", help="in-process: cpu or cuda")
    p.add_argument("--save", type=Path, help="write the calibration here, for `plan`")
    p.add_argument("--json", action="store_true")


def _fail(exc: Exception) -> int:
    print(f"tollgate capacity: {exc}", file=sys.stderr)
    return 2


def inputs_from(args: argparse.Namespace) -> Any:
    """Planner inputs from the flags (imported late: the planner pulls in torch's loader)."""
    from backend.capacity.calibration import Calibration
    from backend.capacity.planner import Efficiency, Inputs

    efficiency = Efficiency(args.mfu, args.mbu, args.step_overhead_ms / 1000, "given (--mfu/--mbu)")
    if args.mfu == 1.0 and args.mbu == 1.0 and args.step_overhead_ms == 0.0:
        efficiency = Efficiency()
    if args.calibration:
        efficiency = Calibration.load(args.calibration).efficiency()
    return Inputs(
        gpu=_gpu(args),
        arch=_arch(args),
        params=args.params,
        tensor_parallel=args.tensor_parallel,
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
        context=args.context,
        gpu_memory_utilization=args.gpu_memory_utilization,
        activation_gib=args.activation_gb,
        margin_gib=args.margin_gb,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        rate=args.rate,
        duration_s=args.duration_s,
        efficiency=efficiency,
    )


def _arch(args: argparse.Namespace) -> Any:
    from backend.capacity.model import Architecture
    from backend.capacity.presets import model_from_dir, model_preset

    shape = {name: getattr(args, name) for name in SHAPE_FLAGS}
    given = [name for name, value in shape.items() if value is not None]
    sources = [f for f, on in (("--preset", args.preset), ("--model-dir", args.model_dir)) if on]
    if given:
        sources.append("the shape flags")
    if len(sources) > 1:
        raise CapacityInputError(sources[0], f"give one model, not {' and '.join(sources)}")
    if args.preset:
        return model_preset(args.preset)
    if args.model_dir:
        return model_from_dir(args.model_dir)
    if not given:
        return None
    return _shape(shape, given, Architecture)


def _shape(shape: dict[str, int | None], given: list[str], architecture: Any) -> Any:
    hidden, heads = shape["hidden"], shape["heads"]
    if shape["head_dim"] is None and hidden and heads and heads > 0:
        if hidden % heads:
            raise CapacityInputError(
                "--heads", f"--heads {heads} does not divide --hidden {hidden}"
            )
        shape["head_dim"] = hidden // heads
    if shape["kv_heads"] is None:
        shape["kv_heads"] = shape["heads"]
    missing = [f"--{n.replace('_', '-')}" for n, v in shape.items() if v is None]
    if missing:
        raise CapacityInputError(missing[0], f"an explicit model also needs {', '.join(missing)}")
    s: dict[str, int] = {name: int(value or 0) for name, value in shape.items()}
    return architecture(
        name="explicit",
        num_layers=s["layers"],
        hidden_size=s["hidden"],
        num_heads=s["heads"],
        num_kv_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        intermediate_size=s["intermediate"],
        vocab_size=s["vocab"],
    )


def _gpu(args: argparse.Namespace) -> Any:
    from backend.capacity.model import Hardware
    from backend.capacity.presets import gpu_preset

    figures = (args.gpu_memory_gb, args.bandwidth_tbs, args.tflops)
    if args.gpu:
        if any(f is not None for f in figures):
            raise CapacityInputError("--gpu", "--gpu or --gpu-memory-gb/--bandwidth-tbs/--tflops")
        return gpu_preset(args.gpu)
    if any(f is None for f in figures):
        raise CapacityInputError(
            "--gpu", "give --gpu, or all of --gpu-memory-gb, --bandwidth-tbs and --tflops"
        )
    memory, bandwidth, tflops = figures
    return Hardware("custom", memory * GIB, bandwidth * 1e12, tflops * 1e12, tflops * 1e12)


def _list() -> str:
    from backend.capacity.presets import gpu_preset, gpu_presets, model_preset, model_presets

    rows = ["MODEL\tPARAMS\tLAYERS\tHIDDEN\tHEADS\tKV HEADS\tCONTEXT"]
    for name in model_presets():
        a = model_preset(name)
        rows.append(
            f"{name}\t{a.param_count():,}\t{a.num_layers}\t{a.hidden_size}\t{a.num_heads}\t"
            f"{a.num_kv_heads}\t{a.max_context}"
        )
    rows.append("GPU\tMEMORY GiB\tHBM TB/s\tBF16 TFLOP/s\tFP8 TFLOP/s")
    for name in gpu_presets():
        g = gpu_preset(name)
        fp8 = f"{g.fp8_flops / 1e12:g}" if g.fp8_flops else "-"
        rows.append(
            f"{name}\t{g.memory_bytes / GIB:g}\t{g.hbm_bandwidth / 1e12:g}\t"
            f"{g.bf16_flops / 1e12:g}\t{fp8}"
        )
    return "\n".join(rows)


def _capacity(settings: object, args: argparse.Namespace) -> int:
    from backend.capacity.planner import format_plan, plan

    if args.list:
        print(_list())
        return 0
    try:
        result = plan(inputs_from(args))
    except CapacityInputError as exc:
        return _fail(exc)
    print(json.dumps(result.as_json(), indent=2) if args.json else format_plan(result))
    return 0
