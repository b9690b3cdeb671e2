"""The prepared device check: one command, at most 6 minutes on one H100 or H200,
nothing downloaded (`--only kernels,greedy_1b`: a 2-minute smoke run). Random-weight
bfloat16 checkpoints shaped like Llama-3.2-1B and Llama-3-8B are built on the GPU (into
/dev/shm), then, each section bounded in time:

- kernels: each Triton kernel of backend/kernels against its torch reference (bf16);
  skipped when backend/kernels is not there;
- greedy_1b: the engine's greedy tokens against transformers' for 20 prompts of 5 to
  2,000 tokens (a divergence where transformers' own two choices are within 0.1 nats is
  a near-tie of bfloat16 rounding, counted apart from a mismatch);
- decode_8b, decode_1b: batch-1 decode tokens/s and achieved memory bandwidth
  ((weight bytes + KV bytes read) x steps/s), as a fraction of the device's peak (by its
  name: H100 SXM 3.35, H200 4.8 TB/s) and of a device-to-device copy measured in the same
  run, CUDA graphs on and off;
- ttft_1b: time to first token of 1k, 8k and 32k-token prompts;
- throughput_1b: output tokens/s at 64 and 256 concurrent requests of a long-tailed
  workload, against transformers generate() on length-sorted static batches;
- speculative_1b: n-gram and draft-model speculative decoding (the draft: the 1B cut to
  its first 2 layers) against plain decoding on prompts that repeat themselves: greedy
  tokens equal, output tokens/s at 1 and 8 concurrent, and the acceptance (a
  random-weight model copies little, so read the rates beside it);
- kv_quant_1b: the KV cache in int8 (and fp8 where the GPU has it) against bf16 at the
  same gpu_memory_utilization: KV blocks and their ratio (2 x head_dim / (head_dim + 4)
  expected), greedy agreement, decode tok/s at 16 concurrent, and the Triton KV write
  equal to the torch quantizer (exactly for fp8: the interpreter's e4m3 rounding is off);
- serving_mix_8b: issue 15's serving mix (bench/serving_mix.py's phases) on the 8B shape,
  default engine settings, in process (an AsyncEngine; the device image has no web
  stack, so no HTTP server): chat TTFT and inter-token gaps alone and beside a tenant
  keeping 8 documents of 8k tokens in flight, the documents' prefill throughput, then
  the documents again with the static budget (adaptive_step_budget off).

It writes one JSON (after every section, so a run cut short keeps what it measured; a
section that overruns or fails keeps the figures it had recorded) and prints a table.
`--dry-run` runs every section on the CPU with tiny shapes.

    python -m bench.gpu_check --only kernels,greedy_1b --out $OUT/smoke.json
    python -m bench.gpu_check --out $OUT/gpu_check.json
    python -m bench.gpu_check --dry-run --out /tmp/gpu_check.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import json
import math
import os
import platform
import random
import shutil
import signal
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from backend.config import EngineConfig
from backend.engine.async_engine import AsyncEngine
from backend.engine.engine import Engine
from backend.outputs import RequestOutput
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from bench import serving_mix
from bench._common import (
    Workload,
    generate_static,
    generate_steps,
    long_tailed,
    static_batches,
    truncated_draft,
    write_word_tokenizer,
)
from bench.serving_mix import Mix

# The vendors' peak memory bandwidth, by a substring of torch.cuda.get_device_name(); the
# first match wins, so the longer names come first. A decode step's bandwidth is reported
# as a fraction of this and of a device-to-device copy measured in the same run.
HBM_PEAK_BYTES_PER_S = (
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # SXM
    ("A100-SXM4-80GB", 2.039e12),
    ("A100", 1.555e12),
    ("L40S", 0.864e12),
)
NEAR_TIE_NATS = 0.1


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int
    tie: bool
    llama3_rope: bool  # Llama-3.2's scaled rope
    init_std: float = 0.02


SHAPES = {
    "1b": Shape(16, 2048, 32, 8, 8192, 128256, 131072, tie=True, llama3_rope=True),
    "8b": Shape(32, 4096, 32, 8, 14336, 128256, 8192, tie=False, llama3_rope=False),
}
# Sharp logits (std 0.2) so the float32 dry run has no near-ties.
TINY = {
    "1b": Shape(2, 64, 4, 2, 128, 512, 40000, tie=True, llama3_rope=True, init_std=0.2),
    "8b": Shape(2, 128, 4, 1, 256, 512, 2048, tie=False, llama3_rope=False, init_std=0.2),
}


@dataclass(frozen=True)
class Plan:
    """How much each section does, and how long it may take (seconds)."""

    greedy_prompts: int = 20
    greedy_lengths: tuple[int, int] = (5, 2000)
    greedy_tokens: int = 16
    decode_prompt: int = 512
    decode_tokens: int = 256
    ttft_lengths: tuple[int, ...] = (1024, 8192, 32768)
    concurrency: tuple[int, ...] = (64, 256)
    max_prompt: int = 2048
    max_output: int = 512
    prompt_median: int = 256
    output_median: int = 96
    static_batch_size: int = 64
    static_budget_s: float = 25.0  # per workload, steps included (generate's max_time)
    spec_prompt: int = 512  # speculative_1b: a random half, then that half again
    spec_tokens: int = 128
    kv_quant_prompts: int = 16  # kv_quant_1b: requests decoding at once, per KV dtype
    max_num_batched_tokens: int = 8192
    # serving_mix_8b: two 16 GB engines (adaptive, static budget), ~27 s of traffic
    mix: Mix = field(
        default_factory=lambda: Mix(
            seconds=6.0, chat_rate=4.0, doc_prompt=8000, settle=3.0, burst=0
        )
    )
    # The whole check within 6 minutes, so 15 minutes of GPU time hold a machine start,
    # the 2-minute smoke (--only kernels,greedy_1b) and one rerun. Each budget is about
    # twice the section's expected time (bench/README.md, "The device check").
    total_s: float = 405.0  # the budgets sum to 400; Python's start-up comes on top
    budgets: dict[str, float] = field(
        default_factory=lambda: {
            "build_1b": 20,
            "kernels": 45,  # Triton compiles each kernel configuration on first use
            "greedy_1b": 30,
            "build_8b": 35,
            "decode_8b": 40,
            "decode_1b": 20,
            "ttft_1b": 20,
            "throughput_1b": 70,  # the engine, then 2 static workloads of 25 s
            "speculative_1b": 30,  # three engines: plain, n-gram, a 2-layer draft
            "kv_quant_1b": 30,  # three engines of the 1B shape (bf16, int8, fp8)
            "serving_mix_8b": 60,
        }
    )


DRY = Plan(
    greedy_prompts=4,
    greedy_lengths=(5, 200),
    greedy_tokens=8,
    decode_prompt=32,
    decode_tokens=12,
    ttft_lengths=(64, 256, 1024),
    concurrency=(8, 16),
    max_prompt=128,
    max_output=24,
    prompt_median=40,
    output_median=8,
    static_batch_size=8,
    static_budget_s=20.0,
    spec_prompt=64,
    spec_tokens=16,
    kv_quant_prompts=4,
    max_num_batched_tokens=256,
    mix=Mix(seconds=1.0, chat_rate=5.0, chat_output=(8, 16), doc_prompt=1000, settle=0.3, burst=0),
    total_s=240.0,
    budgets=dict.fromkeys(Plan().budgets, 60.0),
)


class SectionTimeout(Exception):
    pass


@dataclass
class Run:
    """Where the check runs and what it found so far."""

    device: torch.device
    dtype: torch.dtype
    plan: Plan
    shapes: dict[str, Shape]
    workdir: Path
    out: Path
    results: dict[str, Any] = field(default_factory=dict)
    checkpoints: dict[str, Path] = field(default_factory=dict)
    hf_models: dict[str, Any] = field(default_factory=dict)
    deadline: float = 0.0
    # What the running section has measured so far: kept when it overruns or fails.
    partial: dict[str, Any] = field(default_factory=dict)

    def section(self, name: str, work: Callable[[Run], dict[str, Any]]) -> None:
        """Run one section under its time budget; record ok / error / timeout / skipped."""
        left = self.deadline - time.monotonic()
        budget = min(self.plan.budgets[name], left)
        started = time.monotonic()
        self.partial = {}
        if budget < 5:
            entry: dict[str, Any] = {"status": "skipped", "reason": "no time left"}
        else:
            entry = _bounded(lambda: work(self), budget, self.partial)
        entry["seconds"] = round(time.monotonic() - started, 1)
        self.results["sections"][name] = entry
        self.out.write_text(json.dumps(self.results, indent=2, default=str))
        print(f"[{name}] {entry['status']} in {entry['seconds']} s", flush=True)


def _bounded(
    work: Callable[[], dict[str, Any]], budget: float, partial: dict[str, Any]
) -> dict[str, Any]:
    """`work`'s figures with status ok; on a timeout or an error, the status with what it
    had recorded in `partial` by then."""

    def expire(signum: int, frame: object) -> None:
        raise SectionTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, budget)
    try:
        return {"status": "ok", **work()}
    except SectionTimeout:
        return {**partial, "status": "timeout", "budget_s": round(budget, 1)}
    except Skip as exc:
        return {"status": "skipped", "reason": str(exc)}
    except Exception as exc:  # a failed section must not cost the others
        lines = traceback.format_exc().strip().splitlines()[-6:]
        error = f"{type(exc).__name__}: {exc}"
        return {**partial, "status": "error", "error": error, "trace": lines}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        release()


class Skip(Exception):
    pass


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- checkpoints -----------------------------------------------------------------------


def hf_config(shape: Shape) -> Any:
    from transformers import LlamaConfig

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 500000.0}
    if shape.llama3_rope:
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    return LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=shape.tie,
        rope_parameters=rope,
        bos_token_id=0,
        eos_token_id=1,
        dtype="bfloat16",
        architectures=["LlamaForCausalLM"],
    )


def build_checkpoint(
    folder: Path, shape: Shape, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> dict[str, Any]:
    """Random weights drawn on `device`, saved as safetensors shards of about 2 GB (norm
    weights 1, everything else N(0, init_std))."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    config = hf_config(shape)
    with torch.device("meta"):
        names = {n: tuple(t.shape) for n, t in LlamaForCausalLM(config).state_dict().items()}
    if shape.tie:
        names.pop("lm_head.weight", None)
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    write_word_tokenizer(folder, shape.vocab)
    gen = torch.Generator(device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    total = 0
    for name, dims in names.items():
        shard[name] = _random_weight(name, dims, shape.init_std, gen, device, dtype).cpu()
        total += shard[name].numel() * shard[name].element_size()
        if sum(t.numel() * t.element_size() for t in shard.values()) > 2 * 2**30:
            _save_shard(folder, shard, weight_map, save_file)
    if shard:
        _save_shard(folder, shard, weight_map, save_file)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return {"params": sum(math.prod(d) for d in names.values()), "bytes": total}


def _random_weight(
    name: str,
    dims: tuple[int, ...],
    std: float,
    gen: torch.Generator,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(dims, dtype=dtype, device=device)
    return (torch.randn(dims, generator=gen, device=device) * std).to(dtype)


def _save_shard(
    folder: Path, shard: dict[str, torch.Tensor], weight_map: dict[str, str], save: Any
) -> None:
    file = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
    save(shard, str(folder / file), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(shard, file))
    shard.clear()


def section_build(name: str) -> Callable[[Run], dict[str, Any]]:
    def build(run: Run) -> dict[str, Any]:
        folder = run.workdir / name
        info = build_checkpoint(folder, run.shapes[name], run.device, run.dtype)
        run.checkpoints[name] = folder
        return info

    return build


def checkpoint(run: Run, name: str) -> Path:
    if name not in run.checkpoints:
        raise Skip(f"the {name} checkpoint was not built")
    return run.checkpoints[name]


def hf_model(run: Run, name: str) -> Any:
    """transformers' model of a checkpoint, loaded once per run."""
    if name not in run.hf_models:
        from transformers import LlamaForCausalLM

        model: Any = LlamaForCausalLM.from_pretrained(checkpoint(run, name), dtype=run.dtype)
        run.hf_models[name] = model.to(run.device).eval()
    return run.hf_models[name]


# -- the engine ------------------------------------------------------------------------


def make_engine(run: Run, model_dir: Path, **knobs: Any) -> Engine:
    """An engine on the run's device; knobs this branch's EngineConfig lacks are dropped
    (attention_backend arrives with the Triton kernels)."""
    known = {f.name for f in fields(EngineConfig)}
    base = EngineConfig(device=str(run.device), dtype=str(run.dtype).removeprefix("torch."))
    return Engine(model_dir, replace(base, **{k: v for k, v in knobs.items() if k in known}))


def warm_1b(run: Run, prompt: list[int], **knobs: Any) -> Engine:
    """The 1B shape at half the device's memory, its first steps run on a short request
    (prompt's first 32 tokens) so that they stay out of the timed window."""
    knobs = {"max_num_batched_tokens": run.plan.max_num_batched_tokens, **knobs}
    engine = make_engine(run, checkpoint(run, "1b"), gpu_memory_utilization=0.5, **knobs)
    engine.add_request(EngineRequest(prompt[:32], greedy(4), "warm"))
    drain(engine)
    return engine


def drain(engine: Engine) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def tokens_of(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def greedy(max_tokens: int, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=logprobs)


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(2, vocab) for _ in range(length)]


def engine_facts(engine: Engine) -> dict[str, Any]:
    runner = engine.runner
    return {
        "attention": runner.attention_name,
        "cuda_graphs": runner.use_cuda_graphs,
        "kv_blocks": runner.num_blocks,
        "start_line": engine.describe(),
    }


# -- sections --------------------------------------------------------------------------


def section_kernels(run: Run) -> dict[str, Any]:
    try:
        importlib.import_module("backend.kernels")
    except ImportError as exc:
        raise Skip(f"backend.kernels is not in this tree ({exc})") from None
    from bench import gpu_kernels

    checks = gpu_kernels.run_all(run.device, run.dtype)
    failed = [c["name"] for c in checks if not c.get("ok")]
    return {"checks": checks, "passed": len(checks) - len(failed), "failed": failed}


def section_greedy(run: Run) -> dict[str, Any]:
    plan, shape = run.plan, run.shapes["1b"]
    rng = random.Random(1)
    low, high = plan.greedy_lengths
    lengths = [
        round(low * (high / low) ** (i / max(plan.greedy_prompts - 1, 1)))
        for i in range(plan.greedy_prompts)
    ]
    prompts = [random_prompt(rng, n, shape.vocab) for n in lengths]
    engine = make_engine(
        run,
        checkpoint(run, "1b"),
        gpu_memory_utilization=0.5,
        max_model_len=high + plan.greedy_tokens + 16,
        max_num_batched_tokens=plan.max_num_batched_tokens,
    )
    facts = engine_facts(engine)
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(prompt, greedy(plan.greedy_tokens), f"g{i}"))
    outputs = drain(engine)
    del engine
    release()
    model = hf_model(run, "1b")
    rows = run.partial.setdefault("rows", [])
    for i, prompt in enumerate(prompts):
        rows.append(_compare_greedy(model, prompt, tokens_of(outputs[f"g{i}"]), run.device))
    exact = sum(r["verdict"] == "exact" for r in rows)
    ties = sum(r["verdict"] == "near-tie" for r in rows)
    return {
        **facts,
        "prompts": len(rows),
        "exact": exact,
        "near_ties": ties,
        "mismatches": len(rows) - exact - ties,
        "rows": rows,
    }


@torch.inference_mode()
def _compare_greedy(
    model: Any, prompt: list[int], ours: list[int], device: torch.device
) -> dict[str, Any]:
    out = model.generate(
        torch.tensor([prompt], device=device),
        max_new_tokens=len(ours),
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    theirs = out.sequences[0, len(prompt) :].tolist()
    row: dict[str, Any] = {"prompt_len": len(prompt), "verdict": "exact"}
    diverged = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
    if diverged is not None:
        logprobs = torch.log_softmax(out.logits[diverged][0].float(), dim=-1)
        gap = float(logprobs[theirs[diverged]] - logprobs[ours[diverged]])
        row.update(first_divergence=diverged, gap_nats=round(gap, 4))
        row["verdict"] = "near-tie" if gap < NEAR_TIE_NATS else "mismatch"
    return row


def section_decode(name: str) -> Callable[[Run], dict[str, Any]]:
    def decode(run: Run) -> dict[str, Any]:
        plan, shape = run.plan, run.shapes[name]
        engine = make_engine(
            run,
            checkpoint(run, name),
            max_num_seqs=8,
            max_model_len=plan.decode_prompt + plan.decode_tokens + 32,
            max_num_batched_tokens=plan.max_num_batched_tokens,
        )
        runner = engine.runner
        weights = _weight_bytes_read(runner.model, shape.tie)
        kv_per_token = (
            2
            * shape.layers
            * shape.kv_heads
            * (shape.hidden // shape.heads)
            * runner.kv_cache.element_size()
        )
        result = run.partial
        result.update(engine_facts(engine), weight_bytes=weights)
        captured = runner.use_cuda_graphs
        for graphs in (True, False):
            key = "graphs" if graphs else "eager"
            if graphs and not captured:
                result[key] = {"status": "unavailable (CPU, enforce_eager or backend)"}
                continue
            runner.use_cuda_graphs = graphs
            peaks = run.results["environment"]
            result[key] = _decode_rate(engine, plan, shape, (weights, kv_per_token), peaks)
        runner.use_cuda_graphs = captured
        return result

    return decode


def _weight_bytes_read(model: torch.nn.Module, tied: bool) -> int:
    """Bytes of the weights one decode step reads: all of them but the input embedding
    table (one row per token), unless it doubles as the output head."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if tied:
        return total
    embed = model.get_parameter("model.embed_tokens.weight")
    return total - embed.numel() * embed.element_size()


def _decode_rate(
    engine: Engine,
    plan: Plan,
    shape: Shape,
    bytes_read: tuple[int, int],
    peaks: dict[str, Any],
) -> dict[str, Any]:
    """Batch-1 decode: tokens/s and the bandwidth it implies (`bytes_read`: the weights
    and the KV of one token, per step), against the device's peaks."""
    weights, kv_per_token = bytes_read
    rng = random.Random(2)
    engine.add_request(
        EngineRequest(random_prompt(rng, plan.decode_prompt, shape.vocab), greedy(8), "warm")
    )
    drain(engine)
    replays = getattr(engine.runner, "graph_replays", 0)
    engine.add_request(
        EngineRequest(
            random_prompt(rng, plan.decode_prompt, shape.vocab), greedy(plan.decode_tokens), "d"
        )
    )
    outs = drain(engine)["d"]
    times = [t for o in outs for t in o.token_times]
    steps_per_s = (len(times) - 1) / (times[-1] - times[0])
    mean_context = plan.decode_prompt + plan.decode_tokens / 2
    step_bytes = weights + kv_per_token * mean_context
    bandwidth = step_bytes * steps_per_s
    return {
        "tokens_per_s": round(steps_per_s, 1),
        "ms_per_token": round(1000 / steps_per_s, 3),
        "bytes_per_step": int(step_bytes),
        "bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "hbm_fraction": _fraction(bandwidth, peaks.get("hbm_peak_bytes_per_s")),
        "copy_fraction": _fraction(bandwidth, peaks.get("copy_bytes_per_s")),
        "graph_replays": getattr(engine.runner, "graph_replays", 0) - replays,
    }


def section_ttft(run: Run) -> dict[str, Any]:
    plan, shape = run.plan, run.shapes["1b"]
    engine = make_engine(
        run,
        checkpoint(run, "1b"),
        max_num_seqs=4,
        max_model_len=max(plan.ttft_lengths) + 64,
        max_num_batched_tokens=plan.max_num_batched_tokens,
        gpu_memory_utilization=0.6,
    )
    rng = random.Random(3)
    engine.add_request(
        EngineRequest(random_prompt(rng, plan.ttft_lengths[0], shape.vocab), greedy(2), "warm")
    )
    drain(engine)
    result = run.partial
    result.update(engine_facts(engine))
    for length in plan.ttft_lengths:
        engine.add_request(
            EngineRequest(random_prompt(rng, length, shape.vocab), greedy(1), f"t{length}")
        )
        first = drain(engine)[f"t{length}"][0]
        assert first.first_token_time is not None
        ttft = first.first_token_time - first.arrival_time
        result[f"ttft_{length}"] = {
            "ms": round(ttft * 1000, 1),
            "prefill_tokens_per_s": round(length / ttft),
        }
    return result


def long_tailed_workload(plan: Plan, num: int, vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    work = []
    for _ in range(num):
        prompt_len = long_tailed(rng, 32, plan.max_prompt, median=plan.prompt_median, sigma=0.9)
        out_len = long_tailed(rng, 16, plan.max_output, median=plan.output_median, sigma=0.8)
        work.append((random_prompt(rng, prompt_len, vocab), out_len))
    return work


def section_throughput(run: Run) -> dict[str, Any]:
    plan, shape = run.plan, run.shapes["1b"]
    works = {n: long_tailed_workload(plan, n, shape.vocab, seed=n) for n in plan.concurrency}
    engine = make_engine(
        run,
        checkpoint(run, "1b"),
        max_num_seqs=max(plan.concurrency),
        max_model_len=plan.max_prompt + plan.max_output + 16,
        max_num_batched_tokens=plan.max_num_batched_tokens,
        gpu_memory_utilization=0.85,
    )
    result = run.partial
    result.update(engine_facts(engine))
    engine.add_request(EngineRequest(works[plan.concurrency[0]][0][0][:64], greedy(4), "warm"))
    drain(engine)
    for n, work in works.items():
        result[f"engine_{n}"] = _engine_rate(engine, work)
    result["async"] = _async_step_times(engine, max(plan.concurrency), plan, shape.vocab)
    del engine
    release()
    model = hf_model(run, "1b")
    for n, work in works.items():
        static = _static_rate(model, work, plan, run.device)
        result[f"static_{n}"] = static
        result[f"ratio_{n}"] = round(
            result[f"engine_{n}"]["tokens_per_s"] / static["tokens_per_s"], 2
        )
    return result


def _async_step_times(engine: Engine, num: int, plan: Plan, vocab: int) -> dict[str, Any]:
    """Median decode step time of `num` rows, async scheduling off then on (the same
    engine, idle between), and whether both gave the same greedy tokens: the host's
    share of a step is what async scheduling hides."""
    rng = random.Random(7)
    prompts = [random_prompt(rng, 64, vocab) for _ in range(num)]
    default = engine.async_scheduling
    result: dict[str, Any] = {}
    tokens: dict[bool, list[list[int]]] = {}
    for mode in (False, True):
        engine.async_scheduling = mode
        for i, prompt in enumerate(prompts):
            engine.add_request(
                EngineRequest(prompt, greedy(max(16, plan.decode_tokens // 4)), f"a{i}")
            )
        outputs: dict[str, list[RequestOutput]] = {}
        times = []
        while engine.has_work():
            started = time.perf_counter()
            for out in engine.step():
                outputs.setdefault(out.request_id, []).append(out)
            stats = engine.stats()
            if stats.step_decode_tokens == num and not stats.step_prefill_tokens:
                times.append(time.perf_counter() - started)
        tokens[mode] = [tokens_of(outputs[f"a{i}"]) for i in range(num)]
        result["on" if mode else "off"] = {
            "step_ms": round(statistics.median(times) * 1e3, 3) if times else None,
            "steps": len(times),
        }
    engine.async_scheduling = default
    off, on = result["off"]["step_ms"], result["on"]["step_ms"]
    result["speedup"] = round(off / on, 3) if off and on else None
    result["greedy_equal"] = tokens[False] == tokens[True]
    return result


def _engine_rate(engine: Engine, work: Workload) -> dict[str, Any]:
    steps = engine.num_steps
    started = time.perf_counter()
    for i, (prompt, out_len) in enumerate(work):
        engine.add_request(EngineRequest(prompt, greedy(out_len), f"w{len(work)}-{i}"))
    outputs = drain(engine)
    seconds = time.perf_counter() - started
    tokens = sum(len(tokens_of(o)) for o in outputs.values())
    return {
        "output_tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
        "steps": engine.num_steps - steps,
    }


@torch.inference_mode()
def _static_rate(model: Any, work: Workload, plan: Plan, device: torch.device) -> dict[str, Any]:
    """Length-sorted batches run in a shuffled order until the budget is spent, so the
    batches done are a fair sample of all of them; the rate counts requested tokens only.
    The budget bounds the steps too: the batch under way when it runs out is cut there
    (generate's max_time) and counts each row's requested tokens up to the cut."""
    batches = static_batches(work, plan.static_batch_size, by_length=True)
    random.Random(4).shuffle(batches)
    generate_static(model, [(work[0][0][:16], 2)], device)  # warm-up
    started, tokens, done = time.perf_counter(), 0, 0
    for batch in batches:
        left = plan.static_budget_s - (time.perf_counter() - started)
        if left <= 0:
            break
        steps = generate_steps(model, batch, device, max_time=left)
        tokens += sum(min(n, steps) for _, n in batch)
        done += 1
    seconds = time.perf_counter() - started
    return {
        "batch_size": plan.static_batch_size,
        "batches_done": f"{done}/{len(batches)}",
        "output_tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
    }


IN_PROCESS = "in-process AsyncEngine (no HTTP server: the device image has no web stack)"


def section_serving_mix(run: Run) -> dict[str, Any]:
    """Issue 15's serving mix on the 8B shape, default engine settings: chat alone and
    beside the document flood with the adaptive step budget, then the flood again with
    the static one (its chat ratios are against the adaptive engine's chat alone)."""
    mix = replace(run.plan.mix, vocab=run.shapes["8b"].vocab)
    model_dir = checkpoint(run, "8b")
    result = run.partial
    result.update(api=IN_PROCESS, mix=asdict(mix))
    phases: dict[str, dict[str, serving_mix.Phase]] = {}
    for label, adaptive, wanted in (
        ("adaptive", True, ("alone", "docs")),
        ("static", False, ("docs",)),
    ):
        engine = make_engine(run, model_dir, adaptive_step_budget=adaptive)
        result[f"{label}_engine"] = engine_facts(engine)
        ran = asyncio.run(_mix_in_process(AsyncEngine(engine), mix, wanted))
        del engine
        release()  # the next engine sizes its KV pool from the memory left
        phases[label] = {p.name: p for p in ran}
        result[label] = {name: p.summary() for name, p in phases[label].items()}
    alone = phases["adaptive"]["alone"]
    adaptive_docs, static_docs = phases["adaptive"]["docs"], phases["static"]["docs"]
    ratios: dict[str, Any] = {
        "adaptive": serving_mix.latency_ratios(alone, adaptive_docs),
        "static": serving_mix.latency_ratios(alone, static_docs),
        "doc_share": serving_mix.doc_share(adaptive_docs, static_docs),
    }
    targets = serving_mix.TARGETS
    result["ratios"] = ratios
    result["targets_met"] = {
        "ttft_p90": ratios["adaptive"]["ttft_p90"] <= targets["ttft_p90"],
        "itl_p95": ratios["adaptive"]["itl_p95"] <= targets["itl_p95"],
        "doc_share": ratios["doc_share"] >= targets["doc_share"],
    }
    return result


async def _mix_in_process(
    engine: AsyncEngine, mix: Mix, phases: tuple[str, ...]
) -> list[serving_mix.Phase]:
    try:
        return await serving_mix.run_phases(serving_mix.EngineTarget(engine), mix, phases)
    finally:
        await engine.shutdown()  # also when the section's time runs out


def section_speculative(run: Run) -> dict[str, Any]:
    """The 1B shape plain, with n-gram drafts and with a draft model (K = 4), max_num_seqs
    8: the same greedy tokens, and output tokens/s of 2 requests one after the other
    (concurrency 1) and of 8 at once. The draft model is the 1B checkpoint cut to its
    first DRAFT_LAYERS layers (an early exit, as bench/speculative.py builds from the
    built-in model): its passes are launch-bound on a GPU, so the balance differs from
    the CPU's."""
    plan, shape = run.plan, run.shapes["1b"]
    rng = random.Random(5)
    halves = [random_prompt(rng, plan.spec_prompt // 2, shape.vocab) for _ in range(8)]
    prompts = [half + half for half in halves]
    result = run.partial
    draft = truncated_draft(checkpoint(run, "1b"), run.workdir / "draft_1b", DRAFT_LAYERS)
    tokens: dict[str, dict[str, list[int]]] = {}
    for method in ("off", "ngram", "draft"):
        engine = warm_1b(
            run,
            prompts[0],
            speculative_method=method,
            speculative_model=str(draft) if method == "draft" else None,
            max_num_seqs=8,
            max_model_len=plan.spec_prompt + plan.spec_tokens + 16,
        )
        figures: dict[str, Any] = {}
        for concurrency in (1, 8):
            started, steps, made = time.perf_counter(), engine.num_steps, 0
            for batch in range(0, 8 if concurrency == 8 else 2, concurrency):
                for i in range(batch, batch + concurrency):
                    request = EngineRequest(prompts[i], greedy(plan.spec_tokens), f"s{i}")
                    engine.add_request(request)
                outputs = drain(engine)
                made += sum(len(tokens_of(o)) for o in outputs.values())
                tokens.setdefault(method, {}).update({k: tokens_of(o) for k, o in outputs.items()})
            seconds = time.perf_counter() - started
            figures[f"c{concurrency}"] = {
                "tokens_per_s": round(made / seconds, 1),
                "steps": engine.num_steps - steps,
            }
        stats = engine.stats()
        figures["acceptance"] = round(stats.spec_decode_acceptance_rate, 3)
        figures["tokens_per_step"] = round(stats.spec_decode_tokens_per_step, 2)
        result[method] = figures
        del engine
        release()
        if method == "off":
            continue
        suffix = "" if method == "ngram" else f"_{method}"  # ngram's keys as before
        for c in ("c1", "c8"):
            rate = result[method][c]["tokens_per_s"] / result["off"][c]["tokens_per_s"]
            result[f"speedup_{c}{suffix}"] = round(rate, 2)
        result[f"greedy_equal{suffix}"] = tokens[method] == tokens["off"]
    return result


DRAFT_LAYERS = 2  # of the 1B shape's 16: an eighth of its layers, its embeddings whole


def section_kv_quant(run: Run) -> dict[str, Any]:
    """The 1B shape with its KV cache in bf16, int8 and (on an fp8 GPU, or the CPU) fp8 at
    the same memory share: blocks, the start-up line, greedy agreement with bf16 (each
    prompt to its first divergence) and decode tok/s of 16 requests at once (4 in the
    dry run)."""
    plan, shape = run.plan, run.shapes["1b"]
    rng = random.Random(9)
    prompts = [
        random_prompt(rng, plan.decode_prompt, shape.vocab) for _ in range(plan.kv_quant_prompts)
    ]
    names = ["auto", "int8"]  # fp8 on a GPU that has it (the CPU's torch path: unit tests)
    if run.device.type == "cuda" and torch.cuda.get_device_capability(run.device) >= (8, 9):
        names.append("fp8")
    result = run.partial
    tokens: dict[str, list[list[int]]] = {}
    for name in names:
        engine = warm_1b(
            run,
            prompts[0],
            kv_cache_dtype=name,
            max_num_seqs=16,
            max_model_len=plan.decode_prompt + plan.decode_tokens + 16,
        )
        started = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(EngineRequest(prompt, greedy(plan.decode_tokens), f"k{i}"))
        outputs = drain(engine)
        seconds = time.perf_counter() - started
        tokens[name] = [tokens_of(outputs[f"k{i}"]) for i in range(len(prompts))]
        made = sum(len(t) for t in tokens[name])
        result[name] = {**engine_facts(engine), "tokens_per_s_16": round(made / seconds, 1)}
        del engine
        release()
    base = tokens["auto"]
    for name in names[1:]:
        agreed = sum(_agreed(got, want) for got, want in zip(tokens[name], base, strict=True))
        result[name]["greedy_agreement"] = round(agreed / sum(len(t) for t in base), 3)
        result[name]["blocks_ratio"] = round(
            result[name]["kv_blocks"] / result["auto"]["kv_blocks"], 3
        )
    head_dim = shape.hidden // shape.heads
    result["expected_ratio"] = round(2 * head_dim / (head_dim + 4), 3)
    if run.device.type == "cuda":
        result["write_equal"] = _kv_write_equal(run.device, names[1:])
    return result


def _agreed(got: list[int], want: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(want))


def _kv_write_equal(device: torch.device, names: list[str]) -> dict[str, bool]:
    """The Triton KV write against the torch quantizer: the same bytes (int8 may differ
    by one step on an exact half: the kernel rounds halves away from zero)."""
    from backend.kernels.kv_cache import write_kv, write_kv_reference
    from backend.layers import kv_quant

    equal = {}
    gen = torch.Generator(device=device).manual_seed(0)
    k, v = torch.randn(2, 64, 8, 128, generator=gen, device=device, dtype=torch.bfloat16) * 3
    slots = torch.randperm(64 * 16, device=device)[:64]
    for name in names:
        dtype = kv_quant.STORAGE[name]
        cache = torch.zeros(2, 64, 16, 8, 128 + kv_quant.SCALE_BYTES, dtype=dtype, device=device)
        want = cache.clone()
        write_kv(k, v, cache[0], cache[1], slots)
        write_kv_reference(k, v, want[0], want[1], slots)
        got_v, got_s = kv_quant.split(cache)
        want_v, want_s = kv_quant.split(want)
        gap = float((got_v.float() - want_v.float()).abs().max())
        close = gap <= (1 if name == "int8" else 0)
        equal[name] = close and bool(torch.allclose(got_s, want_s, rtol=1e-6, atol=0))
    return equal


SECTIONS: list[tuple[str, Callable[[Run], dict[str, Any]]]] = [
    ("build_1b", section_build("1b")),
    ("kernels", section_kernels),
    ("greedy_1b", section_greedy),
    ("build_8b", section_build("8b")),
    ("decode_8b", section_decode("8b")),
    ("decode_1b", section_decode("1b")),
    ("ttft_1b", section_ttft),
    ("throughput_1b", section_throughput),
    ("speculative_1b", section_speculative),
    ("kv_quant_1b", section_kv_quant),
    ("serving_mix_8b", section_serving_mix),
]


# -- the report ------------------------------------------------------------------------


def table(results: dict[str, Any]) -> str:
    """The figures that matter, one per line."""
    lines = [f"{'check':<44} {'result':>30}", "-" * 75]
    for name, entry in results["sections"].items():
        for label, value in _figures(name, entry):
            lines.append(f"{label:<44} {value:>30}")
    return "\n".join(lines)


def _figures(name: str, e: dict[str, Any]) -> Iterator[tuple[str, str]]:
    if e["status"] != "ok":
        yield name, f"{e['status']} {e.get('reason') or e.get('error', '')}"[:60]
        return
    if name.startswith("build"):
        yield f"{name} ({e['params'] / 1e9:.2f}B params)", f"{e['seconds']} s"
    elif name == "kernels":
        yield "kernels equal to torch reference", f"{e['passed']}/{e['passed'] + len(e['failed'])}"
    elif name == "greedy_1b":
        yield (
            "greedy == transformers (exact/tie/mismatch)",
            f"{e['exact']}/{e['near_ties']}/{e['mismatches']}",
        )
    elif name.startswith("decode"):
        for key in ("graphs", "eager"):
            d = e[key]
            value = d.get("status") or _decode_cell(d)
            yield f"{name} batch 1, {key}", value
    elif name == "ttft_1b":
        for key, d in e.items():
            if key.startswith("ttft_"):
                yield f"TTFT {key[5:]} tokens", f"{d['ms']} ms"
    elif name == "throughput_1b":
        for key in e:
            if key.startswith("ratio_"):
                n = key[6:]
                ours, theirs = e[f"engine_{n}"]["tokens_per_s"], e[f"static_{n}"]["tokens_per_s"]
                yield f"{n} concurrent: engine / static tok/s", f"{ours} / {theirs} = {e[key]}x"
        if "async" in e:
            a = e["async"]
            steps = f"{a['off']['step_ms']} / {a['on']['step_ms']} ms = {a['speedup']}x"
            yield "decode step, async scheduling off / on", steps
            yield "async scheduling: greedy equal to sync", str(a["greedy_equal"])
    elif name == "speculative_1b":
        for method, suffix in (("ngram", ""), ("draft", "_draft")):
            if f"greedy_equal{suffix}" not in e:
                continue
            yield f"speculative {method}: greedy equal to plain", str(e[f"greedy_equal{suffix}"])
            for c in ("c1", "c8"):
                rates = f"{e['off'][c]['tokens_per_s']} / {e[method][c]['tokens_per_s']}"
                speedup = e[f"speedup_{c}{suffix}"]
                yield f"speculative {c}: plain / {method} tok/s", f"{rates} = {speedup}x"
            yield (
                f"speculative {method} acceptance, tokens/step",
                f"{e[method]['acceptance']}, {e[method]['tokens_per_step']}",
            )
    elif name == "kv_quant_1b":
        for kv in ("int8", "fp8"):
            if kv in e:
                d = e[kv]
                blocks = f"{d['kv_blocks']} = {d['blocks_ratio']}x (~{e['expected_ratio']}x)"
                yield f"KV {kv}: blocks vs auto (bf16 on a GPU)", blocks
                yield f"KV {kv}: greedy agreement with auto", str(d["greedy_agreement"])
                rates = f"{e['auto']['tokens_per_s_16']} / {d['tokens_per_s_16']}"
                yield f"KV {kv}: 16 concurrent tok/s auto / {kv}", rates
        if "write_equal" in e:
            yield "KV write kernel == torch quantizer", str(e["write_equal"])
    elif name == "serving_mix_8b":
        yield from _mix_figures(e)


def _decode_cell(d: dict[str, Any]) -> str:
    """tok/s and the fractions of the vendor's peak and of the measured copy (n/a where
    the device's peak is not known)."""
    hbm, copy = d["hbm_fraction"], d["copy_fraction"]
    peak = f"{hbm:.0%} of peak" if hbm is not None else "peak n/a"
    return f"{d['tokens_per_s']} tok/s, {peak}, {copy:.0%} of copy"


def _mix_figures(e: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """Chat alone vs beside the documents (adaptive, then static), and the documents'
    throughput; the ratio's target in brackets."""
    alone, targets, ratios = e["adaptive"]["alone"], serving_mix.TARGETS, e["ratios"]
    for label in ("adaptive", "static"):
        docs = e[label]["docs"]
        for key, q, figure in (("ttft_ms", "p90", "ttft_p90"), ("itl_ms", "p95", "itl_p95")):
            name = f"8B mix {label}: chat {key[:-3].upper()} {q} alone/docs"
            value = f"{alone[key][q]:.0f}/{docs[key][q]:.0f} ms={ratios[label][figure]}x"
            yield name, value + (f" (<={targets[figure]:g})" if label == "adaptive" else "")
    tok_s = [e[label]["docs"]["doc_prefill_tokens_per_s"] for label in ("adaptive", "static")]
    share = (
        f"{tok_s[0]:.0f}/{tok_s[1]:.0f}={ratios['doc_share']:.0%} (>={targets['doc_share']:.0%})"
    )
    yield "8B mix: document prefill tok/s adaptive/static", share


@contextmanager
def workdir(given: Path | None, dry_run: bool) -> Iterator[Path]:
    """/dev/shm when it has room (no disk writes of 19 GB), else a temporary folder."""
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    shm = Path("/dev/shm")
    base = (
        shm if not dry_run and shm.is_dir() and shutil.disk_usage(shm).free > 40 * 2**30 else None
    )
    folder = Path(tempfile.mkdtemp(prefix="tollgate-gpu-check-", dir=base))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--workdir", type=Path, help="where checkpoints go (default /dev/shm)")
    parser.add_argument("--only", help="comma-separated sections (builds are added as needed)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded, ever
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels on CPU tensors
        torch.set_num_threads(min(2, torch.get_num_threads()))
    elif not torch.cuda.is_available():
        parser.error("no CUDA device: use --dry-run on a machine without a GPU")
    sections = _selected(args.only)
    device = torch.device("cpu" if args.dry_run else "cuda")
    with workdir(args.workdir, args.dry_run) as folder:
        run = Run(
            device=device,
            dtype=torch.float32 if args.dry_run else torch.bfloat16,
            plan=DRY if args.dry_run else Plan(),
            shapes=TINY if args.dry_run else SHAPES,
            workdir=folder,
            out=args.out,
            results={"environment": _environment(device, args.dry_run), "sections": {}},
        )
        run.deadline = time.monotonic() + run.plan.total_s
        for name, work in sections:
            run.section(name, work)
    print(table(run.results))
    print(f"\nwritten to {args.out}")
    return 0


def _selected(only: str | None) -> list[tuple[str, Callable[[Run], dict[str, Any]]]]:
    if not only:
        return SECTIONS
    wanted = {s.strip() for s in only.split(",")}
    wanted |= {f"build_{n.rsplit('_', 1)[1]}" for n in wanted if n[-3:] in ("_1b", "_8b")}
    return [(n, w) for n, w in SECTIONS if n in wanted]


def hbm_peak(device_name: str) -> float | None:
    """The vendor's peak memory bandwidth of a device, by its name; None if unknown."""
    return next((peak for part, peak in HBM_PEAK_BYTES_PER_S if part in device_name), None)


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> float:
    """Bytes/s moved by a device-to-device copy (each copy reads and writes `nbytes`): a
    second reference for the decode fraction, measured on this very device."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm: allocation and first touch out of the timing
    _synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    _synchronize(device)
    return 2 * nbytes * repeats / (time.perf_counter() - started)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fraction(bandwidth: float, peak: float | None) -> float | None:
    return round(bandwidth / peak, 3) if peak else None


def _environment(device: torch.device, dry_run: bool) -> dict[str, Any]:
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor()
    copy_bytes = 64 * 2**20 if dry_run else 2 * 2**30
    env: dict[str, Any] = {
        "dry_run": dry_run,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": name,
        "hbm_peak_bytes_per_s": hbm_peak(name) if device.type == "cuda" else None,
        "copy_bytes_per_s": round(copy_bandwidth(device, copy_bytes)),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


if __name__ == "__main__":
    raise SystemExit(main())
