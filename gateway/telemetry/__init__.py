"""Traces, metrics and structured logs. Counts, times and identifiers only: prompts,
completions and keys never enter telemetry."""

from gateway.telemetry.request import RequestScope, Telemetry, current_request

__all__ = ["RequestScope", "Telemetry", "current_request"]
