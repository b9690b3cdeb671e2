"""Every `EngineConfig` field as a command-line flag and an environment variable.

Field `max_num_seqs` is `--max-num-seqs` and `TOLLGATE_MAX_NUM_SEQS`; a boolean field
`x` is `--x` / `--no-x`. The knobs are derived from the dataclass, so a new field gets a
flag and a variable without an edit here (HELP only adds its help line). Precedence:
flag, then variable, then the gateway's default, then the dataclass's."""

from __future__ import annotations

import argparse
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields, replace

from backend.config import EngineConfig
from gateway.settings.errors import ConfigError

HELP = {
    "block_size": "tokens per KV block",
    "num_kv_blocks": "KV blocks to allocate; 'none': as many as the byte budget holds",
    "kv_cache_bytes": "KV cache budget on the CPU (bytes, or a size such as 4GiB)",
    "max_num_seqs": "most requests running at once; 'none': 256 on CUDA, 32 on the CPU",
    "max_num_batched_tokens": "most tokens in one step; longer prompts are chunked",
    "max_model_len": "context limit per request; 'none': the model's, capped by the KV pool",
    "dtype": "auto, float32, float16 or bfloat16 (auto: bfloat16 on CUDA, and on a CPU with "
    "AVX512-BF16 or AMX; else float32)",
    "device": "auto, cpu, cuda or cuda:N (auto: CUDA when torch sees a GPU)",
    "quantization": "none, int8 or fp8: the decoder's weights in one byte (int8 per-channel; "
    "fp8 on GPUs of compute capability 8.9+ only)",
    "kv_cache_dtype": "auto, int8 or fp8: the KV cache in one byte a value plus a scale per "
    "token and head, ~twice the tokens (auto: the compute dtype; fp8 on GPUs of 8.9+)",
    "cpu_threads": "torch threads on the CPU; 'none': torch's default",
    "enable_prefix_caching": "reuse the KV of identical prompt prefixes",
    "share_prefix_cache": "let all tenants share one prefix cache",
    "gpu_memory_utilization": "share of the GPU's memory the engine may use (weights + KV)",
    "enforce_eager": "no CUDA graphs for decode steps",
    "async_scheduling": "auto, on or off: schedule step N+1 while step N runs on the device "
    "(auto: on for CUDA, off on the CPU)",
    "speculative_method": "off, ngram (drafts from the request's own text) or draft "
    "(a small model of the same tokenizer, --speculative-model)",
    "num_speculative_tokens": "draft tokens verified per decode step (K)",
    "speculative_model": "the draft model's checkpoint folder (speculative_method draft)",
    "max_loras": "LoRA adapters resident on the device at once (least recently used "
    "evicted); 0: no adapters",
    "max_lora_rank": "the largest LoRA rank accepted (sizes every adapter slot)",
    "attention_backend": "auto, torch or triton (auto: Triton on CUDA, torch on the CPU)",
    "aging_interval_s": "a waiting request rises one priority class per interval; 'none': off",
    "tenant_fairness": "weighted fair share of tokens among tenants of equal class",
    "priority_preemption_gap": "classes a waiting request must outrank a running one by "
    "to preempt it; 'none': never",
    "max_preemptions_per_request": "priority preemptions one request can suffer",
    "prefill_reserve_share": "share of each step's budget kept for new prefills",
    "long_prefill_token_threshold": "most prompt tokens one request gets per step; "
    "'none': max_num_batched_tokens // 4, 0: off",
    "max_waiting_requests": "queued requests past which new ones are shed (503)",
    "max_waiting_tokens": "queued prompt tokens past which new requests are shed (503)",
    "shed_least_urgent_first": "a full queue sheds its least urgent request, not the newcomer",
    "reject_infeasible_deadlines": "refuse (504) requests whose first token cannot make "
    "their deadline",
}
# Variables kept from before the knobs were derived; the derived name wins when both are set.
ALIASES = {"cpu_threads": ("TOLLGATE_ENGINE_THREADS",)}

_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?$", re.IGNORECASE)
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_DEST = "engine_knob__"


class KnobError(ConfigError):
    """A knob's value cannot be used; the one-line message names its flag and variable."""


@dataclass(frozen=True)
class Knob:
    name: str
    kind: type  # int, float, bool or str
    optional: bool  # accepts 'none'
    default: object

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "TOLLGATE_" + self.name.upper()

    def where(self) -> str:
        return f"{self.flag} / {self.env}"

    def parse(self, text: str) -> object:
        """The field's value from a flag's or a variable's text."""
        raw = text.strip()
        if self.optional and raw.lower() in ("none", ""):
            return None
        try:
            return self._convert(raw)
        except ValueError:
            expected = {int: "an integer", float: "a number", bool: "true or false"}
            what = expected.get(self.kind, "a value")
            if self.name.endswith("_bytes"):
                what = "a size such as 268435456, 512MiB or 4GiB"
            extra = " or 'none'" if self.optional else ""
            raise KnobError(f"{self.where()}: expected {what}{extra}, got {text!r}") from None

    def _convert(self, raw: str) -> object:
        if self.kind is bool:
            if raw.lower() in _TRUE + _FALSE:
                return raw.lower() in _TRUE
            raise ValueError(raw)
        if self.kind is int:
            return parse_size(raw) if self.name.endswith("_bytes") else int(raw)
        if self.kind is float:
            return float(raw)
        return raw


def parse_size(text: str) -> int:
    """Bytes from '268435456', '512MiB', '4GiB', '4G' or '1.5GB' (K/M/G/T, powers of 1024
    with or without the 'i'; decimal units are not worth a second meaning here)."""
    match = _SIZE.match(text.strip())
    if not match:
        raise ValueError(text)
    number, unit, _ = match.groups()
    value = float(number) * 1024 ** " kmgt".index(unit.lower() or " ")
    if value != int(value):
        raise ValueError(text)
    return int(value)


def knobs() -> list[Knob]:
    hints = typing.get_type_hints(EngineConfig)
    return [_knob(f.name, hints[f.name], f.default) for f in fields(EngineConfig)]


def _knob(name: str, hint: object, default: object) -> Knob:
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    kinds = [a for a in args if a is not type(None)]
    if len(kinds) != 1 or kinds[0] not in (int, float, bool, str):
        raise TypeError(f"EngineConfig.{name}: no flag for type {hint!r}")
    return Knob(name, kinds[0], type(None) in args, None if default is MISSING else default)


def add_flags(parser: argparse.ArgumentParser, defaults: EngineConfig) -> None:
    """One flag per knob (help shows `defaults`). Values stay text until `from_flags`
    parses them, so a bad one fails with our one-line message, not argparse's usage."""
    group = parser.add_argument_group("engine", "each flag --x-y also reads TOLLGATE_X_Y")
    for knob in knobs():
        default = getattr(defaults, knob.name)
        help_text = f"{HELP.get(knob.name, knob.name)} ({knob.env}, default {default})"
        dest = _DEST + knob.name
        if knob.kind is bool:
            group.add_argument(
                knob.flag,
                dest=dest,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            metavar = knob.name.upper() if knob.kind is str else knob.kind.__name__.upper()
            group.add_argument(
                knob.flag, dest=dest, default=argparse.SUPPRESS, metavar=metavar, help=help_text
            )


def from_env(
    env: Mapping[str, str] | None = None, base: EngineConfig | None = None
) -> EngineConfig:
    """`base` (or the defaults) with every knob whose variable is set."""
    env = os.environ if env is None else env
    values: dict[Knob, object] = {}
    for knob in knobs():
        for name in (knob.env, *ALIASES.get(knob.name, ())):
            if env.get(name, "").strip():
                values[knob] = knob.parse(env[name])
                break
    return _apply(base or EngineConfig(), values)


def from_flags(config: EngineConfig, args: argparse.Namespace) -> EngineConfig:
    """`config` with the flags that were given on the command line."""
    values: dict[Knob, object] = {}
    for knob in knobs():
        given = getattr(args, _DEST + knob.name, None)
        if given is not None:
            values[knob] = given if isinstance(given, bool) else knob.parse(given)
    return _apply(config, values)


def _apply(config: EngineConfig, values: dict[Knob, object]) -> EngineConfig:
    """All the knobs at once: fields checked together (speculative_method draft needs
    speculative_model) are valid only once both are set. An error names the first knob
    given whose field the message names (else the first given)."""
    try:
        return replace(config, **{knob.name: value for knob, value in values.items()})  # type: ignore[arg-type]
    except ValueError as exc:
        named = [knob for knob in values if knob.name in str(exc)] or list(values)
        raise KnobError(f"{named[0].where()}: {exc}") from None
