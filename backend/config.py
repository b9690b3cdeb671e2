"""Engine configuration: plain data, validated on construction, no torch import."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZATIONS = ("none", "int8", "fp8")  # weight-only (backend/layers/quant.py)
# auto: the model's compute dtype; int8, fp8: one byte per value plus a float32 scale per
# token and KV head (backend/layers/kv_quant.py)
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
ATTENTION_BACKENDS = ("auto", "torch", "triton")  # auto: triton on CUDA, torch on the CPU
# off; ngram: drafts looked up in the request's own tokens; draft: a small second model
SPECULATIVE_METHODS = ("off", "ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16
# The most new tokens of a row over cached keys that attention reads as a decode row reads
# its keys, once for all its queries (a verify row, a short catch-up); longer chunks
# attend as prompts. The torch backend's path (short_query_bias) and the step-cost fit.
SHORT_QUERY_TOKENS = 16
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
# max_num_seqs=None by device: a GPU's batch grows nearly free up to its compute knee (vLLM
# also runs 256); on a CPU each running row costs step time, and 64 at the 256 MiB KV
# default ran out of blocks and recomputed (bench/README.md, issue 14).
ASYNC_SCHEDULING = ("auto", "on", "off")
MAX_NUM_SEQS_BY_DEVICE = {"cuda": 256, "cpu": 32}


@dataclass(frozen=True)
class EngineConfig:
    """How big the engine may get. The KV pool is `num_kv_blocks` if given, else as many
    blocks as fit in `kv_cache_bytes` on the CPU, or in `gpu_memory_utilization` of the
    GPU's memory less what is in use once the weights are loaded. `max_model_len=None`
    takes the model's context, capped by what the KV pool holds. Prompts longer than
    `max_num_batched_tokens` are prefilled in chunks over several steps.

    Prefix caching reuses the KV of identical prompt prefixes; the tenant id salts every
    block hash, so tenants never share cached prompts unless `share_prefix_cache`.

    The scheduling policy knobs (priority aging, tenant fairness, priority preemption,
    prefill protection, load shedding, deadlines, latency targets and the adaptive step
    budget) are described, with their effects and the starvation bound, in
    backend/SCHEDULING.md."""

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int = 256 * 2**20
    max_num_seqs: int | None = None  # None: by device, MAX_NUM_SEQS_BY_DEVICE
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    dtype: str = "auto"  # "auto": see backend.loader.resolve_dtype
    quantization: str = "none"  # one of QUANTIZATIONS: the decoder's weights in one byte
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES: int8/fp8 hold ~twice the tokens
    device: str = "auto"  # "auto": CUDA when torch sees a GPU, else the CPU
    # CPU threads for torch ops (process-wide). None keeps torch's default; on a small
    # machine one thread fewer than the cores leaves the event loop room to stream.
    cpu_threads: int | None = None
    enable_prefix_caching: bool = True
    share_prefix_cache: bool = False  # True: all tenants share one prefix cache
    gpu_memory_utilization: float = 0.9
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps
    # Schedule step N + 1 while step N runs on the device (backend/engine/engine.py):
    # "auto" is on for CUDA and off on the CPU, where nothing runs while the host works.
    async_scheduling: str = "auto"  # one of ASYNC_SCHEDULING
    # -- speculative decoding (backend/engine/speculative.py) --
    speculative_method: str = "off"  # one of SPECULATIVE_METHODS
    num_speculative_tokens: int = 4  # drafts verified per decode row and step (K)
    speculative_model: str | None = None  # the draft checkpoint (method "draft")
    # -- LoRA adapters (backend/engine/lora.py): 0 serves the base model alone --
    max_loras: int = 0  # adapters resident on the device at once (least recently used out)
    max_lora_rank: int = 16  # the largest adapter rank accepted; sizes every slot
    # -- scheduling policy (backend/SCHEDULING.md) --
    aging_interval_s: float | None = 5.0  # a waiting request rises one class per interval
    tenant_fairness: bool = True  # weighted fair share of tokens among equal classes
    priority_preemption_gap: int | None = 2  # None: a waiting request never preempts
    max_preemptions_per_request: int = 3  # for priority; KV pressure may preempt beyond
    prefill_reserve_share: float = 0.25  # of each step's budget, kept for new prefills
    long_prefill_token_threshold: int | None = None  # None: max_num_batched_tokens // 4
    max_waiting_requests: int = 1024  # past it, new requests are shed (overloaded)
    max_waiting_tokens: int = 262_144  # queued prompt tokens; past it, shed too
    shed_least_urgent_first: bool = True  # a full queue sheds its least urgent, not the new
    reject_infeasible_deadlines: bool = True  # deadline_exceeded before any compute
    # -- latency targets (backend/SCHEDULING.md, "Step budget") --
    adaptive_step_budget: bool = True  # size each step's prefill budget by the step-cost fit
    batch_priority: int = 5  # priorities >= this are the batch class; below: interactive
    interactive_ttft_target_ms: float | None = 1000.0  # first token within this
    interactive_itl_target_ms: float | None = 100.0  # each later token within this
    batch_ttft_target_ms: float | None = None  # the batch class has no target by default
    batch_itl_target_ms: float | None = None
    step_time_target_ms: float | None = None  # a cap on every step, whatever runs
    min_prefill_tokens_per_step: int = 32  # the floor that keeps long prefills moving
    latency_window_s: float = 5.0  # a class counts as present this long after it was seen
    # Rows held back beside protected work (batch rows beside interactive work, a tenant's
    # rows past its share beside another's newcomer) may lengthen the step this much.
    filler_slowdown: float | None = 1.3  # None: no row is held back

    def __post_init__(self) -> None:
        for name in ("block_size", "kv_cache_bytes", "max_num_batched_tokens"):
            _positive(name, getattr(self, name))
        _positive("max_lora_rank", self.max_lora_rank)
        if (
            isinstance(self.max_loras, bool)
            or not isinstance(self.max_loras, int)
            or self.max_loras < 0
        ):
            raise ValueError(f"max_loras must be a non-negative integer, got {self.max_loras!r}")
        for name in ("num_kv_blocks", "max_model_len", "cpu_threads", "max_num_seqs"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if not _DEVICE.match(self.device):
            raise ValueError(
                f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}"
            )
        self._check_speculative()
        if self.async_scheduling not in ASYNC_SCHEDULING:
            raise ValueError(
                f"async_scheduling must be one of {ASYNC_SCHEDULING}, got {self.async_scheduling!r}"
            )
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, int | float) or not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
        for name in (
            "enable_prefix_caching",
            "share_prefix_cache",
            "tenant_fairness",
            "reject_infeasible_deadlines",
            "shed_least_urgent_first",
            "enforce_eager",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self._check_policy()

    def _check_speculative(self) -> None:
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_method must be one of {SPECULATIVE_METHODS}, "
                f"got {self.speculative_method!r}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        model = self.speculative_model
        if self.speculative_method == "draft" and not model:
            raise ValueError("speculative_model is required with speculative_method='draft'")
        if model is not None and not (Path(model) / "config.json").is_file():
            raise ValueError(f"speculative_model must be a checkpoint folder, got {model!r}")

    def on_device(self, device_type: str) -> EngineConfig:
        """This config with its device-dependent defaults taken for a "cuda" or "cpu"
        device: what an engine (or a simulated one) actually runs with."""
        if self.max_num_seqs is not None:
            return self
        return replace(self, max_num_seqs=MAX_NUM_SEQS_BY_DEVICE[device_type])

    @property
    def seqs_limit(self) -> int:
        """max_num_seqs once resolved by on_device (an unresolved config is a bug)."""
        if self.max_num_seqs is None:
            raise ValueError("max_num_seqs is unresolved: take config.on_device(...) first")
        return self.max_num_seqs

    def _check_policy(self) -> None:
        aging = self.aging_interval_s
        if aging is not None and (not _is_number(aging) or not aging > 0):
            raise ValueError(f"aging_interval_s must be a positive number or None, got {aging!r}")
        for name in ("max_waiting_requests", "max_waiting_tokens"):
            _positive(name, getattr(self, name))
        if self.priority_preemption_gap is not None:
            _positive("priority_preemption_gap", self.priority_preemption_gap)
        _non_negative("max_preemptions_per_request", self.max_preemptions_per_request)
        if self.long_prefill_token_threshold is not None:
            _non_negative("long_prefill_token_threshold", self.long_prefill_token_threshold)
        share = self.prefill_reserve_share
        if not _is_number(share) or not 0 <= share < 1:
            raise ValueError(f"prefill_reserve_share must be in [0, 1), got {share!r}")
        self._check_latency()

    def _check_latency(self) -> None:
        if not isinstance(self.adaptive_step_budget, bool):
            raise ValueError(
                f"adaptive_step_budget must be a bool, got {self.adaptive_step_budget!r}"
            )
        _non_negative("batch_priority", self.batch_priority)
        _positive("min_prefill_tokens_per_step", self.min_prefill_tokens_per_step)
        for name in (
            "interactive_ttft_target_ms",
            "interactive_itl_target_ms",
            "batch_ttft_target_ms",
            "batch_itl_target_ms",
            "step_time_target_ms",
        ):
            value = getattr(self, name)
            if value is not None and (not _is_number(value) or not 0 < value < math.inf):
                raise ValueError(f"{name} must be a positive number of ms or None, got {value!r}")
        window = self.latency_window_s
        if not _is_number(window) or not 0 <= window < math.inf:
            raise ValueError(f"latency_window_s must be a non-negative number, got {window!r}")
        slowdown = self.filler_slowdown
        if slowdown is not None and (not _is_number(slowdown) or not 1 <= slowdown < math.inf):
            raise ValueError(f"filler_slowdown must be a number >= 1 or None, got {slowdown!r}")

    def targets_s(self, priority: int) -> tuple[float | None, float | None]:
        """(TTFT, inter-token) targets in seconds of a request of this priority."""
        if priority >= self.batch_priority:
            ttft, itl = self.batch_ttft_target_ms, self.batch_itl_target_ms
        else:
            ttft, itl = self.interactive_ttft_target_ms, self.interactive_itl_target_ms
        return (None if ttft is None else ttft / 1000, None if itl is None else itl / 1000)

    @property
    def long_prefill_cap(self) -> int:
        """The most prompt tokens one request gets in a step before others had their turn."""
        threshold = self.long_prefill_token_threshold
        if threshold is None:
            return max(1, self.max_num_batched_tokens // 4)
        return threshold or self.max_num_batched_tokens  # 0: off

    @property
    def prefill_reserve_tokens(self) -> int:
        return int(self.max_num_batched_tokens * self.prefill_reserve_share)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _non_negative(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
