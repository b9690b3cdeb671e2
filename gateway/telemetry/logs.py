"""Structured logs: one JSON object per line, carrying the request id and trace id of the
request being served, so a log line, a trace and a usage row can be joined.

Log calls pass identifiers and counts only — never prompt or completion text, never keys.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

from opentelemetry import trace

request_id_var: ContextVar[str | None] = ContextVar("tollgate_request_id", default=None)
# The caller's own x-request-id, when it sent a well-formed one (echoed back as it is).
client_request_id_var: ContextVar[str | None] = ContextVar("tollgate_client_id", default=None)

# What every LogRecord has; anything else on a record came from `extra=` and is logged.
_STANDARD = set(logging.makeLogRecord({}).__dict__) | {
    "message",
    "asctime",
    "taskName",
    "color_message",  # uvicorn's copy of the message with terminal colours
}


def fields(record: logging.LogRecord) -> dict[str, Any]:
    """A record's fields beyond its message: the request and trace it belongs to, and what
    the call passed in `extra=`."""
    entry: dict[str, Any] = {}
    request_id = request_id_var.get()
    if request_id is not None:
        entry["request_id"] = request_id
    client_request_id = client_request_id_var.get()
    if client_request_id is not None:
        entry["client_request_id"] = client_request_id
    span = trace.get_current_span().get_span_context()
    if span.is_valid:
        entry["trace_id"] = format(span.trace_id, "032x")
        entry["span_id"] = format(span.span_id, "016x")
    for key, value in record.__dict__.items():
        if key not in _STANDARD and not key.startswith("_"):
            entry[key] = value
    return entry


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **fields(record),
        }
        if record.exc_info:
            entry["exc_type"] = record.exc_info[0].__name__ if record.exc_info[0] else None
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
# C0 and C1 controls and Unicode's line and paragraph separators: anything a terminal or a
# log viewer may take as the start of a new line (or use to rewrite the current one).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape_controls(text: str) -> str:
    """Control characters as Python escapes them (\\n, \\x1b, \\u2028)."""
    return _CONTROL.sub(lambda match: _escape(match.group()), text)


def _escape(char: str) -> str:
    code = ord(char)
    return _SHORT_ESCAPES.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


class TextFormatter(logging.Formatter):
    """One record, one line: the message, then its fields as key=value (the JSON lines'
    fields: request id, method, path, status, tenant, timings...). Text a client sent (a
    decoded path with %0A, say) cannot forge a record of its own, and a traceback stays
    on its record's line, escaped."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)  # the message, then any traceback
        message = self.formatMessage(record)  # the line's start (record.message is set now)
        pairs = "".join(f" {key}={_text_value(value)}" for key, value in fields(record).items())
        return escape_controls(message + pairs + line[len(message) :])


def _text_value(value: Any) -> str:
    """A value as one token: quoted (JSON) when it holds spaces, quotes or '='."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if text and not any(c in text for c in ' "=') and text.isprintable():
        return text
    return json.dumps(text, ensure_ascii=False)


def configure_logging(level: str, fmt: str = "json") -> None:
    """Root logging for a server process: JSON lines on stderr (or plain text)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # httpx logs every request at INFO: one line per replica stats poll, every second.
    logging.getLogger("httpx").setLevel(logging.WARNING)
