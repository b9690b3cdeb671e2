"""OpenAI's Responses API (POST /v1/responses), stateless: a chat completion underneath.

The request becomes a chat request, which runs through the chat handler (admission,
idempotency, billing, cancellation, structured outputs); its answer is reshaped into a
`response` object, or its stream into the Responses API's typed events. Nothing is
stored, so `store: true` and `previous_response_id` are refused.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from litestar import Controller, Request, Response, post
from litestar.di import NamedDependency, Provide
from msgspec import Meta, Struct

from gateway.api.generation import DONE
from gateway.api.openai import chat
from gateway.api.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    JsonObjectResponse,
    JsonSchemaResponse,
    JsonSchemaSpec,
    PositiveInt,
    ResponseFormat,
    StreamOptions,
    Temperature,
    TextResponse,
    TopP,
    decode,
    encode,
)
from gateway.api.services import GenerationServices
from gateway.core.errors import InvalidRequest
from gateway.http.auth import authenticate
from gateway.openapi import GENERATION, route
from gateway.openapi.shapes import ResponseEvent, ResponseObject
from tenants.limits import LOWEST_PRIORITY
from tenants.services import Principal


class InputText(Struct, tag_field="type", tag="input_text"):
    text: str


class OutputText(Struct, tag_field="type", tag="output_text"):
    """An earlier response's text, sent back as an assistant turn."""

    text: str


class InputMessage(Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText | OutputText]
    type: Literal["message"] = "message"

    def chat(self) -> ChatMessage:
        if isinstance(self.content, str):
            return ChatMessage(role=self.role, content=self.content)
        return ChatMessage(role=self.role, content="".join(part.text for part in self.content))


class TextFormat(Struct, tag_field="type", tag="text", frozen=True):
    pass


class JsonObjectFormat(Struct, tag_field="type", tag="json_object"):
    pass


class JsonSchemaFormat(Struct, tag_field="type", tag="json_schema", kw_only=True):
    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextOptions(Struct):
    format: TextFormat | JsonObjectFormat | JsonSchemaFormat = TextFormat()

    def response_format(self) -> ResponseFormat:
        """The same request in chat's terms."""
        f = self.format
        if isinstance(f, JsonSchemaFormat):
            spec = JsonSchemaSpec(
                name=f.name, schema=f.schema, strict=f.strict, description=f.description
            )
            return JsonSchemaResponse(spec)
        return JsonObjectResponse() if isinstance(f, JsonObjectFormat) else TextResponse()


class ResponsesRequest(Struct, kw_only=True):
    model: str
    input: str | Annotated[list[InputMessage], Meta(min_length=1)]
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool = False
    text: TextOptions | None = None
    store: bool | None = None  # OpenAI's default is true: absent means "not asked for"
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    priority: Annotated[int, Meta(ge=0, le=LOWEST_PRIORITY)] | None = None
    user: str | None = None

    def refuse_what_needs_state(self) -> None:
        if self.store:
            raise InvalidRequest(
                "stored responses are not supported: send store: false, or leave it out",
                param="store",
            )
        if self.previous_response_id is not None:
            raise InvalidRequest(
                "stored responses are not supported, so none can be continued: send the "
                "conversation so far in input",
                param="previous_response_id",
            )
        if self.tools:
            raise InvalidRequest(
                "tools are not supported on /v1/responses; use /v1/chat/completions",
                param="tools",
            )

    def as_chat(self) -> ChatCompletionRequest:
        messages = (
            [ChatMessage(role="user", content=self.input)]
            if isinstance(self.input, str)
            else [item.chat() for item in self.input]
        )
        if self.instructions is not None:
            messages.insert(0, ChatMessage(role="system", content=self.instructions))
        return ChatCompletionRequest(
            model=self.model,
            messages=messages,
            max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stream=self.stream,
            stream_options=StreamOptions(include_usage=True) if self.stream else None,
            response_format=None if self.text is None else self.text.response_format(),
            priority=self.priority,
            user=self.user,
        )


class ResponsesController(Controller):
    path = "/v1"
    dependencies = {"principal": Provide(authenticate)}

    @route(
        post,
        "/responses",
        ResponseObject,
        body=ResponsesRequest,
        errors=GENERATION,
        stream=ResponseEvent,
        idempotent=True,
    )
    async def create_response(
        self,
        request: Request[Any, Any, Any],
        principal: NamedDependency[Principal],
        services: NamedDependency[GenerationServices],
    ) -> Response[Any]:
        body = decode(await request.body(), ResponsesRequest)
        body.refuse_what_needs_state()
        shape = ResponseShape(body)
        return await chat(request, services, principal, body.as_chat(), "responses", shape, "input")


COMPLETED, INCOMPLETE = b"event: response.completed\n", b"event: response.incomplete\n"


@dataclass
class ResponseShape:
    """A chat completion (whole, or its chunks) as a Responses API answer."""

    request: ResponsesRequest

    def whole(self, chat: dict[str, Any]) -> dict[str, Any]:
        choice = chat["choices"][0]
        text = choice["message"]["content"] or ""
        return self._response(chat, _status(choice["finish_reason"]), text, chat["usage"])

    def is_last(self, event: bytes) -> bool:
        return event.startswith((COMPLETED, INCOMPLETE))

    async def events(self, chat: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The typed events, each numbered; chat's error event becomes an `error` one."""
        numbers = itertools.count()

        def event(kind: str, **fields: Any) -> bytes:
            payload = {"type": kind, "sequence_number": next(numbers), **fields}
            return b"event: " + kind.encode() + b"\ndata: " + encode(payload) + b"\n\n"

        first: dict[str, Any] | None = None
        texts: list[str] = []
        finish_reason: str | None = None
        usage: dict[str, Any] = {}
        async for line in chat:
            if line == DONE:
                continue  # the chat stream ends with it, settled: its end comes next
            chunk = msgspec.json.decode(line.removeprefix(b"data: "))
            if "error" in chunk:
                error = chunk["error"]
                yield event("error", code=error["code"], message=error["message"], param=None)
                return
            if first is None:
                first = chunk
                for kind, fields in self._opening(chunk):
                    yield event(kind, **fields)
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                if delta := choice["delta"].get("content"):
                    texts.append(delta)
                    yield event("response.output_text.delta", **_at(chunk), delta=delta)
                finish_reason = choice["finish_reason"] or finish_reason
        if first is None:  # the chat stream always opens with a chunk
            return
        status, text = _status(finish_reason), "".join(texts)
        for kind, fields in self._closing(first, status, text, usage):
            yield event(kind, **fields)

    def _opening(self, chat: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        response = self._response(chat, "in_progress", None, None)
        item = _message(chat, "in_progress", None)
        return [
            ("response.created", {"response": response}),
            ("response.in_progress", {"response": response}),
            ("response.output_item.added", {"output_index": 0, "item": item}),
            ("response.content_part.added", {**_at(chat), "part": _text_part("")}),
        ]

    def _closing(
        self, chat: dict[str, Any], status: str, text: str, usage: dict[str, Any]
    ) -> list[tuple[str, dict[str, Any]]]:
        response = self._response(chat, status, text, usage)
        return [
            ("response.output_text.done", {**_at(chat), "text": text, "logprobs": []}),
            ("response.content_part.done", {**_at(chat), "part": _text_part(text)}),
            ("response.output_item.done", {"output_index": 0, "item": response["output"][0]}),
            (f"response.{status}", {"response": response}),
        ]

    def _response(
        self, chat: dict[str, Any], status: str, text: str | None, usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        """The `response` object; `text` None: no output yet, `usage` None: not known yet."""
        r = self.request
        return {
            "id": "resp_" + _suffix(chat),
            "object": "response",
            "created_at": chat["created"],
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "model": chat["model"],
            "output": [] if text is None else [_message(chat, status, text)],
            "parallel_tool_calls": False,
            "temperature": r.temperature,
            "top_p": r.top_p,
            "tool_choice": "none",
            "tools": [],
            "store": False,
            "text": {"format": msgspec.to_builtins((r.text or TextOptions()).format)},
            "truncation": "disabled",
            "usage": None if usage is None else _usage(usage),
            "metadata": {},
        }


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _suffix(chat: dict[str, Any]) -> str:
    return str(chat["id"]).removeprefix("chatcmpl-")


def _at(chat: dict[str, Any]) -> dict[str, Any]:
    """Where the one text part of the one message is."""
    return {"item_id": "msg_" + _suffix(chat), "output_index": 0, "content_index": 0}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(chat: dict[str, Any], status: str, text: str | None) -> dict[str, Any]:
    return {
        "type": "message",
        "id": "msg_" + _suffix(chat),
        "status": status,
        "role": "assistant",
        "content": [] if text is None else [_text_part(text)],
    }


def _usage(chat: dict[str, Any]) -> dict[str, Any]:
    cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat["total_tokens"],
    }
