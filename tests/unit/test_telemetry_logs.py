"""JSON log lines: one object per line, with request id and trace id when there are any."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator

import pytest
from opentelemetry import trace

from gateway.settings import Settings, SettingsError
from gateway.telemetry.logs import JsonFormatter, configure_logging, request_id_var
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
    assert Settings.from_env({}).log_format == "json"
    assert Settings.from_env({"TOLLGATE_LOG_FORMAT": "TEXT"}).log_format == "text"
    with pytest.raises(SettingsError, match="TOLLGATE_LOG_FORMAT"):
        Settings.from_env({"TOLLGATE_LOG_FORMAT": "xml"})


@pytest.fixture
def text_logging() -> Iterator[logging.Formatter]:
    """The formatter `tollgate serve` installs with TOLLGATE_LOG_FORMAT=text."""
    root, httpx = logging.getLogger(), logging.getLogger("httpx")
    saved, level, httpx_level = root.handlers[:], root.level, httpx.level
    configure_logging("info", "text")
    formatter = root.handlers[0].formatter
    assert formatter is not None
    try:
        yield formatter
    finally:
        root.handlers[:], root.level = saved, level
        httpx.setLevel(httpx_level)


def test_httpx_request_lines_stay_out_of_info_logs(text_logging: logging.Formatter) -> None:
    # One per replica stats poll, every second: warnings and errors still come through.
    httpx = logging.getLogger("httpx")
    assert not httpx.isEnabledFor(logging.INFO) and httpx.isEnabledFor(logging.WARNING)


FORGED = "2026-12-01 09:00:00,000 INFO gateway.app admin signed in"


@pytest.mark.parametrize("breaker", ["\n", "\r", "\r\n", "\x85", "\u2028", "\x1b[2K\r"])
def test_text_logs_cannot_forge_a_line(text_logging: logging.Formatter, breaker: str) -> None:
    """A decoded path with %0A (or CR, NEL, LINE SEPARATOR, a terminal escape) stays on its
    record's line, escaped, instead of starting a line of its own."""
    line = text_logging.format(_record("GET %s", f"/v1/x{breaker}{FORGED}"))
    assert not any(char in line for char in "\n\r\x1b\x85\u2028")
    assert line.endswith(FORGED)
    assert f"/v1/x{repr(breaker)[1:-1]}{FORGED}" in line  # escaped as Python writes it


def test_text_log_tracebacks_stay_on_the_records_line(text_logging: logging.Formatter) -> None:
    try:
        raise RuntimeError(f"bad\n{FORGED}")
    except RuntimeError:
        record = logging.getLogger("t").makeRecord(
            "t", logging.ERROR, __file__, 1, "failed", (), sys.exc_info()
        )
    line = text_logging.format(record)
    assert "\n" not in line and "RuntimeError: bad\\n" in line
