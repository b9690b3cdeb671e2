from __future__ import annotations

import json
from typing import Any

import pytest

from backend.constraint import Constraint
from gateway.api.schemas import ChatCompletionRequest, CompletionRequest, closed, decode
from gateway.core.errors import InvalidRequest


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


def _chat(**fields: Any) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return decode(json.dumps(body).encode(), ChatCompletionRequest)


PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PERSON}}


def test_response_format_becomes_the_engine_constraint() -> None:
    assert _chat().constraint() is None
    assert _chat(response_format={"type": "text"}).constraint() is None
    assert _chat(response_format={"type": "json_object"}).constraint() == Constraint("json_object")
    spec = {"name": "person", "schema": PERSON, "strict": True}
    constraint = _chat(response_format={"type": "json_schema", "json_schema": spec}).constraint()
    assert constraint is not None and constraint.kind == "json_schema"
    assert json.loads(constraint.spec) == {**PERSON, "additionalProperties": False}
    with pytest.raises(InvalidRequest) as caught:
        _chat(response_format={"type": "xml"})
    assert caught.value.param == "response_format.type"


def test_vllm_guided_fields_become_constraints_on_chat_and_completions() -> None:
    completion = decode(
        b'{"model": "m", "prompt": "a", "guided_regex": "[ab]+"}', CompletionRequest
    )
    assert completion.constraint() == Constraint("regex", "[ab]+", field="guided_regex")
    choice = _chat(guided_choice=["yes", "no"]).constraint()
    assert choice == Constraint("choice", '["yes", "no"]', field="guided_choice")
    grammar = _chat(guided_grammar='start: "x"').constraint()
    assert grammar == Constraint("grammar", 'start: "x"', field="guided_grammar")
    as_text = _chat(guided_json=json.dumps(PERSON)).constraint()
    assert as_text == _chat(guided_json=PERSON).constraint()
    assert as_text is not None and as_text.kind == "json_schema"
    with pytest.raises(InvalidRequest) as caught:
        _chat(guided_json="[1, 2]").constraint()
    assert caught.value.param == "guided_json"


def test_two_constraints_are_refused_naming_both() -> None:
    with pytest.raises(InvalidRequest) as caught:
        _chat(response_format={"type": "json_object"}, guided_regex="a+").constraint()
    assert "response_format" in caught.value.message and "guided_regex" in caught.value.message
    assert caught.value.param == "guided_regex"
    forced = _chat(tools=[WEATHER], tool_choice="required", guided_choice=["a"])
    with pytest.raises(InvalidRequest) as caught:
        forced.constraint(forced.tool_plan("hermes"))
    assert caught.value.param == "tool_choice"


def test_a_forced_tool_choice_constrains_the_output_to_its_schema() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    request = _chat(tools=[WEATHER], tool_choice=named)
    constraint = request.constraint(request.tool_plan("hermes"))
    assert constraint is not None
    assert json.loads(constraint.spec) == {**PERSON, "additionalProperties": False}
    auto = _chat(tools=[WEATHER])
    assert auto.constraint(auto.tool_plan("hermes")) is None


def test_closed_schemas_close_every_object_that_does_not_say_otherwise() -> None:
    schema = {
        "type": "object",
        "properties": {"pet": {"$ref": "#/$defs/Pet"}, "tags": {"type": "array", "items": PERSON}},
        "$defs": {"Pet": {"properties": {"kind": {"enum": ["cat"]}}}},
        "anyOf": [PERSON, {"type": "object", "additionalProperties": True}],
        "allOf": [PERSON],
    }
    out = closed(schema)
    assert "additionalProperties" not in out  # an allOf adds its parts' properties up
    assert out["properties"]["tags"]["items"]["additionalProperties"] is False
    assert out["$defs"]["Pet"]["additionalProperties"] is False
    assert [s["additionalProperties"] for s in out["anyOf"]] == [False, True]
    assert out["allOf"] == [PERSON]
    assert "additionalProperties" not in PERSON  # the request's own schema is left as it was


def test_tool_turns_render_as_templates_expect() -> None:
    function = {"name": "get_weather", "arguments": '{"name": "Oslo"}'}
    call = {"id": "call_1", "type": "function", "function": function}
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    request = _chat(messages=messages)
    rendered = request.template_messages()
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"name": "Oslo"}
    assert rendered[1]["content"] == ""
    assert rendered[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert request.prompt_chars() == len("weather?") + len('{"name": "Oslo"}') + len("sunny")


def test_bad_tool_turns_are_refused_naming_the_field() -> None:
    with pytest.raises(InvalidRequest) as caught:
        _chat(messages=[{"role": "tool", "content": "x"}]).template_messages()
    assert caught.value.param == "messages[0].tool_call_id"
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
    request = _chat(messages=[{"role": "assistant", "tool_calls": [call]}])
    with pytest.raises(InvalidRequest) as caught:
        request.template_messages()
    assert caught.value.param == "messages[0].tool_calls[0].function.arguments"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("guided_json", {"properties": {f"p{i}": {"type": "integer"} for i in range(20_000)}}),
        (
            "response_format",
            {
                "type": "json_schema",
                "json_schema": {"name": "big", "schema": {"enum": ["x"] * 20_000}},
            },
        ),
        ("guided_choice", [f"c{i}" for i in range(1001)]),
    ],
)
def test_a_constraint_past_the_grammar_limits_is_refused_before_it_is_transformed(
    field: str, value: Any
) -> None:
    """Closing and encoding a 4 MB schema took 0.3 s of the event loop, for a grammar the
    engine refuses anyway (issue 32 item 2): the gateway sizes it first."""
    with pytest.raises(InvalidRequest) as caught:
        _chat(**{field: value}).constraint()
    assert caught.value.param == field
    assert caught.value.message.startswith(f"{field} ")
