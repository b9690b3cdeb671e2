"""The engine's LoRA adapters: validated when a request names one, made resident in one
of `max_loras` device slots when the scheduler admits it (read from its PEFT folder,
evicting the least recently used adapter that no running request uses), and looked up
by slot when the step is built."""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from backend.errors import AdapterRankError, UnknownAdapterError
from backend.layers.lora import TARGETS, LoRALinear
from backend.requests import LoRARequest, unsupported_lora_options

log = logging.getLogger(__name__)
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# base_model.model.model.layers.3.self_attn.q_proj.lora_A[.default].weight
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclass(frozen=True)
class AdapterSpec:
    """What adapter_config.json says, checked against the engine."""

    rank: int
    scaling: float  # lora_alpha / r (or / sqrt(r) with use_rslora)
    targets: frozenset[str]


def read_spec(path: Path, max_rank: int) -> AdapterSpec:
    """Raises UnknownAdapterError (missing or unsupported) or AdapterRankError."""
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise UnknownAdapterError(f"adapter at {path} has no readable {CONFIG_FILE}") from exc
    if not (path / WEIGHTS_FILE).is_file():
        raise UnknownAdapterError(f"adapter at {path} has no {WEIGHTS_FILE}")
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise UnknownAdapterError(f"adapter at {path} is not a LoRA adapter")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise UnknownAdapterError(f"adapter at {path}: r must be a positive integer")
    if rank > max_rank:
        raise AdapterRankError(f"adapter rank {rank} is above max_lora_rank {max_rank}")
    unsupported = unsupported_lora_options(config)
    if unsupported:
        raise UnknownAdapterError(
            f"adapter at {path} uses {unsupported}, which this engine ignores"
        )
    targets = config.get("target_modules")
    targets = [targets] if isinstance(targets, str) else targets
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise UnknownAdapterError(f"adapter at {path}: target_modules must be module names")
    unknown = sorted(set(targets) - TARGETS.keys())
    if not targets or unknown:
        raise UnknownAdapterError(
            f"adapter at {path} targets {unknown or 'nothing'}; "
            f"this engine adapts {sorted(TARGETS)}"
        )
    scaling = alpha / (rank**0.5 if config.get("use_rslora") else rank)
    return AdapterSpec(rank, float(scaling), frozenset(targets))


class AdapterSlots:
    """`max_loras` device slots in every LoRALinear, and which adapter fills each."""

    def __init__(self, layers: dict[str, LoRALinear], max_loras: int, max_rank: int) -> None:
        self.layers = layers
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.resident: OrderedDict[LoRARequest, int] = OrderedDict()  # least recent first
        self._specs: dict[LoRARequest, AdapterSpec] = {}
        self.num_loads = 0
        # The resident adapters' names, replaced whole (read from other threads: stats).
        self.loaded: tuple[str, ...] = ()

    def check(self, lora: LoRARequest) -> AdapterSpec:
        """Validate the adapter (once per name and path; any thread)."""
        spec = self._specs.get(lora)
        if spec is None:
            spec = read_spec(Path(lora.path), self.max_rank)
            self._check_shapes(lora, spec)
            self._specs[lora] = spec
        return spec

    def _check_shapes(self, lora: LoRARequest, spec: AdapterSpec) -> None:
        """Every A is [r, in] and every B [out, r] of the layer it targets (read from
        the file's header alone), so a load at admission cannot fail on them."""
        try:
            self._check_header(lora, spec)
        except (OSError, SafetensorError) as exc:  # not a safetensors file: the request's 400
            raise UnknownAdapterError(f"adapter {lora.name}: unreadable {WEIGHTS_FILE}") from exc

    def _check_header(self, lora: LoRARequest, spec: AdapterSpec) -> None:
        with safe_open(str(Path(lora.path) / WEIGHTS_FILE), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                found = _KEY.search(key)
                if found is None or found[2] not in spec.targets:
                    continue
                name, shard = TARGETS[found[2]]
                layer = self.layers.get(f"{found[1]}.{name}")
                if layer is None:
                    raise UnknownAdapterError(f"adapter {lora.name}: no layer for {key}")
                rows = layer.shard_sizes[shard]
                want = [spec.rank, layer.in_features] if found[3] == "A" else [rows, spec.rank]
                if list(f.get_slice(key).get_shape()) != want:
                    raise UnknownAdapterError(f"adapter {lora.name}: {key} is not {want}")

    def slot(self, lora: LoRARequest | None) -> int:
        """The slot of a resident adapter; -1 for the base model."""
        return -1 if lora is None else self.resident[lora]

    def make_resident(self, lora: LoRARequest, in_use: set[LoRARequest]) -> bool:
        """Load `lora` if it is not resident, into a free slot or the least recently used
        one no adapter in `in_use` holds; False when every slot is in use. Raises
        UnknownAdapterError when its files no longer load."""
        if lora in self.resident:
            self.resident.move_to_end(lora)
            return True
        taken = set(self.resident.values())
        free = [s for s in range(self.max_loras) if s not in taken]
        if free:
            slot = free[0]
        else:
            victim = next((r for r in self.resident if r not in in_use), None)
            if victim is None:
                return False
            slot = self.resident.pop(victim)
            self.loaded = tuple(sorted(r.name for r in self.resident))
        try:
            self._load(lora, slot)
        except Exception as exc:  # changed on disk since it was checked: the slot stays free
            log.exception("LoRA adapter %s could not be loaded", lora.name)
            raise UnknownAdapterError(f"adapter {lora.name} could not be loaded") from exc
        self.resident[lora] = slot
        self.loaded = tuple(sorted(r.name for r in self.resident))
        return True

    def _load(self, lora: LoRARequest, slot: int) -> None:
        spec = self.check(lora)
        pairs: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        with safe_open(str(Path(lora.path) / WEIGHTS_FILE), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                found = _KEY.search(key)
                if found is None or found[2] not in spec.targets:
                    continue
                pairs.setdefault((found[1], found[2]), {})[found[3]] = f.get_tensor(key)
        by_layer: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (index, target), ab in pairs.items():
            name, shard = TARGETS[target]
            key = f"{index}.{name}"
            if key not in self.layers or ab.keys() != {"A", "B"}:
                raise UnknownAdapterError(f"adapter {lora.name}: bad weights for {key}")
            by_layer.setdefault(key, {})[shard] = (ab["A"], ab["B"])
        for key, layer in self.layers.items():
            layer.fill(slot, by_layer.get(key, {}), spec.scaling)
        self.num_loads += 1
