"""Batch input files and submissions through the openai SDK, for the batch tests."""

from __future__ import annotations

import json
from typing import Any

import openai


def chat_lines(model: str, count: int, max_tokens: int = 4) -> bytes:
    """A JSONL batch input of `count` greedy chat requests, custom ids line-0.. ."""
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": f"Count to {i}."}],
                "max_tokens": max_tokens,
                "temperature": 0,
            },
        }
        for i in range(count)
    ]
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


async def submit(
    client: openai.AsyncOpenAI, content: bytes, metadata: dict[str, str] | None = None
) -> Any:
    """Upload `content` as a batch file and create a chat completions batch of it."""
    uploaded = await client.files.create(file=("requests.jsonl", content), purpose="batch")
    return await client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata=metadata,
    )
