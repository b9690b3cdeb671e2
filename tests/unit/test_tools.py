"""Tool calling: plans from tools + tool_choice, the output parsers, the streaming hold."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from gateway.api.tools import (
    PARSERS,
    NamedToolChoice,
    ToolDef,
    ToolStream,
    assembled,
    plan,
)
from gateway.core.errors import InvalidRequest
from gateway.dispatch.engine_client import TARGET_PARSES

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME: dict[str, Any] = {"type": "function", "function": {"name": "get_time"}}


def tools(*defs: dict[str, Any]) -> list[ToolDef]:
    return msgspec.convert(list(defs), list[ToolDef])


def named(name: str) -> NamedToolChoice:
    return msgspec.convert({"type": "function", "function": {"name": name}}, NamedToolChoice)


def test_no_tools_means_no_plan_and_a_forced_choice_without_tools_is_refused() -> None:
    assert plan(None, None, True, "hermes") is None
    assert plan([], "auto", True, "hermes") is None
    with pytest.raises(InvalidRequest) as caught:
        plan(None, "required", True, "hermes")
    assert caught.value.param == "tool_choice"


def test_named_choice_forces_the_functions_schema_and_yields_one_call() -> None:
    p = plan(tools(WEATHER, TIME), named("get_weather"), True, "hermes")
    assert p is not None
    assert p.forced == WEATHER["function"]["parameters"]  # type: ignore[index]
    content, calls = p.calls('{"city": "Oslo"}')
    assert content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    assert calls[0].id.startswith("call_")


def test_an_unknown_named_function_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="not among the tools"):
        plan(tools(WEATHER), named("launch"), True, "hermes")


def test_a_target_that_parses_its_own_output_gets_a_checked_but_inactive_plan() -> None:
    """An upstream honours tool_choice itself: nothing is forced or parsed here, but a
    choice that names no tool is still refused before anything is sent."""
    for choice in (None, "auto", "required", "none", named("get_time")):
        p = plan(tools(WEATHER, TIME), choice, True, TARGET_PARSES)
        assert p is not None and not p.active and p.forced is None
    with pytest.raises(InvalidRequest, match="not among the tools"):
        plan(tools(WEATHER), named("launch"), True, TARGET_PARSES)


def test_streamed_tool_call_deltas_are_assembled_call_by_call() -> None:
    deltas: list[dict[str, Any]] = [
        {"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather"}},
        {"index": 0, "function": {"arguments": '{"city": '}},
        {"index": 1, "id": "call_b", "type": "function", "function": {"name": "get_time"}},
        {"index": 0, "function": {"arguments": '"Oslo"}'}},
        {"index": 1, "function": {"arguments": "{}"}},
    ]
    calls = assembled(deltas)
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [
        ("call_a", "get_weather", '{"city": "Oslo"}'),
        ("call_b", "get_time", "{}"),
    ]
    (unnamed,) = assembled([{"index": 0, "function": {"name": "f", "arguments": "{}"}}])
    assert unnamed.id.startswith("call_")  # an upstream that sent no id gets one


def test_required_forces_a_list_of_calls_and_parallel_false_allows_one() -> None:
    p = plan(tools(WEATHER, TIME), "required", False, "hermes")
    assert p is not None and p.forced is not None
    assert p.forced["minItems"] == 1 and p.forced["maxItems"] == 1
    names = [a["properties"]["name"]["enum"] for a in p.forced["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    _, calls = p.calls('[{"name": "get_time", "parameters": {}}]')
    assert [c.function.name for c in calls] == ["get_time"]
    parallel = plan(tools(WEATHER), "required", True, "hermes")
    assert parallel is not None and parallel.forced is not None
    assert "maxItems" not in parallel.forced


def test_a_forced_output_cut_short_is_a_clear_error() -> None:
    p = plan(tools(WEATHER), "required", True, "hermes")
    assert p is not None
    with pytest.raises(InvalidRequest, match="max_tokens"):
        p.calls('[{"name": "get_weather", "param')


def test_bad_and_duplicate_function_names_are_refused() -> None:
    bad: dict[str, Any] = {"type": "function", "function": {"name": "no spaces"}}
    with pytest.raises(InvalidRequest, match="letters"):
        plan(tools(bad), "auto", True, "hermes")
    with pytest.raises(InvalidRequest, match="unique"):
        plan(tools(TIME, TIME), "auto", True, "hermes")


def test_hermes_parser_finds_every_block_and_keeps_the_text_before() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    content, calls = PARSERS["hermes"].parse(text)
    assert content == "Let me check."
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].function.arguments) == {"city": "Rome"}
    assert PARSERS["hermes"].parse("no calls here") == ("no calls here", [])
    assert PARSERS["hermes"].parse("<tool_call>not json</tool_call>")[1] == []


def test_llama3_parser_reads_json_calls_with_or_without_python_tag() -> None:
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima"}}; '
    text += '{"name": "get_time", "parameters": {}}'
    content, calls = PARSERS["llama3_json"].parse(text)
    assert content is None
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert PARSERS["llama3_json"].parse("The answer is 4.") == ("The answer is 4.", [])
    assert PARSERS["llama3_json"].parse('{"no": "name"}') == ('{"no": "name"}', [])


def _stream(p: object, pieces: list[str]) -> tuple[str, ToolStream]:
    assert p is not None
    stream = ToolStream(p)  # type: ignore[arg-type]
    return "".join(stream.feed(piece)[0] for piece in pieces), stream


def test_streaming_holds_back_a_hermes_call_but_sends_the_text_before_it() -> None:
    p = plan(tools(WEATHER), "auto", True, "hermes")
    call = ['_call>{"name": "get_weather", ', '"arguments": {}}', "</tool_call>"]
    pieces = ["Sure", ", one", " moment <tool", *call]
    sent, stream = _stream(p, pieces)
    assert sent == "Sure, one moment "
    content, calls = stream.finish()
    assert content is None and [c.function.name for c in calls] == ["get_weather"]


def test_streaming_releases_a_partial_marker_that_turns_out_to_be_text() -> None:
    p = plan(tools(WEATHER), "auto", True, "hermes")
    sent, stream = _stream(p, ["a <to", "y> b"])
    assert sent == "a <toy> b"
    assert stream.finish() == ("", [])


def test_streaming_a_llama_call_holds_everything_and_plain_text_flows() -> None:
    p = plan(tools(WEATHER), "auto", True, "llama3_json")
    sent, stream = _stream(p, [" ", '{"name": "get_weather",', ' "parameters": {"city": "X"}}'])
    assert sent == ""
    assert [c.function.name for c in stream.finish()[1]] == ["get_weather"]
    sent, stream = _stream(p, ["Hello", ' {"a": 1}'])
    assert sent == 'Hello {"a": 1}'


def test_streaming_a_forced_output_sends_no_content() -> None:
    p = plan(tools(WEATHER), named("get_weather"), True, "hermes")
    sent, stream = _stream(p, ['{"city"', ': "Oslo"}'])
    assert sent == ""
    # One spacing for every call's arguments (issue 32 item 17): OpenAI's, none.
    assert stream.finish()[1][0].function.arguments == '{"city":"Oslo"}'


def _streamed(p: object, text: str) -> tuple[list[dict[str, Any]], list[Any]]:
    """`text` fed a character at a time (as a model writes it): every tool-call delta
    sent, the end's included, and the calls the finished output parses into."""
    assert p is not None
    stream = ToolStream(p)  # type: ignore[arg-type]
    deltas = [delta for ch in text for delta in stream.feed(ch)[1]]
    _, calls = stream.finish()
    assert stream.scanner is not None
    return deltas + stream.scanner.finish(calls), calls


def _by_call(deltas: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    calls: dict[int, list[dict[str, Any]]] = {}
    for delta in deltas:
        calls.setdefault(delta["index"], []).append(delta)
    return calls


def _check_incremental(deltas: list[dict[str, Any]], calls: list[Any]) -> None:
    """OpenAI's shape: per call a first delta with id, type, name and arguments "", then
    fragments (several) that add up to the finished call's arguments."""
    by_call = _by_call(deltas)
    assert sorted(by_call) == list(range(len(calls)))
    for index, call in enumerate(calls):
        first, *rest = by_call[index]
        assert first["function"] == {"name": call.function.name, "arguments": ""}
        assert first["id"].startswith("call_") and first["type"] == "function"
        assert all(set(d) == {"index", "function"} for d in rest)
        assert "".join(d["function"]["arguments"] for d in rest) == call.function.arguments
        assert len(rest) > 1  # streamed as generated, not whole after the name


def test_hermes_calls_stream_their_arguments_as_they_are_generated() -> None:
    p = plan(tools(WEATHER, TIME), "auto", True, "hermes")
    text = (
        'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", '
        '"days": 3}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
        '{"zone": "utc"}}\n</tool_call>'
    )
    deltas, calls = _streamed(p, text)
    _check_incremental(deltas, calls)
    assert [c.function.arguments for c in calls] == ['{"city":"Rome","days":3}', '{"zone":"utc"}']


def test_arguments_read_before_the_name_follow_the_calls_first_delta() -> None:
    p = plan(tools(TIME), "auto", True, "hermes")
    text = '<tool_call>{"arguments": {"zone": "utc"}, "name": "get_time"}</tool_call>'
    deltas, [call] = _streamed(p, text)
    assert [d["function"] for d in deltas] == [
        {"name": "get_time", "arguments": ""},
        {"arguments": '{"zone":"utc"}'},
    ]
    assert call.function.arguments == '{"zone":"utc"}'


def test_a_named_calls_arguments_stream_in_the_spacing_of_the_whole_call() -> None:
    """Spaces, escapes and numbers as json.dumps writes the whole arguments: what was
    streamed is a prefix of the finished call's, whatever the model wrote."""
    p = plan(tools(WEATHER), named("get_weather"), True, "hermes")
    text = '{ "city" : "Caf\\u00e9 \\/ \\ud83d\\ude00" ,\n "days": 1E1, "ok": [true , null, 2.50] }'
    deltas, [call] = _streamed(p, text)
    _check_incremental(deltas, [call])
    assert (
        call.function.arguments == '{"city":"Café / \U0001f600","days":10.0,"ok":[true,null,2.5]}'
    )


def test_a_required_list_of_calls_streams_each_call() -> None:
    p = plan(tools(WEATHER, TIME), "required", True, "hermes")
    text = '[{"name": "get_time", "parameters": {"zone": "cet"}}, '
    text += '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}]'
    deltas, calls = _streamed(p, text)
    _check_incremental(deltas, calls)
    assert [c.function.name for c in calls] == ["get_time", "get_weather"]


def test_arguments_written_as_a_json_string_are_sent_whole_at_the_end() -> None:
    p = plan(tools(WEATHER), "auto", True, "llama3_json")
    text = '{"name": "get_weather", "parameters": "{\\"city\\": \\"X\\"}"}'
    deltas, [call] = _streamed(p, text)
    first, rest = _by_call(deltas)[0]
    assert first["function"]["arguments"] == ""
    assert rest["function"]["arguments"] == call.function.arguments == '{"city": "X"}'
