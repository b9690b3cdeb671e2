"""`tollgate capacity check` in-process: read the engine's real KV pool, time its steps
at a few decode batch sizes and prefill lengths, and set them beside the roofline.

On the CPU the peaks come from a short calibration (a matmul for FLOP/s, a large copy for
bandwidth), not from a preset. The fitted factors (step overhead, mbu from the decode
steps, mfu from the prefill steps) make a Calibration that `capacity plan` can use."""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import torch

from backend.capacity.calibration import Calibration, Point
from backend.capacity.model import DTYPE_BYTES, KV_SCALE_BYTES, TORCH_NAMES, Architecture
from backend.config import EngineConfig
from backend.engine.engine import Engine
from backend.engine.model_runner import kv_bytes_per_block
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from backend.sim.cost import CostModel, GpuSpec, ModelSpec, Roofs

DECODE_BATCHES = (1, 4, 16)
PREFILL_LENGTHS = (16, 64, 256)
DECODE_STEPS = 4  # timed per batch size, after its prefill; the fastest counts
ROUNDS = 2
PREFILL_REPEATS = 2
PROMPT_FOR_DECODE = 32
# Calibration sizes per device type: big enough to reach the roofs, small enough to take
# well under a second.
MATMUL_SIZE = {"cpu": 1024, "cuda": 8192}
COPY_BYTES = {"cpu": 128 * 2**20, "cuda": 2**30}
EFFICIENCY_GRID = [10 ** (k / 10) for k in range(-20, 11)]  # 0.01 to 10: the fit's search
PER_REQUEST_GRID = [0.0, *(10 ** (k / 4) for k in range(-24, -7))]  # 1 us to 10 ms


@dataclass(frozen=True)
class Peaks:
    flops: float
    bandwidth: float
    how: str


@dataclass(frozen=True)
class Sample:
    kind: str  # decode | prefill
    batch: int
    tokens: int  # mean context (decode) or prompt length (prefill)
    chunks: list[tuple[int, int]]  # (start, num_tokens) per request, for the cost model
    measured_s: float


@dataclass(frozen=True)
class EngineFacts:
    model: str
    device: str
    dtype: str
    kv_dtype: str  # the KV cache's: dtype, or int8 / fp8 (--kv-cache-dtype)
    block_size: int
    num_blocks: int
    bytes_per_block: int
    kv_tensor_bytes: int  # what the KV cache tensor really holds
    kv_budget_bytes: int  # what the engine was given for it (CPU)
    max_model_len: int
    # The planner's own arithmetic from the model's shapes, to set beside the engine's:
    planner_bytes_per_block: float
    planner_num_blocks: int | None  # None on a GPU (its budget is measured at load)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(work: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    work()  # warm up
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return best


def calibrate(device: torch.device, dtype: torch.dtype = torch.float32) -> Peaks:
    """Peak FLOP/s from an n x n matmul, bandwidth from copying a large tensor (it reads
    and writes every byte); the best of a few runs, well under a second on a CPU."""
    n, size = MATMUL_SIZE[device.type], COPY_BYTES[device.type]
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    flops = 2 * n**3 / _best_time(lambda: a @ b, device)
    src = torch.ones(size // a.element_size(), device=device, dtype=dtype)
    dst = torch.empty_like(src)
    bandwidth = 2 * size / _best_time(lambda: dst.copy_(src), device)
    name = TORCH_NAMES.get(str(dtype).removeprefix("torch."), str(dtype))
    how = f"calibrated on {device}: a {n}x{n} {name} matmul, a {size >> 20} MiB copy"
    return Peaks(flops, bandwidth, how)


def check_config(
    device: str, cpu_threads: int | None = 1, kv_cache_dtype: str = "auto"
) -> EngineConfig:
    """Room for the largest batch and prompt in one step, no prefix cache hits, no prefill
    capping: each timed step is exactly the shape it is compared with. One CPU thread by
    default: on a shared machine, threads waiting on a descheduled sibling swamp the
    timings."""
    return EngineConfig(
        device=device,
        cpu_threads=cpu_threads if device == "cpu" else None,
        max_num_seqs=max(DECODE_BATCHES),
        max_num_batched_tokens=max(*PREFILL_LENGTHS, max(DECODE_BATCHES) * PROMPT_FOR_DECODE),
        enable_prefix_caching=False,
        long_prefill_token_threshold=0,
        prefill_reserve_share=0.0,
        kv_cache_dtype=kv_cache_dtype,
    )


def facts(engine: Engine) -> EngineFacts:
    runner = engine.runner
    bs = engine.config.block_size
    per_block = kv_bytes_per_block(engine.model_config, bs, runner.kv_dtype)
    dtype = TORCH_NAMES[str(runner.dtype).removeprefix("torch.")]
    kv_dtype = TORCH_NAMES[str(runner.kv_dtype).removeprefix("torch.")]
    arch = Architecture.of(engine.model_dir.name, engine.model_config)
    planned = arch.kv_bytes_per_token(kv_dtype) * bs
    budget = engine.config.kv_cache_bytes
    cpu = runner.device.type == "cpu" and engine.config.num_kv_blocks is None
    return EngineFacts(
        model=engine.model_dir.name,
        device=str(runner.device),
        dtype=dtype,
        kv_dtype=kv_dtype,
        block_size=bs,
        num_blocks=runner.num_blocks,
        bytes_per_block=per_block,
        kv_tensor_bytes=runner.kv_cache.numel() * runner.kv_cache.element_size(),
        kv_budget_bytes=budget,
        max_model_len=engine.max_model_len,
        planner_bytes_per_block=planned,
        planner_num_blocks=int(budget // planned) if cpu else None,
    )


class _Driver:
    """Requests with distinct random prompts, stepped one engine step at a time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.rng = random.Random(0)
        self.count = 0

    def add(self, prompt_tokens: int, max_tokens: int) -> str:
        self.count += 1
        request_id = f"check-{self.count}"
        vocab = self.engine.model_config.vocab_size
        prompt = [self.rng.randrange(3, vocab) for _ in range(prompt_tokens)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        self.engine.add_request(EngineRequest(prompt, params, request_id))
        return request_id

    def timed_step(self) -> float:
        started = time.perf_counter()
        self.engine.step()
        return time.perf_counter() - started

    def drain(self, ids: list[str]) -> None:
        for request_id in ids:
            self.engine.abort(request_id)
        while self.engine.has_work():
            self.engine.step()


def measure(engine: Engine) -> list[Sample]:
    """Each shape timed in ROUNDS rounds, the fastest kept: a burst of other work on the
    machine slows one round, not the figure."""
    driver = _Driver(engine)
    # Warm up (first-touch allocations, lazy initialisation): these are not timed.
    _decode_sample(driver, max(DECODE_BATCHES))
    _prefill_sample(driver, max(PREFILL_LENGTHS))
    rounds = []
    for _ in range(ROUNDS):
        samples = [_decode_sample(driver, batch) for batch in DECODE_BATCHES]
        rounds.append(samples + [_prefill_sample(driver, n) for n in PREFILL_LENGTHS])
    return [min(same, key=lambda s: s.measured_s) for same in zip(*rounds, strict=True)]


def _expect(shape_as_planned: bool, size: int) -> None:
    if not shape_as_planned:
        raise RuntimeError(f"the engine did not run the step of size {size} in one piece")


def _decode_sample(driver: _Driver, batch: int) -> Sample:
    ids = [driver.add(PROMPT_FOR_DECODE, DECODE_STEPS + 2) for _ in range(batch)]
    driver.timed_step()  # all the prefills (and their first tokens) in one step
    times = []
    for _ in range(DECODE_STEPS):
        times.append(driver.timed_step())
        stats = driver.engine.stats()
        _expect(stats.step_decode_tokens == batch and stats.step_prefill_tokens == 0, batch)
    driver.drain(ids)
    # The fastest step is the least disturbed by other work on the machine. Decode step k
    # reads PROMPT + k + 1 positions of KV: the middle one stands for them all.
    context = PROMPT_FOR_DECODE + DECODE_STEPS // 2 + 1
    chunks = [(context - 1, 1)] * batch
    return Sample("decode", batch, context, chunks, min(times))


def _prefill_sample(driver: _Driver, length: int) -> Sample:
    times = []
    for _ in range(PREFILL_REPEATS):
        request_id = driver.add(length, 1)
        times.append(driver.timed_step())
        _expect(driver.engine.stats().step_prefill_tokens == length, length)
        driver.drain([request_id])
    return Sample("prefill", 1, length, [(0, length)], min(times))


def floor_model(
    arch: Architecture, dtype: str, peaks: Peaks, device: str, kv_dtype: str | None = None
) -> CostModel:
    """The roofline floor of a model (weights in `dtype`, KV in `kv_dtype`, default the
    same) on the calibrated device."""
    elem = DTYPE_BYTES[dtype]
    kv = kv_dtype or dtype
    spec = ModelSpec(
        arch.name,
        arch.param_count(),
        arch.num_layers,
        arch.hidden_size,
        arch.num_kv_heads,
        arch.head_dim,
        bytes_per_param=elem,
        kv_bytes_per_element=DTYPE_BYTES[kv],
        kv_scale_bytes=KV_SCALE_BYTES.get(kv, 0),
    )
    gpu = GpuSpec(device, peaks.flops, peaks.bandwidth, memory_bytes=0.0)
    return CostModel(spec, gpu, mfu=1.0, mbu=1.0, step_overhead_s=0.0)


def _weighted_median(pairs: list[tuple[float, float]]) -> float:
    """The value minimising the weighted sum of absolute differences."""
    ordered = sorted(pairs)
    half = sum(w for _, w in ordered) / 2
    running = 0.0
    for value, weight in ordered:
        running += weight
        if running >= half:
            return value
    return ordered[-1][0]


def _best_fit(
    measured: list[tuple[Roofs, int, float]],
    mfus: list[float],
    mbus: list[float],
    per_request: list[float],
) -> tuple[float, float, float, float, float]:
    """(mean relative error, mfu, mbu, per-request overhead, step overhead): the best
    triple on the grids, each with its best step overhead (a weighted median minimises the
    sum of relative errors)."""
    best = (math.inf, 1.0, 1.0, 0.0, 0.0)
    for seq in per_request:
        for mfu in mfus:
            for mbu in mbus:
                model = [seq * n + max(r.compute_s / mfu, r.memory_s / mbu) for r, n, _ in measured]
                pairs = [(t, y) for t, (_, _, y) in zip(model, measured, strict=True)]
                overhead = max(0.0, _weighted_median([(y - t, 1 / y) for t, y in pairs]))
                error = statistics.fmean(abs(overhead + t - y) / y for t, y in pairs)
                if error < best[0]:
                    best = (error, mfu, mbu, seq, overhead)
    return best


def fit(samples: list[Sample], floor: CostModel) -> CostModel:
    """The overheads (per step and per request), mfu and mbu that bring the cost model
    closest to the measured steps, in mean relative error: coarse grids (mfu and mbu 0.01
    to 10, nearest 1 first on ties; per-request overhead 0 first, then 1 us to 10 ms),
    then fine ones around the best. mfu = mbu = 1 with no overhead is on the grids, so the
    fit is never worse than the bare roofline."""
    measured = [(floor.roofs(s.chunks), len(s.chunks), s.measured_s) for s in samples]
    coarse = sorted(EFFICIENCY_GRID, key=lambda v: abs(math.log10(v)))
    _, mfu, mbu, seq, _ = _best_fit(measured, coarse, coarse, PER_REQUEST_GRID)
    fine = [1 + k / 50 for k in range(-6, 7)]
    seqs = [seq * (1 + k / 10) for k in range(-5, 6)] if seq else [0.0]
    _, mfu, mbu, seq, overhead = _best_fit(
        measured, [mfu * f for f in fine], [mbu * f for f in fine], seqs
    )
    return replace(floor, mfu=mfu, mbu=mbu, step_overhead_s=overhead, seq_overhead_s=seq)


def calibration(
    floor: CostModel, peaks: Peaks, samples: list[Sample], device_name: str
) -> Calibration:
    fitted = fit(samples, floor)
    points = [
        Point(
            s.kind,
            s.batch,
            s.tokens,
            floor.step_time(s.chunks),
            fitted.step_time(s.chunks),
            s.measured_s,
        )
        for s in samples
    ]
    return Calibration(
        device=device_name,
        model=floor.model.name,
        peak_flops=peaks.flops,
        hbm_bandwidth=peaks.bandwidth,
        mfu=fitted.mfu,
        mbu=fitted.mbu,
        step_overhead_s=fitted.step_overhead_s,
        seq_overhead_s=fitted.seq_overhead_s,
        measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
        points=points,
    )


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu (calibrated peaks)"


def check_in_process(
    model_dir: Path, device: str, cpu_threads: int | None = 1, kv_cache_dtype: str = "auto"
) -> tuple[EngineFacts, Peaks, Calibration]:
    engine = Engine(model_dir, check_config(device, cpu_threads, kv_cache_dtype))
    peaks = calibrate(engine.runner.device, engine.runner.dtype)
    samples = measure(engine)
    f = facts(engine)
    arch = Architecture.of(f.model, engine.model_config)
    floor = floor_model(arch, f.dtype, peaks, f.device, f.kv_dtype)
    return f, peaks, calibration(floor, peaks, samples, device_name(engine.runner.device))
