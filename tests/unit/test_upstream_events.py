"""gateway/dispatch/upstream.py's StreamReader on server-sent events as an upstream sends
them: the text deltas of a completion that came in one read make one output, tool-call
and logprob deltas stay one each, and an event that is not UTF-8 or not JSON is read or
refused as such."""

from __future__ import annotations

from typing import Any, cast

import msgspec
import pytest

from backend import SamplingParams
from gateway.dispatch.routing import Replica
from gateway.dispatch.upstream import OpenAIUpstreamClient, StreamReader, TargetFailed


def _reader(n: int = 1) -> StreamReader:
    # The client is only asked about usage at [DONE], which these lines never reach.
    client = cast(OpenAIUpstreamClient, None)
    params = SamplingParams(max_tokens=16, n=n)
    return StreamReader(client, Replica("http://up"), "req_1", prompt_tokens=3, params=params)


def _event(*choices: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode({"object": "chat.completion.chunk", "choices": choices})


def test_text_deltas_in_a_row_make_one_output_and_the_rest_stay_apart() -> None:
    reader = _reader(n=2)
    outs = reader.lines(
        [
            _event({"index": 0, "delta": {"role": "assistant", "content": ""}}),
            b"",
            _event({"index": 0, "delta": {"content": "a"}}),
            b"",
            _event({"index": 0, "delta": {"content": "b"}}),
            _event({"index": 1, "delta": {"content": "x"}}),
            _event({"index": 1, "delta": {"content": "y"}, "logprobs": {"content": []}}),
            _event({"index": 1, "delta": {"tool_calls": [{"index": 0, "id": "c1"}]}}),
            _event({"index": 0, "delta": {"content": "c"}, "finish_reason": "stop"}),
        ]
    )
    assert [(o.index, o.text, o.completion_tokens) for o in outs] == [
        (0, "ab", 2),
        (1, "x", 1),
        (1, "y", 2),  # its logprobs go as the upstream sent them
        (1, "", 3),  # a tool-call delta
        (0, "c", 3),
    ]
    assert outs[0].first_token_time is not None and outs[4].first_token_time is None
    assert outs[2].relayed_logprobs == {"content": []}
    assert outs[3].tool_calls == [{"index": 0, "id": "c1"}]
    assert reader.finish == {0: "stop"} and reader.started and not reader.done


def test_an_event_that_is_not_utf8_is_read_with_replacement() -> None:
    (out,) = _reader().lines([b'data: {"choices":[{"index":0,"delta":{"content":"\xff ok"}}]}'])
    assert out.text == "\ufffd ok"


def test_an_event_that_is_not_json_fails_the_attempt_as_retryable() -> None:
    with pytest.raises(TargetFailed) as failed:
        _reader().lines([b"data: {not json"])
    assert failed.value.retryable
