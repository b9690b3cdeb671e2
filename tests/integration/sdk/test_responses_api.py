"""The Responses API with the official `openai` client against a real server: the same
answer as chat, whole and streamed with its typed events, billed once; state refused."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.dispatch.engine_client import InProcessEngineClient
from tenants.models import UsageEvent

INSTRUCTIONS = "Answer about Python."
QUESTION = "What does json.dumps do?"


def _args(engine: InProcessEngineClient, **extra: Any) -> dict[str, Any]:
    return {
        "model": engine.model_name,
        "instructions": INSTRUCTIONS,
        "input": QUESTION,
        "max_output_tokens": 12,
        "temperature": 0,
        **extra,
    }


async def _chat(client: openai.AsyncOpenAI, engine: InProcessEngineClient, max_tokens: int) -> Any:
    return await client.chat.completions.create(
        model=engine.model_name,
        messages=[
            {"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": QUESTION},
        ],
        max_tokens=max_tokens,
        temperature=0,
    )


async def test_a_response_is_the_chat_answer(
    client: openai.AsyncOpenAI, engine_client: InProcessEngineClient
) -> None:
    response = await client.responses.create(**_args(engine_client))
    chat = await _chat(client, engine_client, 12)
    assert response.output_text == chat.choices[0].message.content != ""
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    total = response.usage.input_tokens + response.usage.output_tokens
    assert response.usage.total_tokens == total
    expected = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert response.status == expected


async def test_cut_short_by_max_output_tokens_is_incomplete(
    client: openai.AsyncOpenAI, engine_client: InProcessEngineClient
) -> None:
    chat = await _chat(client, engine_client, 3)
    assert chat.choices[0].finish_reason == "length"  # the premise: 3 tokens do not finish
    response = await client.responses.create(**_args(engine_client, max_output_tokens=3))
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 3


async def test_input_items_with_text_parts_are_the_same_prompt(
    client: openai.AsyncOpenAI, engine_client: InProcessEngineClient
) -> None:
    plain = await client.responses.create(**_args(engine_client))
    items = await client.responses.create(
        **_args(
            engine_client,
            instructions=None,
            input=[
                {"role": "system", "content": INSTRUCTIONS},
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What does json."},
                        {"type": "input_text", "text": "dumps do?"},
                    ],
                },
            ],
        )
    )
    assert items.output_text == plain.output_text
    assert items.usage is not None and plain.usage is not None
    assert items.usage.input_tokens == plain.usage.input_tokens


async def test_the_stream_sends_the_typed_events_in_order(
    client: openai.AsyncOpenAI, engine_client: InProcessEngineClient
) -> None:
    whole = await client.responses.create(**_args(engine_client))
    stream = await client.responses.create(**_args(engine_client), stream=True)
    events = [event async for event in stream]
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole.status}",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text and final.id == events[0].response.id  # type: ignore[union-attr]
    assert final.usage is not None and whole.usage is not None
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens
    done = events[-2]
    assert done.type == "response.output_item.done" and done.item.status == whole.status


async def test_the_sdk_stream_helper_collects_the_final_response(
    client: openai.AsyncOpenAI, engine_client: InProcessEngineClient
) -> None:
    whole = await client.responses.create(**_args(engine_client, max_output_tokens=40))
    assert whole.status == "completed"  # the helper's final event is response.completed
    async with client.responses.stream(**_args(engine_client, max_output_tokens=40)) as stream:
        final = await stream.get_final_response()
    assert final.output_text == whole.output_text


async def test_each_response_is_one_ledger_row(
    client: openai.AsyncOpenAI,
    engine_client: InProcessEngineClient,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    whole = await client.responses.create(**_args(engine_client))
    stream = await client.responses.create(**_args(engine_client), stream=True)
    async for _ in stream:
        pass
    async with sessions() as session:
        rows = (await session.scalars(select(UsageEvent))).all()
    assert [r.endpoint for r in rows] == ["responses", "responses"]
    assert whole.usage is not None
    for row in rows:
        assert (row.prompt_tokens, row.completion_tokens) == (
            whole.usage.input_tokens,
            whole.usage.output_tokens,
        )


async def test_a_streamed_response_is_replayed_for_its_idempotency_key(
    base_url: str, tenant_key: str, engine_client: InProcessEngineClient
) -> None:
    headers = {"Authorization": f"Bearer {tenant_key}", "Idempotency-Key": "resp-1"}
    body = _args(engine_client, stream=True, temperature=1.0)  # a rerun would differ
    async with httpx.AsyncClient(base_url=base_url, headers=headers) as http:
        first = await http.post("/responses", json=body)
        again = await http.post("/responses", json=body)
    assert first.status_code == again.status_code == 200
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert first.content.startswith(b"event: response.created\ndata: ")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ],
)
async def test_what_needs_stored_state_is_refused(
    client: openai.AsyncOpenAI,
    engine_client: InProcessEngineClient,
    extra: dict[str, Any],
    param: str,
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(**_args(engine_client, **extra))
    assert refused.value.param == param
    assert refused.value.status_code == 400


async def test_store_false_is_accepted(
    client: openai.AsyncOpenAI, engine_client: InProcessEngineClient
) -> None:
    response = await client.responses.create(**_args(engine_client, store=False))
    assert response.output_text


async def test_a_json_schema_text_format_is_enforced(
    client: openai.AsyncOpenAI, engine_client: InProcessEngineClient
) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    text = {"format": {"type": "json_schema", "name": "verdict", "schema": schema}}
    response = await client.responses.create(
        **_args(engine_client, max_output_tokens=40, text=text)
    )
    assert isinstance(json.loads(response.output_text)["ok"], bool)
