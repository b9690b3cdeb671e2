"""Structured outputs and tool calling through the HTTP API, on the built-in tiny model:
its weights write little more than noise, so only constrained decoding makes its output
valid, and every output here is checked against its schema."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal, cast

import httpx
import jsonschema
import openai
import pytest
from langchain_core.messages import AIMessage
from langchain_openai import ChatOpenAI
from litestar.testing import AsyncTestClient
from openai.types.chat import ChatCompletionFunctionToolParam, ChatCompletionMessageParam
from pydantic import BaseModel, Field, SecretStr

from backend import AsyncEngine, EngineConfig
from backend.builtin import BUILTIN_MODEL_DIR
from backend.server import create_backend_app
from gateway.app import create_app
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.dispatch.remote import RemoteEngineClient
from gateway.settings import Settings
from tenants import db
from tests.conftest import serving

Client = AsyncTestClient[Any] | httpx.AsyncClient

# Every string and number bounded: a model this small never stops an open-ended one.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age", "colour", "admin"],
}
PERSON_MAX_TOKENS = 128  # the longest output PERSON allows, every character an escape
WEATHER_ARGS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
}
TIME_ARGS = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet"]}},
    "required": ["zone"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_ARGS}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_ARGS}},
]
TOOL_ARGS = {"get_weather": WEATHER_ARGS, "get_time": TIME_ARGS}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL_MAX_TOKENS = 160


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    """SQLite only: these tests are about the API, the ledger is tested on both."""
    url = f"sqlite:///{tmp_path / 'structured.db'}"
    db.upgrade(url)
    return url


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _body(model: str, **fields: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Describe a person."}]
    return {"model": model, "messages": messages, "max_tokens": PERSON_MAX_TOKENS, **fields}


async def _post(
    client: Client, key: str, body: dict[str, Any], path: str = "/v1/chat/completions"
) -> Any:
    return await client.post(path, json=body, headers=_auth(key))


async def _chat(client: Client, key: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await _post(client, key, body)
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    return reply


def _events(text: str) -> list[dict[str, Any]]:
    lines = [
        line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")
    ]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _assert_calls(calls: list[dict[str, Any]], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] in names
        arguments = json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, TOOL_ARGS[call["function"]["name"]])


async def test_fifty_json_schema_outputs_match_their_schema(
    client: Client, tenant_key: str, engine_client: InProcessEngineClient
) -> None:
    spec = {"name": "person", "schema": PERSON, "strict": True}
    bodies = [
        _body(
            engine_client.model_name,
            seed=seed,
            response_format={"type": "json_schema", "json_schema": spec},
        )
        for seed in range(50)
    ]
    replies = await asyncio.gather(*(_chat(client, tenant_key, body) for body in bodies))
    outputs = [reply["choices"][0] for reply in replies]
    for choice in outputs:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(
            json.loads(choice["message"]["content"]), {**PERSON, "additionalProperties": False}
        )
    assert len({c["message"]["content"] for c in outputs}) > 10  # sampled, not one answer


async def test_json_object_gives_objects(
    client: Client, tenant_key: str, engine_client: InProcessEngineClient
) -> None:
    """Any object: its strings are unbounded, so some outputs run out of max_tokens; every
    one that ends is a JSON object, and every one begins as one."""
    bodies = [
        _body(engine_client.model_name, n=16, seed=seed, response_format={"type": "json_object"})
        for seed in (0, 100, 200, 300)
    ]
    replies = await asyncio.gather(*(_chat(client, tenant_key, body) for body in bodies))
    choices = [choice for reply in replies for choice in reply["choices"]]
    assert all(c["message"]["content"].startswith("{") for c in choices)
    finished = [c["message"]["content"] for c in choices if c["finish_reason"] == "stop"]
    assert finished
    assert all(isinstance(json.loads(text), dict) for text in finished)


async def test_guided_regex_choice_and_grammar_are_obeyed(
    client: Client, tenant_key: str, engine_client: InProcessEngineClient
) -> None:
    model = engine_client.model_name
    base = {"model": model, "prompt": "The answer is", "max_tokens": 32, "n": 8, "seed": 7}
    regex = await _post(
        client, tenant_key, {**base, "guided_regex": r"(yes|no), [0-9]{1,3}"}, "/v1/completions"
    )
    assert regex.status_code == 200, regex.text
    for choice in regex.json()["choices"]:
        assert re.fullmatch(r"(yes|no), [0-9]{1,3}", choice["text"]), choice["text"]
    colours = ["red", "green", "blue"]
    chosen = await _chat(client, tenant_key, _body(model, n=8, seed=3, guided_choice=colours))
    assert {c["message"]["content"] for c in chosen["choices"]} <= set(colours)
    grammar = 'start: "sum(" NUM "," NUM ")"\nNUM: /[0-9]{1,3}/'
    summed = await _chat(client, tenant_key, _body(model, n=8, seed=5, guided_grammar=grammar))
    for choice in summed["choices"]:
        assert re.fullmatch(r"sum\([0-9]{1,3},[0-9]{1,3}\)", choice["message"]["content"])


async def test_refused_constraints_name_what_is_wrong(
    client: Client, tenant_key: str, engine_client: InProcessEngineClient
) -> None:
    model = engine_client.model_name
    unsupported = {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}
    spec = {"name": "cond", "schema": unsupported}
    response = await _post(
        client,
        tenant_key,
        _body(model, response_format={"type": "json_schema", "json_schema": spec}),
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and '"if"' in error["message"]
    assert error["param"] == "response_format"
    both = await _post(client, tenant_key, _body(model, guided_regex="a+", guided_choice=["a"]))
    assert both.status_code == 400
    assert "guided_regex" in both.json()["error"]["message"]
    assert both.json()["error"]["param"] == "guided_choice"
    bad_regex = await _post(client, tenant_key, _body(model, guided_regex="(unclosed"))
    assert bad_regex.status_code == 400 and "regex" in bad_regex.json()["error"]["message"]
    assert bad_regex.json()["error"]["param"] == "guided_regex"  # the field the client sent


async def test_named_and_required_tool_choices_always_give_valid_calls(
    client: Client, tenant_key: str, engine_client: InProcessEngineClient
) -> None:
    model = engine_client.model_name
    base = _body(model, tools=TOOLS, max_tokens=CALL_MAX_TOKENS, n=8)
    named = await _chat(client, tenant_key, {**base, "tool_choice": NAMED, "seed": 11})
    required = await _chat(
        client,
        tenant_key,
        {**base, "tool_choice": "required", "parallel_tool_calls": False, "seed": 12},
    )
    for choice in named["choices"]:
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] is None
        [call] = choice["message"]["tool_calls"]
        _assert_calls([call], {"get_weather"})
    for choice in required["choices"]:
        assert choice["finish_reason"] == "tool_calls"
        assert len(choice["message"]["tool_calls"]) == 1  # parallel_tool_calls: false
        _assert_calls(choice["message"]["tool_calls"], set(TOOL_ARGS))


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
async def test_streamed_tool_calls_arrive_as_deltas_and_no_call_text_as_content(
    client: Client, tenant_key: str, engine_client: InProcessEngineClient, tool_choice: Any
) -> None:
    body = _body(
        engine_client.model_name,
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=CALL_MAX_TOKENS,
        parallel_tool_calls=False,  # this model, left to it, lists calls until max_tokens
        n=4,
        seed=21,
        stream=True,
    )
    response = await _post(client, tenant_key, body)
    assert response.status_code == 200, response.text
    for index in range(4):
        deltas = [
            c["choices"][0] for c in _events(response.text) if c["choices"][0]["index"] == index
        ]
        assert deltas[0]["delta"]["content"] is None  # OpenAI's: null, not ""
        assert "".join(d["delta"].get("content") or "" for d in deltas) == ""
        entries = [call for d in deltas for call in d["delta"].get("tool_calls", [])]
        calls = _assembled(entries)
        assert [entry["index"] for entry in entries] == sorted(e["index"] for e in entries)
        _assert_calls(calls, set(TOOL_ARGS) if tool_choice == "required" else {"get_weather"})
        assert deltas[-1]["finish_reason"] == "tool_calls"


def _assembled(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Streamed tool-call entries put together as a client does: OpenAI's shape is a
    first entry per call with its id, type and name and empty arguments, then entries
    that add to its arguments."""
    calls: dict[int, dict[str, Any]] = {}
    for entry in entries:
        if entry["index"] not in calls:
            assert entry["function"]["arguments"] == "" and entry["id"], entry
            calls[entry["index"]] = {**entry, "function": {**entry["function"]}}
        else:
            assert "id" not in entry and "name" not in entry["function"], entry
            calls[entry["index"]]["function"]["arguments"] += entry["function"]["arguments"]
    assert list(calls) == list(range(len(calls)))
    return list(calls.values())


async def test_tools_and_tool_turns_are_rendered_into_the_prompt(
    client: Client, tenant_key: str, engine_client: InProcessEngineClient
) -> None:
    model = engine_client.model_name
    question = [{"role": "user", "content": "Weather in Oslo?"}]
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    answered = [
        *question,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]

    async def prompt_tokens(**fields: Any) -> int:
        reply = await _chat(client, tenant_key, {"model": model, "max_tokens": 1, **fields})
        return int(reply["usage"]["prompt_tokens"])

    plain = await prompt_tokens(messages=question)
    with_tools = await prompt_tokens(messages=question, tools=TOOLS)
    with_turns = await prompt_tokens(messages=answered, tools=TOOLS)
    assert plain < with_tools < with_turns
    rendered = engine_client.render_chat(
        [
            *question,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {**call, "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
                ],
            },
        ],
    )
    assert (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in rendered
    )


@pytest.mark.parametrize("stream", [False, True])
async def test_a_forced_call_cut_short_by_max_tokens_ends_with_length(
    client: Client, tenant_key: str, engine_client: InProcessEngineClient, stream: bool
) -> None:
    """Whole, the cut-short arguments are the message's text; streamed, they were already
    sent as the call's arguments as they came (as OpenAI and vLLM stream them), so the
    stream ends with the call begun, no content, and "length"."""
    body = _body(engine_client.model_name, tools=TOOLS, tool_choice=NAMED, max_tokens=3)
    response = await _post(client, tenant_key, {**body, "stream": stream})
    assert response.status_code == 200, response.text
    if stream:
        deltas = [c["choices"][0] for c in _events(response.text)]
        assert "".join(d["delta"].get("content") or "" for d in deltas) == ""
        entries = [call for d in deltas for call in d["delta"].get("tool_calls", [])]
        [call] = _assembled(entries)
        text, finish = call["function"]["arguments"], deltas[-1]["finish_reason"]
    else:
        [choice] = response.json()["choices"]
        assert "tool_calls" not in choice["message"]
        text, finish = choice["message"]["content"], choice["finish_reason"]
    assert finish == "length"
    assert text.startswith('{"')  # the arguments, begun


class Person(BaseModel):
    name: str = Field(min_length=1, max_length=8)
    age: int = Field(ge=0, le=120)
    colour: Literal["red", "green", "blue"]


class GetWeather(BaseModel):
    """The weather forecast for a city."""

    city: str = Field(min_length=1, max_length=10)
    days: int = Field(ge=1, le=7)


@pytest.fixture
async def base_url(settings: Settings, engine_client: InProcessEngineClient) -> AsyncIterator[str]:
    async with serving(create_app(settings, engine_client=engine_client)) as url:
        yield url + "/v1"


async def test_the_openai_sdk_gets_tool_calls_and_parsed_outputs(
    base_url: str, tenant_key: str, engine_client: InProcessEngineClient
) -> None:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=tenant_key, max_retries=0)
    model = engine_client.model_name
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Weather?"}]
    called = await client.chat.completions.create(
        model=model,
        messages=messages,
        tools=cast("list[ChatCompletionFunctionToolParam]", TOOLS),
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=CALL_MAX_TOKENS,
        seed=1,
    )
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    _assert_calls([call.model_dump() for call in choice.message.tool_calls], set(TOOL_ARGS))
    parsed = await client.chat.completions.parse(
        model=model, messages=messages, response_format=Person, max_tokens=PERSON_MAX_TOKENS, seed=2
    )
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person)
    await client.close()


async def test_the_openai_sdk_stream_helper_sees_calls_and_no_content(
    base_url: str, tenant_key: str, engine_client: InProcessEngineClient
) -> None:
    """Issue 32 item 17: a first delta of content "" made the stream helper emit a
    content event before the calls; arguments now stream after each call's name, and
    a named call's arguments have the same spacing as a listed call's (none)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=tenant_key, max_retries=0)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Weather?"}]
    tools = cast("list[ChatCompletionFunctionToolParam]", TOOLS)
    events: list[str] = []
    async with client.chat.completions.stream(
        model=engine_client.model_name,
        messages=messages,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=CALL_MAX_TOKENS,
        seed=3,
    ) as stream:
        async for event in stream:
            events.append(event.type)
        final = await stream.get_final_completion()
    assert not [e for e in events if e.startswith("content")], events
    assert "tool_calls.function.arguments.done" in events
    # The arguments come as they are generated, not whole after the name.
    assert events.count("tool_calls.function.arguments.delta") > 3, events
    [call] = final.choices[0].message.tool_calls or []
    arguments = call.function.arguments  # type: ignore[union-attr]
    assert json.loads(arguments) and ", " not in arguments and '": ' not in arguments
    await client.close()


async def test_streamed_parallel_and_single_calls_share_one_spacing_and_come_in_pieces(
    base_url: str, tenant_key: str, engine_client: InProcessEngineClient
) -> None:
    """Chunks iterated with the openai SDK and tool calls accumulated as clients do: a
    call from a list of calls ("required", the parallel calls' shape) and a named call
    each stream their arguments in several
    fragments after a first delta with id, type, name and "", no content but null, and
    the same spacing (none) as the whole answer's."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=tenant_key, max_retries=0)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Weather?"}]
    tools = cast("list[ChatCompletionFunctionToolParam]", TOOLS)
    for choice in ("required", NAMED):
        stream = await client.chat.completions.create(
            model=engine_client.model_name,
            messages=messages,
            tools=tools,
            tool_choice=choice,  # type: ignore[arg-type]
            max_tokens=CALL_MAX_TOKENS,
            parallel_tool_calls=False,  # left to it, this model lists calls until max_tokens
            seed=5,
            stream=True,
        )
        calls: dict[int, dict[str, Any]] = {}
        fragments: dict[int, int] = {}
        finish = None
        async for chunk in stream:
            delta = chunk.choices[0].delta
            assert delta.content is None, delta
            finish = chunk.choices[0].finish_reason or finish
            for entry in delta.tool_calls or []:
                function = entry.function
                assert function is not None
                if entry.index not in calls:
                    assert entry.id and entry.type == "function" and function.arguments == ""
                    calls[entry.index] = {"name": function.name, "arguments": ""}
                else:
                    assert entry.id is None and function.name is None
                    calls[entry.index]["arguments"] += function.arguments or ""
                    fragments[entry.index] = fragments.get(entry.index, 0) + 1
        assert finish == "tool_calls" and calls, choice
        for index, call in calls.items():
            arguments = call["arguments"]
            jsonschema.validate(json.loads(arguments), TOOL_ARGS[call["name"]])
            assert arguments == json.dumps(json.loads(arguments), separators=(",", ":"))
            assert fragments[index] > 1, (choice, fragments)
    await client.close()


async def test_langchain_bind_tools_and_with_structured_output(
    base_url: str, tenant_key: str, engine_client: InProcessEngineClient
) -> None:
    chat = ChatOpenAI(
        base_url=base_url,
        api_key=SecretStr(tenant_key),
        model=engine_client.model_name,
        max_completion_tokens=CALL_MAX_TOKENS,
        max_retries=0,
        seed=3,
    )
    message = await chat.bind_tools(
        [GetWeather], tool_choice="required", parallel_tool_calls=False
    ).ainvoke("Weather in Oslo?")
    assert isinstance(message, AIMessage)
    [call] = message.tool_calls
    assert call["name"] == "GetWeather"
    GetWeather.model_validate(call["args"])
    person = await chat.with_structured_output(Person).ainvoke("Describe a person.")
    assert isinstance(person, Person)


async def test_a_remote_replica_enforces_constraints_and_tools(
    settings: Settings, tenant_key: str, tmp_path: Path
) -> None:
    """The constraint travels in the replica wire's params (all n completions of it: the
    stream ends after the last, not the first); a refused one comes back a 400."""
    engine = AsyncEngine.from_pretrained(BUILTIN_MODEL_DIR, EngineConfig(max_num_seqs=8))
    async with serving(create_backend_app(engine, BUILTIN_MODEL_DIR, secret="s3cret")) as url:
        remote = await RemoteEngineClient.connect([url], "s3cret", tmp_path)
        try:
            gateway = serving(create_app(settings, engine_client=remote))  # in this loop: remote's
            async with gateway as gateway_url, httpx.AsyncClient(base_url=gateway_url) as client:
                model = remote.model_name
                spec = {"name": "person", "schema": PERSON}
                fmt = {"type": "json_schema", "json_schema": spec}
                reply = await _chat(
                    client, tenant_key, _body(model, n=4, seed=9, response_format=fmt)
                )
                for choice in reply["choices"]:
                    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
                named = _body(model, tools=TOOLS, tool_choice=NAMED, max_tokens=CALL_MAX_TOKENS)
                called = await _chat(client, tenant_key, named)
                _assert_calls(called["choices"][0]["message"]["tool_calls"], {"get_weather"})
                bad = {"name": "bad", "schema": {"type": "object", "if": {}, "then": {}}}
                refused = await _post(
                    client,
                    tenant_key,
                    _body(model, response_format={"type": "json_schema", "json_schema": bad}),
                )
                assert refused.status_code == 400, refused.text
                assert '"if"' in refused.json()["error"]["message"]
        finally:
            await remote.close()
