"""Tollgate's inference engine. See INTERFACE.md for the contract with the gateway.

Importing this package does no work: AsyncEngine (and with it torch) is imported on
first attribute access."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from backend.config import EngineConfig
from backend.errors import (
    CheckpointError,
    EngineDeadError,
    EngineError,
    InvalidParameterError,
    PromptTooLongError,
)
from backend.outputs import EngineStats, RequestOutput, TokenLogprobs
from backend.requests import EngineRequest, LoRARequest
from backend.sampling import SamplingParams

if TYPE_CHECKING:
    from backend.engine.async_engine import AsyncEngine

__all__ = [
    "AsyncEngine",
    "CheckpointError",
    "EngineConfig",
    "EngineDeadError",
    "EngineError",
    "EngineRequest",
    "EngineStats",
    "InvalidParameterError",
    "LoRARequest",
    "PromptTooLongError",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprobs",
]


def __getattr__(name: str) -> Any:
    if name == "AsyncEngine":
        from backend.engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(f"module 'backend' has no attribute {name!r}")
