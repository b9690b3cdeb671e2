"""Batch input files and submissions through the openai SDK, for the batch tests."""

from __future__ import annotations

import json
from typing import Any, Literal

import openai

from tests.conftest import eventually

Endpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]


def chat_lines(model: str, count: int, max_tokens: int = 4) -> bytes:
    """A JSONL batch input of `count` greedy chat requests, custom ids line-0.. ."""
    return request_lines(
        "/v1/chat/completions",
        [
            {
                "model": model,
                "messages": [{"role": "user", "content": f"Count to {i}."}],
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            for i in range(count)
        ],
    )


def request_lines(url: str, bodies: list[dict[str, Any]]) -> bytes:
    """A JSONL batch input of one request to `url` a body, custom ids line-0.. ."""
    lines = [
        {"custom_id": f"line-{i}", "method": "POST", "url": url, "body": body}
        for i, body in enumerate(bodies)
    ]
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


async def submit(
    client: openai.AsyncOpenAI,
    content: bytes,
    metadata: dict[str, str] | None = None,
    endpoint: Endpoint = "/v1/chat/completions",
) -> Any:
    """Upload `content` as a batch file and create a batch of it on `endpoint`."""
    uploaded = await client.files.create(file=("requests.jsonl", content), purpose="batch")
    return await client.batches.create(
        input_file_id=uploaded.id,
        endpoint=endpoint,
        completion_window="24h",
        metadata=metadata,
    )


async def until(client: openai.AsyncOpenAI, batch_id: str, *statuses: str) -> Any:
    """The batch once its status is one of `statuses` (two minutes at most)."""
    found: dict[str, Any] = {}

    async def reached() -> bool:
        found["batch"] = await client.batches.retrieve(batch_id)
        return found["batch"].status in statuses

    await eventually(reached, timeout_s=120)
    return found["batch"]


async def records(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    """The lines of an output or error file (none when the batch has no such file)."""
    if file_id is None:
        return []
    content = await client.files.content(file_id)
    return [json.loads(line) for line in content.text.splitlines()]
