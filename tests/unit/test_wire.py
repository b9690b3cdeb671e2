"""The replica wire protocol (backend/wire.py): what one side encodes, the other decodes
to the same value, and an engine error crosses it as the same error."""

from __future__ import annotations

import time
from dataclasses import replace

import msgspec
import pytest

from backend.errors import (
    DeadlineExceededError,
    EngineDeadError,
    EngineError,
    InvalidParameterError,
    OverloadedError,
    PromptTooLongError,
    RequestFailedError,
)
from backend.outputs import RequestOutput, TokenLogprobs
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from backend.wire import ERRORS, LINES, ErrorLine, GenerateBody, OutputLine


def test_an_output_line_decodes_to_the_same_output() -> None:
    out = RequestOutput(
        "r1",
        " hi",
        [5, 6],
        True,
        "length",
        3,
        2,
        cached_tokens=1,
        token_times=[1.0, 2.0],
        index=1,
        logprobs=[TokenLogprobs(5, -0.5, 1, [(5, -0.5)]), TokenLogprobs(6, -1.0, 2, [])],
    )
    line = msgspec.json.encode(OutputLine(out))
    assert line.startswith(b'{"type":"output"')
    assert LINES.decode(line) == OutputLine(out)


@pytest.mark.parametrize(
    "error",
    [
        InvalidParameterError("temperature must be >= 0", param="temperature"),
        PromptTooLongError(100, 64),
        OverloadedError("queue full", retry_after_s=7.5),
        DeadlineExceededError("too late"),
        RequestFailedError("a step failed"),
        EngineDeadError("stopped"),
    ],
)
def test_an_engine_error_crosses_the_wire_as_itself(error: EngineError) -> None:
    line = msgspec.json.encode(ErrorLine.of(error))
    decoded = LINES.decode(line)
    assert isinstance(decoded, ErrorLine)
    assert ERRORS.decode(line) == decoded
    again = decoded.exception()
    expected = InvalidParameterError if isinstance(error, InvalidParameterError) else type(error)
    assert type(again) is expected
    assert str(again) == str(error)
    assert getattr(again, "param", None) == getattr(error, "param", None)
    assert getattr(again, "retry_after_s", None) == getattr(error, "retry_after_s", None)


def test_an_unknown_engine_error_is_a_failed_request() -> None:
    line = ErrorLine.of(EngineError("something else"))
    assert (line.kind, line.message) == ("request_failed", "something else")


@pytest.mark.parametrize(
    "line",
    [
        b'{"request_id": "r", "text": "", "token_ids": [], "finished": true}',  # untagged
        b'{"type": "error", "kind": "no_such_kind", "message": "?"}',
        b'{"type": "output"}',
        b"not json",
    ],
)
def test_a_line_outside_the_protocol_does_not_decode(line: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        LINES.decode(line)


def test_a_request_crosses_whole_with_its_deadline_on_the_replicas_clock() -> None:
    """Every EngineRequest field arrives as sent; the deadline travels relative (clocks
    differ by host) and is absolute again on the replica's clock."""
    params = SamplingParams(max_tokens=3, seed=9)
    deadline = time.monotonic() + 30.0
    asked = EngineRequest([4, 5], params, "r1", priority=3, tenant="t", weight=2, deadline=deadline)
    wire = msgspec.json.encode(GenerateBody.sent(asked))
    sent = msgspec.json.decode(wire)
    assert sent["deadline"] is None and 29.0 < sent["timeout_s"] <= 30.0
    received = msgspec.json.decode(wire, type=GenerateBody).received()
    assert EngineRequest.fields_of(received) == EngineRequest.fields_of(asked) | {
        "deadline": received.deadline
    }
    assert received.deadline is not None and abs(received.deadline - deadline) < 1.0
    no_deadline = msgspec.json.decode(
        msgspec.json.encode(GenerateBody.sent(replace(asked, deadline=None))), type=GenerateBody
    )
    assert no_deadline.received().deadline is None
