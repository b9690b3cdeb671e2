"""Fixtures of the integration tests."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.telemetry.logs import JsonFormatter
from tests.unit.test_telemetry_tracing import capture_spans


class Lines(logging.Handler):
    """The JSON lines the server would write (the request id is read as they are made)."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[dict[str, object]] = []
        self.setFormatter(JsonFormatter())

    def emit(self, record: logging.LogRecord) -> None:
        self.entries.append(json.loads(self.format(record)))


@pytest.fixture
def log_lines() -> Iterator[Lines]:
    lines, logger = Lines(), logging.getLogger("tollgate.requests")
    logger.addHandler(lines)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Every span the process ends, kept in memory."""
    with capture_spans() as exporter:
        yield exporter
