"""The OpenAI response shapes of chat and text completions, choices and logprobs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from backend import TokenLogprobs
from gateway.openapi.shapes import ToolCall

TokenText = Callable[[int], str]


@dataclass(frozen=True)
class Format:
    """How one OpenAI endpoint writes its choices: whole (`choice`) or streamed (`delta`).
    The two differ only in where the text goes and how logprobs are shown."""

    object: str
    chunk_object: str
    id_prefix: str
    whole: Callable[[str], dict[str, Any]]  # a whole choice's text
    part: Callable[[str, bool], dict[str, Any]]  # a streamed chunk's text; True: the first
    logprobs: Callable[[Sequence[TokenLogprobs] | None, TokenText], dict[str, Any] | None]
    joined: Callable[[list[dict[str, Any]]], dict[str, Any]]  # an upstream's, put together

    def choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: Sequence[TokenLogprobs] | None,
        token_text: TokenText,
    ) -> dict[str, Any]:
        return self._choice(index, self.whole(text), finish_reason, logprobs, token_text)

    def delta(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        first: bool,
        logprobs: Sequence[TokenLogprobs] | None,
        token_text: TokenText,
    ) -> dict[str, Any]:
        return self._choice(index, self.part(text, first), finish_reason, logprobs, token_text)

    def _choice(
        self,
        index: int,
        content: dict[str, Any],
        finish_reason: str | None,
        logprobs: Sequence[TokenLogprobs] | None,
        token_text: TokenText,
    ) -> dict[str, Any]:
        return {
            "index": index,
            **content,
            "finish_reason": finish_reason,
            "logprobs": self.logprobs(logprobs, token_text),
        }


def _chat_message(text: str) -> dict[str, Any]:
    return {"message": {"role": "assistant", "content": text}}


def _chat_delta(text: str, first: bool) -> dict[str, Any]:
    delta: dict[str, str] = {"role": "assistant", "content": text} if first else {}
    if text and not first:
        delta["content"] = text
    return {"delta": delta}


def _text(text: str) -> dict[str, Any]:
    return {"text": text}


def with_tool_calls(
    choice: dict[str, Any], content: str | None, calls: Sequence[ToolCall], legacy: bool = False
) -> dict[str, Any]:
    """A whole chat choice whose output held tool calls: they replace it in the message.
    `legacy` (the request used `functions`): the first call as `function_call`."""
    if not calls:
        return choice
    choice["message"]["content"] = content
    if legacy:
        choice["message"]["function_call"] = msgspec.to_builtins(calls[0].function)
        choice["finish_reason"] = "function_call"
    else:
        choice["message"]["tool_calls"] = msgspec.to_builtins(list(calls))
        choice["finish_reason"] = "tool_calls"
    return choice


def function_call_deltas(call: ToolCall) -> list[dict[str, Any]]:
    """The legacy `functions` API's streamed call: `delta.function_call` with the name and
    empty arguments, then with the arguments."""
    named = {"name": call.function.name, "arguments": ""}
    return [{"function_call": named}, {"function_call": {"arguments": call.function.arguments}}]


def tool_calls_delta(index: int, deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed chat choice that carries tool-call deltas (the gateway's, or an
    upstream's own)."""
    return choice_delta(index, {"tool_calls": deltas})


def choice_delta(index: int, delta: dict[str, Any]) -> dict[str, Any]:
    """A streamed chat choice carrying `delta` and no finish."""
    return {"index": index, "delta": delta, "finish_reason": None, "logprobs": None}


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


def _joined_chat(parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {"content": [entry for part in parts for entry in part.get("content") or []]}


def _joined_text(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The streamed parts' lists end to end; offsets counted again from the start."""
    joined: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    for part in parts:
        for key, values in joined.items():
            values.extend(part.get(key) or [])
    offsets, position = [], 0
    for text in joined["tokens"]:
        offsets.append(position)
        position += len(text)
    return {**joined, "text_offset": offsets}


CHAT_FORMAT = Format(
    object="chat.completion",
    chunk_object="chat.completion.chunk",
    id_prefix="chatcmpl-",
    whole=_chat_message,
    part=_chat_delta,
    logprobs=_chat_logprobs,
    joined=_joined_chat,
)
TEXT_FORMAT = Format(
    object="text_completion",
    chunk_object="text_completion",
    id_prefix="cmpl-",
    whole=_text,
    part=lambda text, _first: _text(text),  # a text chunk is a choice like a whole one
    logprobs=_text_logprobs,
    joined=_joined_text,
)
