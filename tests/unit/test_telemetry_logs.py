"""JSON log lines: one object per line, with request id and trace id when there are any."""

from __future__ import annotations

import json
import logging
import sys

import pytest
from opentelemetry import trace

from gateway.settings import SettingsError
from gateway.telemetry.logs import JsonFormatter, log_format, request_id_var
from tests.unit.test_telemetry_tracing import capture_spans


def _record(message: str, *args: object, **extra: object) -> logging.LogRecord:
    return logging.getLogger("tollgate.test").makeRecord(
        "tollgate.test", logging.INFO, __file__, 1, message, args, None, extra=extra
    )


def test_plain_record_outside_a_request() -> None:
    entry = json.loads(JsonFormatter().format(_record("engine ready: model %s", "tiny")))
    assert entry["message"] == "engine ready: model tiny"
    assert entry["level"] == "info"
    assert entry["logger"] == "tollgate.test"
    assert "request_id" not in entry
    assert "trace_id" not in entry


def test_request_and_trace_ids_and_extra_fields() -> None:
    token = request_id_var.set("req_abc")
    try:
        with (
            capture_spans(),  # a recording provider, so the span has a real trace id
            trace.get_tracer("test").start_as_current_span("root") as span,
        ):
            line = JsonFormatter().format(_record("request finished", http_status=200))
            expected = format(span.get_span_context().trace_id, "032x")
    finally:
        request_id_var.reset(token)
    entry = json.loads(line)
    assert entry["request_id"] == "req_abc"
    assert entry["trace_id"] == expected
    assert entry["http_status"] == 200
    assert "\n" not in line


def test_exceptions_stay_on_one_line() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = logging.getLogger("t").makeRecord(
            "t", logging.ERROR, __file__, 1, "failed", (), sys.exc_info()
        )
    line = JsonFormatter().format(record)
    entry = json.loads(line)
    assert entry["exc_type"] == "RuntimeError"
    assert "boom" in entry["exc"]
    assert "\n" not in line


def test_log_format_setting() -> None:
    assert log_format({}) == "json"
    assert log_format({"TOLLGATE_LOG_FORMAT": "TEXT"}) == "text"
    with pytest.raises(SettingsError, match="TOLLGATE_LOG_FORMAT"):
        log_format({"TOLLGATE_LOG_FORMAT": "xml"})
