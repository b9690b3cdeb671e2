"""What a caller asks the engine for."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from backend.sampling import SamplingParams

# The PEFT target modules the engine adapts (backend/layers/lora.py TARGETS), here without
# torch so that the gateway checks an adapter's folder with the engine's own list.
LORA_TARGET_MODULES = frozenset(
    ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
)


def unsupported_lora_options(config: dict[str, Any]) -> list[str]:
    """The PEFT options of an adapter_config.json that the engine does not apply: served
    anyway, the adapter would answer silently wrong (DoRA's magnitudes, trained biases,
    whole modules saved beside the LoRA pairs, per-module ranks and alphas ignored)."""
    found = [name for name in ("use_dora",) if config.get(name)]
    if config.get("bias", "none") != "none":
        found.append("bias")
    found += [n for n in ("modules_to_save", "rank_pattern", "alpha_pattern") if config.get(n)]
    return found


@dataclass(frozen=True)
class LoRARequest:
    """The LoRA adapter a request runs with: `name` identifies it in the engine's adapter
    cache, `path` is its PEFT folder (adapter_config.json, adapter_model.safetensors),
    loaded on demand."""

    name: str
    path: str


@dataclass(frozen=True)
class EngineRequest:
    """One generation request, whole from the gateway's dispatch seam to the scheduler:
    the gateway's GenerateRequest (gateway/dispatch/engine_client.py) is one, so is a
    replica's `POST /internal/generate` body (backend/wire.py GenerateBody), and
    AsyncEngine.generate and Engine.add_request take it as it is; each of the scheduler's
    Requests holds it. A field added here reaches the scheduler in process and over the
    wire with no signature changed on the way. A dataclass, not a msgspec struct: msgspec
    decodes dataclasses too, and the engine runs where no web stack is installed."""

    prompt: str | list[int]  # text is tokenized by the engine
    params: SamplingParams
    request_id: str
    priority: int = 0
    tenant: str | None = None
    weight: int = 1  # the tenant's share of the token budget under contention
    # time.monotonic() by which the first token is due, on this host's clock (the wire
    # carries it relative: GenerateBody.timeout_s).
    deadline: float | None = None
    lora: LoRARequest | None = None  # None: the base model

    @classmethod
    def fields_of(cls, request: EngineRequest) -> dict[str, Any]:
        """`request`'s EngineRequest fields alone (a subclass carries more)."""
        return {f.name: getattr(request, f.name) for f in fields(cls)}
