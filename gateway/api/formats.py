"""The OpenAI response shapes of chat and text completions, choices and logprobs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from backend import TokenLogprobs
from gateway.api.tools import ToolCall

TokenText = Callable[[int], str]


class ChatFormat:
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    @staticmethod
    def choice(
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: Sequence[TokenLogprobs] | None,
        token_text: TokenText,
    ) -> dict[str, Any]:
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish_reason,
            "logprobs": _chat_logprobs(logprobs, token_text),
        }

    @staticmethod
    def delta(
        index: int,
        text: str,
        finish_reason: str | None,
        first: bool,
        logprobs: Sequence[TokenLogprobs] | None,
        token_text: TokenText,
    ) -> dict[str, Any]:
        delta: dict[str, str] = {"role": "assistant", "content": text} if first else {}
        if text and not first:
            delta["content"] = text
        return {
            "index": index,
            "delta": delta,
            "finish_reason": finish_reason,
            "logprobs": _chat_logprobs(logprobs, token_text),
        }


def with_tool_calls(
    choice: dict[str, Any], content: str | None, calls: Sequence[ToolCall]
) -> dict[str, Any]:
    """A whole chat choice whose output held tool calls: they replace it in the message."""
    if calls:
        choice["message"]["content"] = content
        choice["message"]["tool_calls"] = msgspec.to_builtins(list(calls))
        choice["finish_reason"] = "tool_calls"
    return choice


def tool_calls_delta(index: int, calls: Sequence[ToolCall]) -> dict[str, Any]:
    """A streamed chat choice that carries the output's tool calls, each whole."""
    deltas = [{"index": i, **msgspec.to_builtins(call)} for i, call in enumerate(calls)]
    return {
        "index": index,
        "delta": {"tool_calls": deltas},
        "finish_reason": None,
        "logprobs": None,
    }


class TextFormat:
    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    @staticmethod
    def choice(
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: Sequence[TokenLogprobs] | None,
        token_text: TokenText,
    ) -> dict[str, Any]:
        return {
            "index": index,
            "text": text,
            "finish_reason": finish_reason,
            "logprobs": _text_logprobs(logprobs, token_text),
        }

    @staticmethod
    def delta(
        index: int,
        text: str,
        finish_reason: str | None,
        first: bool,
        logprobs: Sequence[TokenLogprobs] | None,
        token_text: TokenText,
    ) -> dict[str, Any]:
        return TextFormat.choice(index, text, finish_reason, logprobs, token_text)


Format = type[ChatFormat] | type[TextFormat]


def _entry(token_id: int, logprob: float, token_text: TokenText) -> dict[str, Any]:
    text = token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def _chat_logprobs(
    logprobs: Sequence[TokenLogprobs] | None, token_text: TokenText
) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    content = [
        {
            **_entry(lp.token_id, lp.logprob, token_text),
            "top_logprobs": [_entry(i, value, token_text) for i, value in lp.top],
        }
        for lp in logprobs
    ]
    return {"content": content}


def _text_logprobs(
    logprobs: Sequence[TokenLogprobs] | None, token_text: TokenText
) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    tokens = [token_text(lp.token_id) for lp in logprobs]
    offsets, position = [], 0
    for text in tokens:
        offsets.append(position)
        position += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{token_text(i): value for i, value in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }
