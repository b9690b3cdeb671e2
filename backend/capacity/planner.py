"""The seeds' five formulas as a plan: weights, KV bytes per token, the KV budget and
max concurrency, the decode step floor, prefill time, and Little's law for a rate.

Every time comes from the one roofline cost model (backend/sim/cost.py), the same one the
simulator steps with. Memory sizes given in GB are GiB (2^30 bytes), as nvidia-smi and
the engine's own budgets count; parameter bytes are exact. A tensor-parallel group of N
GPUs is treated as one device with N times the memory, bandwidth and FLOP/s: the weights
and the KV heads are split evenly and the collectives are not modelled."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from backend.capacity.errors import CapacityInputError
from backend.capacity.model import (
    DTYPE_BYTES,
    GIB,
    KV_SCALE_BYTES,
    Architecture,
    Hardware,
    non_negative,
    positive,
)
from backend.sim.cost import CostModel, GpuSpec, ModelSpec

ENGINE_UTILIZATION = 0.9  # EngineConfig.gpu_memory_utilization's default
LITTLE_ITERATIONS = 50
# Always in --json, null where the inputs do not give them (KV figures under --params).
JSON_KEYS = (
    "params",
    "weights_bytes",
    "kv_bytes_per_token",
    "kv_bytes_per_sequence",
    "kv_budget_bytes",
    "max_kv_tokens",
    "max_concurrent_sequences",
    "decode_step_floor_s",
    "decode_step_at_max_batch_s",
    "compute_bound_batch",
    "decode_tokens_per_s_per_sequence",
    "decode_tokens_per_s_ceiling",
    "prefill_s",
    "required_concurrency",
    "fits",
)


@dataclass(frozen=True)
class Efficiency:
    """Shares of peak the hardware reaches, and a per-step overhead. The default is the
    roofline floor; `tollgate capacity check` measures real ones."""

    mfu: float = 1.0
    mbu: float = 1.0
    step_overhead_s: float = 0.0
    source: str = "roofline floor: mfu = mbu = 1, no step overhead"
    seq_overhead_s: float = 0.0  # per scheduled request per step


@dataclass(frozen=True)
class Inputs:
    gpu: Hardware
    arch: Architecture | None = None  # None: weights only, from `params`
    params: int | None = None  # overrides the count from `arch`
    tensor_parallel: int = 1
    dtype: str | None = None  # weights; None: the checkpoint's, else bf16
    kv_dtype: str | None = None  # None: the compute dtype (bf16 under one-byte weights)
    context: int | None = None  # None: prompt + output, else the model's context
    gpu_memory_utilization: float | None = None  # the engine's way to reserve memory ...
    activation_gib: float | None = None  # ... or these two
    margin_gib: float | None = None
    prompt_tokens: int | None = None  # None: the context
    output_tokens: int | None = None
    rate: float | None = None  # requests/s, for Little's law
    duration_s: float | None = None  # each request's time in the system
    efficiency: Efficiency = field(default_factory=Efficiency)
    # Speculative decoding: tokens a sequence gets per decode step (1 + accepted drafts,
    # as /metrics' tollgate_engine_spec_decode_tokens_per_step measures it), each step
    # computing 1 + num_speculative_tokens tokens per sequence. None: one token a step.
    spec_tokens_per_step: float | None = None
    num_speculative_tokens: int = 4
    # LoRA adapter slots resident on the device (the engine's max_loras, max_lora_rank):
    # their weights come off the KV budget.
    max_loras: int = 0
    max_lora_rank: int = 16

    @property
    def weights_dtype(self) -> str:
        return self.dtype or (self.arch.dtype if self.arch and self.arch.dtype else "bf16")

    @property
    def cache_dtype(self) -> str:
        """As the engine's --kv-cache-dtype auto: the compute dtype, which is bf16 under
        weight-only int8, fp8 and int4 (their KV stays 16-bit unless asked)."""
        if self.kv_dtype:
            return self.kv_dtype
        return "bf16" if DTYPE_BYTES[self.weights_dtype] < 2 else self.weights_dtype


@dataclass(frozen=True)
class Line:
    key: str
    label: str
    value: float | int | bool | None
    unit: str  # bytes | s | tokens | sequences | tok/s | params | batch | bool
    formula: str  # with its inputs substituted


@dataclass(frozen=True)
class Plan:
    inputs: Inputs
    cost: CostModel
    context: int
    lines: list[Line]
    notes: list[str]

    def value(self, key: str) -> float | int | bool | None:
        """None for a figure this plan has no inputs for (KV lines under --params)."""
        return next((line.value for line in self.lines if line.key == key), None)

    def number(self, key: str) -> float:
        value = self.value(key)
        if value is None or isinstance(value, bool):
            raise KeyError(f"{key} has no number in this plan")
        return float(value)

    def as_json(self) -> dict[str, object]:
        data: dict[str, object] = dict.fromkeys(JSON_KEYS)
        data.update({line.key: line.value for line in self.lines})
        data["formulas"] = {line.key: line.formula for line in self.lines}
        data["inputs"] = describe_inputs(self.inputs, self.context)
        data["notes"] = self.notes
        return data


def describe_inputs(i: Inputs, context: int) -> dict[str, object]:
    return {
        "model": i.arch.name if i.arch else "--params",
        "gpu": i.gpu.name,
        "tensor_parallel": i.tensor_parallel,
        "dtype": i.weights_dtype,
        "kv_dtype": i.cache_dtype,
        "context": context,
        "mfu": i.efficiency.mfu,
        "mbu": i.efficiency.mbu,
        "step_overhead_s": i.efficiency.step_overhead_s,
        "seq_overhead_s": i.efficiency.seq_overhead_s,
        "spec_tokens_per_step": i.spec_tokens_per_step,
        "num_speculative_tokens": i.num_speculative_tokens,
        "max_loras": i.max_loras,
        "max_lora_rank": i.max_lora_rank,
    }


def check(i: Inputs) -> None:
    """Every bad input, as one line naming its flag."""
    i.gpu.check()
    if i.arch is not None:
        i.arch.check()
    elif i.params is None:
        raise CapacityInputError(
            "--preset", "give a model: --preset, --model-dir, --params or its shape"
        )
    if i.params is not None:
        positive("--params", i.params)
    positive("--tensor-parallel", i.tensor_parallel)
    if i.arch is not None and i.arch.num_heads % i.tensor_parallel:
        raise CapacityInputError(
            "--tensor-parallel",
            f"--tensor-parallel {i.tensor_parallel} does not divide --heads {i.arch.num_heads}",
        )
    for flag, dtype in (("--dtype", i.weights_dtype), ("--kv-dtype", i.cache_dtype)):
        if dtype not in DTYPE_BYTES:
            raise CapacityInputError(flag, f"{flag} {dtype!r}: one of {', '.join(DTYPE_BYTES)}")
    for flag, count in (
        ("--context", i.context),
        ("--prompt-tokens", i.prompt_tokens),
        ("--output-tokens", i.output_tokens),
        ("--duration-s", i.duration_s),
        ("--rate", i.rate),
    ):
        if count is not None:
            positive(flag, count)
    _check_reserve(i)
    _check_efficiency(i.efficiency)
    _check_speculative(i)
    non_negative("--max-loras", i.max_loras)
    positive("--max-lora-rank", i.max_lora_rank)
    if i.max_loras and i.arch is None:
        raise CapacityInputError("--max-loras", "--max-loras needs the model's shape, not --params")
    if i.rate is not None and i.duration_s is None and i.output_tokens is None:
        raise CapacityInputError("--rate", "--rate needs --duration-s or --output-tokens")


def _check_speculative(i: Inputs) -> None:
    positive("--num-speculative-tokens", i.num_speculative_tokens)
    tps = i.spec_tokens_per_step
    if tps is not None and not 1 <= tps <= i.num_speculative_tokens + 1:
        raise CapacityInputError(
            "--spec-tokens-per-step",
            f"--spec-tokens-per-step must be in [1, 1 + --num-speculative-tokens], got {tps:g}",
        )


def decode_step(i: Inputs, cost: CostModel, batch: int, context: int) -> tuple[float, float]:
    """(seconds, tokens per sequence) of one decode step at `batch`: with speculative
    decoding each sequence computes its token and its drafts and keeps
    spec_tokens_per_step of them."""
    if i.spec_tokens_per_step is None:
        return cost.decode_step(batch, context), 1.0
    chunks = [(max(context - 1, 0), 1 + i.num_speculative_tokens)] * batch
    return cost.step_time(chunks), i.spec_tokens_per_step


def _check_reserve(i: Inputs) -> None:
    util = i.gpu_memory_utilization
    if util is not None:
        if i.activation_gib is not None or i.margin_gib is not None:
            raise CapacityInputError(
                "--gpu-memory-utilization",
                "--gpu-memory-utilization or --activation-gb/--margin-gb, not both",
            )
        if not 0 < util <= 1:
            raise CapacityInputError(
                "--gpu-memory-utilization",
                f"--gpu-memory-utilization must be in (0, 1], got {util:g}",
            )
    for flag, gib in (("--activation-gb", i.activation_gib), ("--margin-gb", i.margin_gib)):
        if gib is not None:
            non_negative(flag, gib)


def _check_efficiency(e: Efficiency) -> None:
    positive("--mfu", e.mfu)
    positive("--mbu", e.mbu)
    non_negative("--step-overhead-ms", e.step_overhead_s)
    non_negative("--calibration", e.seq_overhead_s)


# -- the arithmetic ---------------------------------------------------------------------


def usable_memory(i: Inputs, gpus: int) -> tuple[float, str]:
    """Bytes the weights and KV may take on `gpus` GPUs, and how that was reckoned."""
    total = i.gpu.memory_bytes * gpus
    if i.activation_gib is None and i.margin_gib is None:
        util = i.gpu_memory_utilization or ENGINE_UTILIZATION
        return total * util, f"{gpus} x {_gib(i.gpu.memory_bytes)} x {util:g} utilization"
    reserve = ((i.activation_gib or 0) + (i.margin_gib or 0)) * GIB
    how = (
        f"{gpus} x {_gib(i.gpu.memory_bytes)} - {i.activation_gib or 0:g} GiB activations"
        f" - {i.margin_gib or 0:g} GiB margin"
    )
    return total - reserve * gpus, how


def cost_model(i: Inputs, params: int) -> CostModel:
    """The simulator's cost model for this model on the tensor-parallel group."""
    a, n = i.arch, i.tensor_parallel
    spec = ModelSpec(
        a.name if a else "params",
        params,
        num_layers=a.num_layers if a else 0,
        hidden_size=a.hidden_size if a else 0,
        num_kv_heads=a.num_kv_heads if a else 0,
        head_dim=a.head_dim if a else 0,
        bytes_per_param=DTYPE_BYTES[i.weights_dtype],
        kv_bytes_per_element=DTYPE_BYTES[i.cache_dtype],
        kv_scale_bytes=KV_SCALE_BYTES.get(i.cache_dtype, 0),
    )
    gpu = GpuSpec(
        f"{n} x {i.gpu.name}" if n > 1 else i.gpu.name,
        peak_flops=i.gpu.peak_flops(i.weights_dtype) * n,
        hbm_bandwidth=i.gpu.hbm_bandwidth * n,
        memory_bytes=i.gpu.memory_bytes * n,
    )
    e = i.efficiency
    return CostModel(
        spec,
        gpu,
        mfu=e.mfu,
        mbu=e.mbu,
        step_overhead_s=e.step_overhead_s,
        seq_overhead_s=e.seq_overhead_s,
    )


def needed_tensor_parallel(i: Inputs, weights: float, context: int) -> int | None:
    """The smallest power-of-two group (dividing the heads) that holds the weights and
    one sequence of KV at `context`; None if no group up to 64 GPUs does."""
    kv_seq = i.arch.kv_bytes_per_token(i.cache_dtype) * context if i.arch else 0
    n = 1
    while n <= 64:
        heads_ok = i.arch is None or i.arch.num_heads % n == 0
        if heads_ok and usable_memory(i, n)[0] - weights >= kv_seq:
            return n
        n *= 2
    return None


def plan(i: Inputs) -> Plan:
    check(i)
    params = i.params or (i.arch.param_count() if i.arch else 0)
    context = _context(i)
    cost = cost_model(i, params)
    lines = [_params_line(i, params), _weights_line(i, params)]
    usable, how = usable_memory(i, i.tensor_parallel)
    weights = cost.model.weight_bytes
    if weights >= usable:
        raise _does_not_fit(i, weights, usable, how, context)
    lora = _lora_bytes(i)
    budget = usable - weights - lora
    formula = f"{how} - weights = {_gib(usable)} - {_gib(weights)}"
    if lora:
        lines.append(_lora_line(i, lora))
        formula = f"{how} - weights - LoRA slots = {_gib(usable)} - {_gib(weights)} - {_gib(lora)}"
    lines.append(Line("kv_budget_bytes", "KV budget", budget, "bytes", formula))
    max_seqs = _kv_lines(i, cost, context, budget, lines) if i.arch else None
    _decode_lines(i, cost, context, max_seqs, lines)
    prompt = i.prompt_tokens or context
    prefill = cost.prefill_step(prompt)
    roofs = cost.roofs([(0, prompt)])
    lines.append(
        Line(
            "prefill_s",
            f"prefill of {prompt:,} tokens (TTFT, no queueing)",
            prefill,
            "s",
            f"overhead + max(FLOPs / peak, bytes / bandwidth) = {_ms(cost.overhead(1))} + "
            f"max({_ms(roofs.compute_s)}, {_ms(roofs.memory_s)}): {roofs.bound}-bound",
        )
    )
    _little_lines(i, cost, context, prefill, max_seqs, lines)
    return Plan(i, cost, context, lines, _notes(i))


def _context(i: Inputs) -> int:
    if i.context:
        return i.context
    if i.prompt_tokens and i.output_tokens:
        return i.prompt_tokens + i.output_tokens
    if i.arch and i.arch.max_context:
        return i.arch.max_context
    if i.arch is None:
        return i.prompt_tokens or 1
    raise CapacityInputError("--context", "--context is needed: the model names no context")


def _does_not_fit(
    i: Inputs, weights: float, usable: float, how: str, context: int
) -> CapacityInputError:
    needed = needed_tensor_parallel(i, weights, context)
    advice = (
        f"it needs --tensor-parallel {needed}"
        if needed
        else "no tensor-parallel group of up to 64 GPUs holds it"
    )
    return CapacityInputError(
        "--tensor-parallel",
        f"--tensor-parallel {i.tensor_parallel}: the weights ({_gib(weights)} in "
        f"{i.weights_dtype}) do not fit the {_gib(usable)} usable ({how}); {advice} "
        "(or a smaller --dtype)",
    )


def _params_line(i: Inputs, params: int) -> Line:
    if i.params is not None or i.arch is None:
        return Line("params", "parameters", params, "params", "given (--params)")
    a = i.arch
    tied = "tied" if a.tie_word_embeddings else "untied"
    formula = (
        f"vocab x hidden x {1 if a.tie_word_embeddings else 2} ({tied} head) + layers x "
        f"(attention + 3 x hidden x intermediate + norms) + final norm, with layers={a.num_layers} "
        f"hidden={a.hidden_size} heads={a.num_heads} kv_heads={a.num_kv_heads} "
        f"head_dim={a.head_dim} intermediate={a.intermediate_size} vocab={a.vocab_size}"
    )
    return Line("params", "parameters", params, "params", formula)


def _weights_line(i: Inputs, params: int) -> Line:
    per = DTYPE_BYTES[i.weights_dtype]
    return Line(
        "weights_bytes",
        "weights",
        params * per,
        "bytes",
        f"params x bytes per weight = {params:,} x {per:g} ({i.weights_dtype})",
    )


def _lora_bytes(i: Inputs) -> float:
    """The LoRA slots, in the model's activation dtype (bf16 under quantized weights)."""
    if not i.max_loras or i.arch is None:
        return 0.0
    dtype = i.weights_dtype if i.weights_dtype in ("fp32", "fp16", "bf16") else "bf16"
    return i.max_loras * i.arch.lora_bytes_per_slot(i.max_lora_rank, dtype)


def _lora_line(i: Inputs, total: float) -> Line:
    return Line(
        "lora_bytes",
        f"LoRA slots ({i.max_loras} of rank {i.max_lora_rank})",
        total,
        "bytes",
        "max_loras x layers x rank x (A inputs + B outputs of q/k/v/o/gate/up/down) x bytes "
        f"= {i.max_loras} x {_size(total / i.max_loras)}",
    )


def _kv_lines(i: Inputs, cost: CostModel, context: int, budget: float, lines: list[Line]) -> int:
    a = i.arch
    assert a is not None
    per_token = cost.model.kv_bytes_per_token
    per_seq = per_token * context
    max_tokens = int(budget // per_token)
    max_seqs = max_tokens // context
    if max_seqs < 1:
        raise CapacityInputError(
            "--context",
            f"--context {context:,}: one sequence needs {_gib(per_seq)} of KV, the budget is "
            f"{_gib(budget)}; shorten --context, use a smaller --kv-dtype or more "
            "--tensor-parallel",
        )
    lines += [
        Line(
            "kv_bytes_per_token",
            "KV per token",
            per_token,
            "bytes",
            _kv_formula(i),
        ),
        Line(
            "kv_bytes_per_sequence",
            f"KV per sequence at {context:,} tokens",
            per_seq,
            "bytes",
            f"KV per token x context = {_size(per_token)} x {context:,}",
        ),
        Line(
            "max_kv_tokens",
            "max tokens in the KV cache",
            max_tokens,
            "tokens",
            f"floor(KV budget / KV per token) = floor({_gib(budget)} / {_size(per_token)})",
        ),
        Line(
            "max_concurrent_sequences",
            f"max concurrent sequences at {context:,} tokens",
            max_seqs,
            "sequences",
            f"floor(max KV tokens / context) = floor({max_tokens:,} / {context:,})",
        ),
    ]
    return max_seqs


def _decode_lines(
    i: Inputs, cost: CostModel, context: int, max_seqs: int | None, lines: list[Line]
) -> None:
    one, per_step = decode_step(i, cost, 1, context)
    weights_read = cost.model.weight_bytes
    kv_read = context * cost.model.kv_bytes_per_token
    bandwidth = cost.gpu.hbm_bandwidth * cost.mbu
    lines.append(
        Line(
            "decode_step_floor_s",
            "decode step at batch 1",
            one,
            "s",
            f"overhead + bytes read / bandwidth = {_ms(cost.overhead(1))} + "
            f"({_size(weights_read)} weights + {_size(kv_read)} KV) / {bandwidth / 1e12:.3g} TB/s",
        )
    )
    batch = max_seqs or 1
    full, _ = decode_step(i, cost, batch, context)
    roofs = cost.roofs(cost.decode_chunks(batch, context))
    lines.append(
        Line(
            "decode_step_at_max_batch_s",
            f"decode step at batch {batch:,}",
            full,
            "s",
            f"overhead + max(FLOPs / peak, bytes / bandwidth) = {_ms(cost.overhead(batch))} + "
            f"max({_ms(roofs.compute_s)}, {_ms(roofs.memory_s)}): {roofs.bound}-bound",
        )
    )
    turn = cost.compute_bound_batch(context)
    lines.append(
        Line(
            "compute_bound_batch",
            "decode turns compute-bound at batch",
            None if turn is None else math.ceil(turn),
            "batch",
            "weights time / (FLOPs per token / peak - KV per sequence / bandwidth)"
            + (
                " = never (KV reads grow as fast as compute)" if turn is None else f" = {turn:,.1f}"
            ),
        )
    )
    lines += [
        Line(
            "decode_tokens_per_s_per_sequence",
            "decode tokens/s per sequence (batch 1)",
            per_step / one,
            "tok/s",
            f"tokens per step / decode step = {per_step:g} / {_ms(one)}",
        ),
        Line(
            "decode_tokens_per_s_ceiling",
            f"decode tokens/s in total (batch {batch:,})",
            batch * per_step / full,
            "tok/s",
            f"batch x tokens per step / decode step = {batch:,} x {per_step:g} / {_ms(full)}",
        ),
    ]


def _little_lines(
    i: Inputs,
    cost: CostModel,
    context: int,
    prefill: float,
    max_seqs: int | None,
    lines: list[Line],
) -> None:
    required: float | None = None
    formula = "no --rate given"
    if i.rate is not None:
        service, how = _service_time(i, cost, context, prefill, max_seqs)
        required = i.rate * service
        formula = f"rate x time in system = {i.rate:g}/s x {service:.3g} s ({how})"
    lines.append(
        Line(
            "required_concurrency",
            "concurrency required (Little's law)",
            required,
            "sequences",
            formula,
        )
    )
    fits = required is None or max_seqs is None or math.ceil(required) <= max_seqs
    verdict = "the weights and one sequence fit"
    if required is not None and max_seqs is not None:
        sign = "<=" if fits else ">"
        verdict = f"ceil(required) {math.ceil(required):,} {sign} max concurrent {max_seqs:,}"
    lines.append(Line("fits", "fits", fits, "bool", verdict))


def _service_time(
    i: Inputs, cost: CostModel, context: int, prefill: float, max_seqs: int | None
) -> tuple[float, str]:
    """--duration-s, or TTFT + (output - 1) x the decode step at the batch Little's law
    itself implies (iterated to a fixed point; the batch only grows)."""
    if i.duration_s is not None:
        return i.duration_s, "--duration-s"
    assert i.rate is not None and i.output_tokens is not None
    cap = 4 * (max_seqs or 1) + 1  # far past fitting: stop iterating
    batch = 1
    service = prefill
    for _ in range(LITTLE_ITERATIONS):
        step, per_step = decode_step(i, cost, batch, context)
        service = prefill + (i.output_tokens - 1) / per_step * step
        grown = max(1, math.ceil(i.rate * service))
        if grown == batch:
            break
        if grown > cap:
            return service, (
                f"TTFT + {i.output_tokens - 1:,} decode steps at batch {batch:,}; still "
                "growing: the queue does not settle"
            )
        batch = grown
    return service, f"TTFT + {i.output_tokens - 1:,} decode steps at batch {batch:,}"


def _kv_formula(i: Inputs) -> str:
    a, dtype = i.arch, i.cache_dtype
    assert a is not None
    shape = f"2 x {a.num_layers} x {a.num_kv_heads} x "
    if dtype in KV_SCALE_BYTES:
        return (
            "2 x layers x kv_heads x (head_dim x bytes + scale bytes) = "
            f"{shape}({a.head_dim} x {DTYPE_BYTES[dtype]:g} + {KV_SCALE_BYTES[dtype]:g}) ({dtype}, "
            "a float32 scale per token and KV head)"
        )
    return (
        f"2 x layers x kv_heads x head_dim x bytes = {shape}{a.head_dim} x "
        f"{DTYPE_BYTES[dtype]:g} ({dtype})"
    )


def _notes(i: Inputs) -> list[str]:
    notes = [f"roofline model; efficiency: {i.efficiency.source}"]
    if i.tensor_parallel > 1:
        notes.append(
            f"tensor parallel {i.tensor_parallel}: memory, bandwidth and FLOP/s summed over the "
            "group; collectives not modelled"
        )
    return notes


def with_efficiency(i: Inputs, efficiency: Efficiency) -> Inputs:
    return replace(i, efficiency=efficiency)


# -- formatting -------------------------------------------------------------------------


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


def _size(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.3g} ms"


def show(line: Line) -> str:
    """A value with its unit, for people."""
    v = line.value
    if v is None:
        return "-"
    if line.unit == "bool":
        return "yes" if v else "no"
    if line.unit == "bytes":
        return _size(float(v))
    if line.unit == "s":
        return _ms(float(v)) if v < 1 else f"{v:,.2f} s"
    if line.unit == "tok/s":
        return f"{v:,.1f} tok/s"
    if isinstance(v, float):
        return f"{v:,.1f}"
    return f"{v:,}"


def format_plan(p: Plan) -> str:
    width = max(len(line.label) for line in p.lines)
    rows = [f"{line.label:<{width}}  {show(line):>14}  {line.formula}" for line in p.lines]
    return "\n".join([*rows, *(f"note: {n}" for n in p.notes)])
