"""What a caller asks the engine for."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from backend.sampling import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    """One generation request: AsyncEngine.generate's argument, and the body of a replica's
    `POST /internal/generate` (backend/wire.py's GenerateBody adds its relative deadline).
    The gateway's request at its dispatch seam is one too (gateway/dispatch/engine_client.py
    GenerateRequest), so a field added here reaches the engine in process and over the wire
    with no signature changed on the way. A dataclass, not a msgspec struct: msgspec
    decodes dataclasses too, and the engine runs where no web stack is installed."""

    prompt: str | list[int]  # text is tokenized by the engine
    params: SamplingParams
    request_id: str
    priority: int = 0
    tenant: str | None = None
    weight: int = 1  # the tenant's share of the token budget under contention

    @classmethod
    def fields_of(cls, request: EngineRequest) -> dict[str, Any]:
        """`request`'s EngineRequest fields alone (a subclass carries more)."""
        return {f.name: getattr(request, f.name) for f in fields(cls)}
