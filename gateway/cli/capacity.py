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
# The engine's --kv-cache-dtype: int8 / fp8 add a float32 scale per token and KV head.
KV_DTYPE_HELP = "KV cache (default: the compute dtype, bf16 under one-byte weights)"


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
    sub = capacity.add_subparsers(metavar="{plan,check}")
    plan = sub.add_parser(
        "plan",
        help="the fewest replicas meeting every SLO, by simulation",
        description="Runs the simulator (the real scheduler and block manager on a virtual "
        "clock, stepped by the roofline cost model) at 1, 2, ... replicas.",
    )
    model_flags(plan)
    plan_flags(plan)
    plan.set_defaults(handler=_plan)
    check = sub.add_parser(
        "check",
        help="time the engine's steps against the roofline; save the factors for `plan`",
    )
    check_flags(check)
    check.set_defaults(handler=_check)


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
    mem.add_argument("--kv-dtype", choices=list(DTYPE_BYTES), help=KV_DTYPE_HELP)
    mem.add_argument("--context", type=int, help="tokens per sequence (default: model's)")
    mem.add_argument("--gpu-memory-utilization", type=float, help="as the engine: default 0.9")
    mem.add_argument("--activation-gb", type=float, help="GiB per GPU kept for activations")
    mem.add_argument("--margin-gb", type=float, help="GiB per GPU kept as a safety margin")
    mem.add_argument(
        "--max-loras", type=int, default=0, help="LoRA adapter slots on the device (engine's)"
    )
    mem.add_argument(
        "--max-lora-rank", type=int, default=16, help="the rank each slot is sized for (16)"
    )
    load = p.add_argument_group("workload and efficiency")
    load.add_argument("--prompt-tokens", type=int, help="for prefill/TTFT (default: context)")
    load.add_argument(
        "--spec-tokens-per-step",
        type=float,
        help="speculative decoding: tokens "
        "per sequence per step (/metrics' tollgate_engine_spec_decode_tokens_per_step)",
    )
    load.add_argument("--num-speculative-tokens", type=int, default=4, help="drafts per step")
    load.add_argument("--output-tokens", type=int)
    load.add_argument("--rate", type=float, help="requests/s, for Little's law")
    load.add_argument("--duration-s", type=float, help="each request's time in the system")
    load.add_argument("--mfu", type=float, help="share of peak FLOP/s reached")
    load.add_argument("--mbu", type=float, help="share of peak bandwidth reached")
    load.add_argument("--step-overhead-ms", type=float, help="per engine step")
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
    p.add_argument("--gpu", help="--url: take the peaks from this GPU preset")
    p.add_argument("--model", type=Path, help="in-process checkpoint (default: built-in)")
    p.add_argument("--device", default="cpu", help="in-process: cpu or cuda")
    p.add_argument("--cpu-threads", type=int, default=1, help="in-process on the CPU (default 1)")
    p.add_argument("--kv-cache-dtype", default="auto", help="in-process: auto, int8 or fp8")
    p.add_argument("--save", type=Path, help="write the calibration here, for `plan`")
    p.add_argument("--json", action="store_true")


def _fail(exc: Exception) -> int:
    print(f"tollgate capacity: {exc}", file=sys.stderr)
    return 2


def _efficiency(args: argparse.Namespace, default: Any) -> Any:
    """--calibration, else the factors given (the rest from `default`), else `default`."""
    from backend.capacity.calibration import Calibration
    from backend.capacity.planner import Efficiency

    given = (args.mfu, args.mbu, args.step_overhead_ms)
    if args.calibration:
        if any(v is not None for v in given):
            raise CapacityInputError("--calibration", "--calibration or --mfu/--mbu, not both")
        return Calibration.load(args.calibration).efficiency()
    if all(v is None for v in given):
        return default
    mfu, mbu, overhead_ms = given
    return Efficiency(
        default.mfu if mfu is None else mfu,
        default.mbu if mbu is None else mbu,
        default.step_overhead_s if overhead_ms is None else overhead_ms / 1000,
        "given (--mfu, --mbu, --step-overhead-ms); not checked against measurement",
    )


def inputs_from(args: argparse.Namespace, default_efficiency: Any = None) -> Any:
    """Planner inputs from the flags (imported late: the planner pulls in torch's loader)."""
    from backend.capacity.planner import Efficiency, Inputs

    efficiency = _efficiency(args, default_efficiency or Efficiency())
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
        spec_tokens_per_step=args.spec_tokens_per_step,
        num_speculative_tokens=args.num_speculative_tokens,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
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


def _progress(done: int, most: int, finished: bool) -> None:
    """A bar on stderr, redrawn in place: replica counts simulated of at most `most`."""
    width = 30
    filled = width if finished else width * done // max(1, most)
    bar = "#" * filled + "." * (width - filled)
    end = "\n" if finished else ""
    print(f"\r[{bar}] {done} of up to {most} replica counts simulated", end=end, file=sys.stderr)
    sys.stderr.flush()


def _workload(args: argparse.Namespace) -> tuple[list[Any], dict[str, Any]]:
    """The trace and the SLOs per class, from --trace or --class, and --slo."""
    from backend.capacity.cluster import parse_class, parse_slo
    from backend.sim.trace import load_trace, make_trace

    slos = dict(parse_slo(spec) for spec in args.slo)
    classes = [parse_class(spec, args.duration) for spec in args.classes]
    if bool(args.trace) == bool(classes):
        raise CapacityInputError("--trace", "give --trace FILE or one or more --class")
    for stream, slo in classes:
        slos.setdefault(stream.name, slo)
    if classes:
        return make_trace([stream for stream, _ in classes], args.seed), slos
    try:
        return load_trace(args.trace), slos
    except (OSError, ValueError) as exc:
        raise CapacityInputError("--trace", f"--trace: {exc}") from None


def _plan(settings: object, args: argparse.Namespace) -> int:
    from backend.capacity.cluster import size_cluster
    from backend.capacity.planner import Efficiency, plan
    from backend.config import MAX_NUM_SEQS_BY_DEVICE, EngineConfig
    from backend.sim.cost import CostModel

    sim = CostModel()
    assumed = Efficiency(
        sim.mfu,
        sim.mbu,
        sim.step_overhead_s,
        f"assumed (the simulator's defaults: mfu {sim.mfu}, mbu {sim.mbu}, "
        f"{sim.step_overhead_s * 1000:g} ms a step); no calibration, so unchecked against "
        "measurement: run `tollgate capacity check --save FILE` and pass --calibration FILE",
    )
    try:
        sized = plan(inputs_from(args, assumed))
        if sized.inputs.arch is None:
            raise CapacityInputError("--params", "plan needs the model's shape, not --params alone")
        trace, slos = _workload(args)
        config = EngineConfig(
            max_num_seqs=args.max_num_seqs or MAX_NUM_SEQS_BY_DEVICE["cuda"],
            max_num_batched_tokens=args.max_num_batched_tokens
            or EngineConfig.max_num_batched_tokens,
        )
        blocks = int(sized.number("max_kv_tokens")) // config.block_size
        tried, smallest = size_cluster(
            trace, config, sized.cost, blocks, slos, args.max_replicas, _progress
        )
    except (CapacityInputError, ValueError) as exc:
        return _fail(exc)
    if args.json:
        print(json.dumps(_sizing_json(sized, tried, smallest, blocks), indent=2))
    else:
        print(_sizing_text(sized, tried, smallest, blocks))
    return 0 if smallest is not None else 1


def _sizing_json(sized: Any, tried: list[Any], smallest: int | None, blocks: int) -> object:
    from dataclasses import asdict

    return {
        "smallest_replicas": smallest,
        "kv_blocks_per_replica": blocks,
        "counts": [{**asdict(f), "meets_slos": f.meets_slos} for f in tried],
        "model": sized.as_json(),
        "notes": _sizing_notes(sized),
    }


def _sizing_notes(sized: Any) -> list[str]:
    return [
        "a roofline model (backend/sim/cost.py), not a measurement: step time = overhead + "
        "max(FLOPs / (peak x mfu), bytes / (bandwidth x mbu))",
        f"efficiency: {sized.inputs.efficiency.source}",
        "arrivals dealt to replicas round-robin; each replica is one engine "
        "(EngineConfig's GPU defaults unless --max-num-seqs/--max-num-batched-tokens)",
    ]


def _sizing_text(sized: Any, tried: list[Any], smallest: int | None, blocks: int) -> str:
    i = sized.inputs
    lines = [
        f"{i.arch.name} on {sized.cost.gpu.name} ({i.weights_dtype}, KV {i.cache_dtype}): "
        f"{blocks:,} KV blocks per replica",
    ]
    for f in tried:
        verdict = "meets every SLO" if f.meets_slos else "misses an SLO"
        lines.append(
            f"\n{f.replicas} replica(s): {verdict}; goodput {f.goodput_rps:.2f} req/s "
            f"({f.goodput_tps:,.0f} tok/s); KV peak {f.kv_peak:.0%}, mean {f.kv_mean:.0%}; "
            f"rejected {f.rejected}, preemptions {f.preemptions}"
        )
        lines.append(
            f"  {'class':<12}{'n':>6}  {'TTFT p50/p95/p99 s':<22}{'ITL p50/p95/p99 ms':<22}"
            f"{'queue p95 s':<13}SLO (p95 TTFT, ITL)"
        )
        for c in f.classes:
            ttft = "/".join(f"{v:.2f}" for v in c.ttft)
            itl = "/".join(f"{v * 1000:.1f}" for v in c.itl)
            met = "met" if c.met else "MISSED"
            lines.append(
                f"  {c.name:<12}{c.count:>6}  {ttft:<22}{itl:<22}{c.queue_p95:<13.2f}"
                f"{met} ({c.slo.ttft_s:g} s, {c.slo.itl_s * 1000:g} ms)"
            )
    answer = (
        f"smallest replica count meeting every SLO: {smallest}"
        if smallest is not None
        else f"no count up to {len(tried)} meets every SLO (raise --max-replicas)"
    )
    return "\n".join([*lines, "", answer, *(f"note: {n}" for n in _sizing_notes(sized))])


def _check(settings: Any, args: argparse.Namespace) -> int:
    if args.url:
        from backend.capacity.presets import gpu_preset
        from backend.capacity.remote import check_remote

        secret = settings.backend_secret or ""
        try:
            gpu = gpu_preset(args.gpu) if args.gpu else None
            facts, peaks, cal = check_remote(args.url, secret, gpu)
        except (CapacityInputError, OSError, ValueError) as exc:
            return _fail(exc)
    else:
        from backend.builtin import BUILTIN_MODEL_DIR
        from backend.capacity.check import check_in_process
        from backend.errors import CheckpointError

        try:
            facts, peaks, cal = check_in_process(
                args.model or BUILTIN_MODEL_DIR, args.device, args.cpu_threads, args.kv_cache_dtype
            )
        except (CheckpointError, RuntimeError, ValueError) as exc:
            return _fail(exc)
    if args.save:
        cal.save(args.save)
    if args.json:
        from dataclasses import asdict

        report = {"engine": asdict(facts), "peaks": asdict(peaks), "calibration": asdict(cal)}
        print(json.dumps(report, indent=2))
    else:
        print(_check_text(facts, peaks, cal, args.save))
    return 0


def _check_text(facts: Any, peaks: Any, cal: Any, saved: Path | None) -> str:
    planned_blocks = facts.planner_num_blocks
    rows = [
        f"engine: {facts.model} on {facts.device} ({facts.dtype}, KV {facts.kv_dtype}), "
        "max_model_len "
        f"{facts.max_model_len:,}",
        f"KV block: {facts.block_size} tokens, {facts.bytes_per_block:,} B (planner: "
        f"{facts.planner_bytes_per_block:,.0f} B)",
        f"KV pool: {facts.num_blocks:,} blocks, {facts.kv_tensor_bytes:,} B in the cache tensor"
        + (
            f" (planner: {planned_blocks:,} blocks in the {facts.kv_budget_bytes:,} B budget)"
            if planned_blocks is not None
            else ""
        ),
        f"peaks: {peaks.flops / 1e9:,.1f} GFLOP/s, {peaks.bandwidth / 1e9:,.1f} GB/s ({peaks.how})",
        f"{'step':<24}{'floor ms':>10}{'predicted ms':>14}{'measured ms':>13}{'error':>8}",
    ]
    for p in cal.points:
        label = (
            f"{p.kind} batch {p.batch} @ {p.tokens}"
            if p.kind == "decode"
            else (f"prefill {p.tokens} tokens")
        )
        error = abs(p.predicted_s - p.measured_s) / p.measured_s
        rows.append(
            f"{label:<24}{p.floor_s * 1000:>10.3f}{p.predicted_s * 1000:>14.3f}"
            f"{p.measured_s * 1000:>13.3f}{error:>8.0%}"
        )
    rows += [
        f"fitted: overhead {cal.step_overhead_s * 1000:.3g} ms a step + "
        f"{cal.seq_overhead_s * 1000:.3g} ms a request, mbu {cal.mbu:.3g}, "
        f"mfu {cal.mfu:.3g}",
        f"roofline error (mean |predicted - measured| / measured): bare {cal.floor_error:.0%}, "
        f"calibrated {cal.mean_abs_error:.0%}",
        "note: measured now, on this machine as loaded now; repeat runs vary",
    ]
    if saved:
        rows.append(f"saved {saved}: use it with `tollgate capacity plan --calibration {saved}`")
    return "\n".join(rows)
