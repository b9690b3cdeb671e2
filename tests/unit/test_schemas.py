from __future__ import annotations

import pytest

from gateway.api.schemas import ChatCompletionRequest, CompletionRequest, decode
from gateway.errors import InvalidRequest


def _error(body: bytes) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        decode(body, ChatCompletionRequest)
    return info.value


def test_missing_messages_names_the_field() -> None:
    error = _error(b'{"model": "m"}')
    assert error.param == "messages"
    assert "messages" in error.message


def test_nested_and_range_errors_name_the_path() -> None:
    assert _error(b'{"model": "m", "messages": [{"role": "boss"}]}').param == "messages[0].role"
    assert _error(b'{"model": "m", "messages": [{"role": "user"}], "temperature": 9}').param == (
        "temperature"
    )
    assert _error(b'{"model": "m", "messages": [], "max_tokens": 1}').param == "messages"


def test_malformed_json_is_invalid_request() -> None:
    error = _error(b'{"model": ')
    assert error.status == 400
    assert "JSON" in error.message


def test_unknown_fields_are_ignored_and_content_parts_join() -> None:
    body = (
        b'{"model": "m", "service_tier": "auto", "messages": [{"role": "user", '
        b'"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}'
    )
    request = decode(body, ChatCompletionRequest)
    assert request.messages[0].text() == "ab"


def test_completion_prompt_as_text_or_token_ids() -> None:
    assert decode(b'{"model": "m", "prompt": "hi"}', CompletionRequest).prompt == "hi"
    assert decode(b'{"model": "m", "prompt": [1, 2]}', CompletionRequest).prompt == [1, 2]
    with pytest.raises(InvalidRequest):
        decode(b'{"model": "m", "prompt": [-1]}', CompletionRequest)


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    body = b'{"model": "m", "messages": [{"role": "user"}], "max_tokens": 5, '
    request = decode(body + b'"max_completion_tokens": 7}', ChatCompletionRequest)
    assert request.output_limit() == 7
