"""A small OpenAI-compatible server that behaves as vLLM does for a gateway in front of it.

Not a mock object: a real HTTP server (Litestar on uvicorn) that tests start on loopback.
Its "model" is deterministic: one token per character (the token id is the code point),
and the output is a fixed text, `--tokens` characters long unless `max_tokens` is smaller,
with `--delay-ms` before each token so a test can disconnect mid-stream (or, with `burst`,
a whole stream in one write: tokens that were ready together, as vLLM's
`--stream-interval` sends them, or a backlog a slow reader finds). Asked for JSON
(`response_format` json_object or json_schema) it answers JSON_OUTPUT; given `tools`
(and a `tool_choice` other than "none") it calls the first tool, or the named one, with
CALL_ARGUMENTS, streamed as vLLM's tool parsers stream: a `delta.tool_calls` entry with
the call's id, type and name, then one with each token of its arguments, and
finish_reason "tool_calls" (whole: `message.tool_calls`, content null). Asked for
`logprobs`, each token's is `logprob_of` its position, in vLLM's shape for the endpoint.

What it copies from vLLM (the parts a gateway depends on):
- `/v1/chat/completions` and `/v1/completions`, streaming (SSE, `data: [DONE]`) or not;
  with `stream_options.include_usage` a last chunk with `choices: []` and the usage, and
  no `usage` key on the others; token-id prompts (`"prompt": [1, 2, 3]`) on completions.
- `POST /tokenize` (`{"model", "prompt"}` or `{"model", "messages", "tools"}` → `count`,
  `max_model_len`, `tokens`), `GET /v1/models`, `GET /health`, and `GET /metrics` with
  `vllm:num_requests_running`, `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`
  (labels `engine`, `model_name`), read from the real current load: at most
  `--max-num-seqs` requests run, the rest wait, most urgent (lowest `priority`) first.
- `priority` (lower runs first; refused unless `--scheduling-policy priority`, vLLM's
  rule), `cache_salt` (accepted and recorded), errors as `{"error": {message, type,
  param, code}}`, and abort on disconnect: the request stops producing tokens.

For tests: `GET /_test/requests?last=N` lists what it received (body, tokens sent,
whether it finished or was aborted), `DELETE /_test/requests` forgets them, and an
upstream error (429/503 with `Retry-After`) comes from the `x-test-fail: 429` header,
`POST /_test/fail {"status": 503, "count": 2, "retry_after": 3}` or `--fail-status`.

    python -m tests.support.vllm_like --port 8100 [--delay-ms 5] [--tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import itertools
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import msgspec
import uvicorn
from litestar import Litestar, MediaType, Request, Response, delete, get, post
from litestar.response import Stream

T = TypeVar("T")

OUTPUT_TEXT = "The quick brown fox jumps over the lazy dog. "
JSON_OUTPUT = '{"animal": "fox", "quick": true}'
CALL_ARGUMENTS = '{"city": "Paris"}'
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
PRIORITY_POLICY = "priority"


@dataclass(frozen=True)
class Config:
    model: str = "vllm-like"
    tokens: int = 16  # output length when max_tokens is absent or larger
    delay_ms: float = 0.0  # before each output token
    burst: bool = False  # a stream's events in one write, not one write each
    max_num_seqs: int = 8  # running at once; the rest wait
    max_model_len: int = 2048
    kv_capacity_tokens: int = 16384  # what kv_cache_usage_perc is a share of
    scheduling_policy: str = PRIORITY_POLICY  # or "fcfs": a non-zero priority is refused
    api_key: str | None = None  # as vLLM's --api-key: required on /v1 routes
    fail_status: int | None = None  # answer every generation request with this
    retry_after_s: int = 1
    history: int = 256  # request records kept for /_test/requests
    # A faulty or lying upstream: the usage it reports, whatever it sent.
    claimed_prompt_tokens: int | None = None
    claimed_completion_tokens: int | None = None


@dataclass
class Record:
    """What one generation request sent, and what became of it."""

    path: str
    body: dict[str, Any]
    status: int = 200
    tokens_sent: int = 0
    finished: bool = False
    aborted: bool = False  # the client left before the last token


class UpstreamError(Exception):
    """An error answer in vLLM's shape."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}

    def response(self) -> Response[dict[str, Any]]:
        kind = {400: "BadRequestError", 401: "Unauthorized", 404: "NotFoundError"}
        error = {
            "message": str(self),
            "type": kind.get(self.status, "ServiceUnavailableError"),
            "param": None,
            "code": self.status,
        }
        return Response({"error": error}, status_code=self.status, headers=self.headers)


class Slots:
    """`size` requests run at once; the others wait, lowest priority value first."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.running = 0
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrival = itertools.count()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def acquire(self, priority: int) -> None:
        if self.running < self.size and not self._waiting:
            self.running += 1
            return
        entry = (priority, next(self._arrival), asyncio.get_running_loop().create_future())
        heapq.heappush(self._waiting, entry)
        try:
            await entry[2]
        except asyncio.CancelledError:
            if entry[2].done() and not entry[2].cancelled():
                self.release()  # the slot was handed over just as the client left
            else:
                self._waiting.remove(entry)
                heapq.heapify(self._waiting)
            raise

    def release(self) -> None:
        """Hand the slot to the most urgent waiting request, or free it."""
        while self._waiting:
            _, _, handed = heapq.heappop(self._waiting)
            if not handed.done():
                handed.set_result(None)
                return
        self.running -= 1


@dataclass
class State:
    config: Config
    slots: Slots
    records: deque[Record]
    kv_tokens: int = 0  # prompt + output tokens of the running requests
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    planned_failures: list[tuple[int, int]] = field(default_factory=list)  # (status, retry)


def tokenize(text: str) -> list[int]:
    return [ord(char) for char in text]


def render_chat(messages: Any, tools: Any = None) -> str:
    """The fake's chat template: a `<|tools|>` line with the tools' JSON (when given),
    `<|role|>content` lines, then the assistant's turn. As vLLM's request validation, a
    tool call's arguments must be JSON text."""
    if not isinstance(messages, list) or not messages:
        raise UpstreamError(400, "messages must be a non-empty list")
    lines = [f"<|tools|>{msgspec.json.encode(_tools(tools)).decode()}\n"] if tools else []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise UpstreamError(400, "each message needs a role")
        content = message.get("content") or ""
        if isinstance(content, list):  # content parts: the text ones count
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise UpstreamError(400, "message content must be a string or a list of parts")
        for call in message.get("tool_calls") or []:
            if not isinstance(call.get("function", {}).get("arguments"), str):
                raise UpstreamError(400, "a tool call's function.arguments must be a string")
            content += msgspec.json.encode(call["function"]).decode()
        lines.append(f"<|{message['role']}|>{content}\n")
    return "".join(lines) + "<|assistant|>"


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list) or not all(
        isinstance(t, dict) and t.get("type") == "function" and "name" in t.get("function", {})
        for t in tools
    ):
        raise UpstreamError(400, "tools must be a list of {type: function, function: {name}}")
    return tools


def _called(body: dict[str, Any]) -> str | None:
    """The name of the tool this request calls, if it calls one."""
    tools, choice = body.get("tools"), body.get("tool_choice", "auto")
    if not tools or choice == "none":
        return None
    if isinstance(choice, dict):
        name = choice.get("function", {}).get("name")
        if name not in [t["function"]["name"] for t in _tools(tools)]:
            raise UpstreamError(400, f"tool_choice names {name!r}, which is not among the tools")
        return str(name)
    return str(_tools(tools)[0]["function"]["name"])


def _top_logprobs(body: dict[str, Any]) -> int | None:
    """Chat's `logprobs: true` with `top_logprobs`, or completions' `logprobs: N`."""
    asked = body.get("logprobs")
    if asked is None or asked is False:
        return None
    top = body.get("top_logprobs") or 0 if asked is True else asked
    if type(top) is not int or not 0 <= top <= 20:
        raise UpstreamError(400, "top_logprobs must be an integer from 0 to 20")
    return top


def logprob_of(position: int) -> float:
    """The fake's log-probability of its output token at `position` (from 0)."""
    return -0.01 * (position + 1)


def _logprobs(generation: Generation, chat: bool, start: int, tokens: list[str]) -> Any:
    """vLLM's logprobs of `tokens`, the output's from `start`: each token's, and its
    alternatives (the token itself, then "~" one nat less likely), `top` of them."""
    top = generation.top
    if top is None:
        return None
    values = [logprob_of(start + i) for i in range(len(tokens))]
    if chat:

        def entry(token: str, value: float) -> dict[str, Any]:
            return {"token": token, "logprob": value, "bytes": list(token.encode())}

        content = [
            {**entry(t, v), "top_logprobs": [entry(t, v), entry("~", v - 1)][:top]}
            for t, v in zip(tokens, values, strict=True)
        ]
        return {"content": content}
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": [
            dict([(t, v), ("~", v - 1)][:top]) for t, v in zip(tokens, values, strict=True)
        ],
        "text_offset": [start + i for i in range(len(tokens))],
    }


def _json_wanted(body: dict[str, Any]) -> bool:
    response_format = body.get("response_format")
    if response_format is None:
        return False
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind not in RESPONSE_FORMATS:
        raise UpstreamError(400, f"response_format.type must be one of {RESPONSE_FORMATS}")
    if kind == "json_schema" and "name" not in (response_format.get("json_schema") or {}):
        raise UpstreamError(400, "response_format.json_schema needs a name")
    return bool(kind != "text")


def prompt_ids(prompt: Any) -> list[int]:
    """A completion prompt: a string or token ids (one prompt; vLLM also takes batches)."""
    if isinstance(prompt, str):
        return tokenize(prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
        return list(prompt)
    raise UpstreamError(400, "prompt must be a string or a non-empty list of token ids")


class Generation:
    """One request's run: waits for a slot, then yields its output characters."""

    def __init__(self, state: State, record: Record, body: dict[str, Any], prompt: list[int]):
        config = state.config
        if len(prompt) >= config.max_model_len:
            raise UpstreamError(
                400,
                f"This model's maximum context length is {config.max_model_len} tokens. "
                f"However, your request has {len(prompt)} input tokens.",
            )
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
            raise UpstreamError(400, "max_tokens must be a positive integer")
        priority = body.get("priority", 0)
        if type(priority) is not int:
            raise UpstreamError(400, "priority must be an integer")
        if priority != 0 and config.scheduling_policy != PRIORITY_POLICY:
            raise UpstreamError(400, "priority is only supported with the priority policy")
        if not isinstance(body.get("cache_salt", ""), str):
            raise UpstreamError(400, "cache_salt must be a string")
        self.state, self.record, self.priority = state, record, priority
        self.prompt_tokens = len(prompt)
        self.call = _called(body)  # the tool it calls: its first token is the name
        self.top = _top_logprobs(body)  # alternatives per token; None: no logprobs
        self.call_id = f"chatcmpl-tool-{uuid.uuid4().hex}"
        if self.call is not None:
            pieces = [self.call, *CALL_ARGUMENTS]
        elif _json_wanted(body):
            pieces = list(JSON_OUTPUT)
        else:
            pieces = [OUTPUT_TEXT[i % len(OUTPUT_TEXT)] for i in range(config.tokens)]
        self.pieces = pieces[: max_tokens or len(pieces)]
        self.length = len(self.pieces)
        finished = "stop" if self.call is None else "tool_calls"
        self.finish_reason = "length" if self.length == max_tokens else finished

    async def tokens(self) -> AsyncGenerator[str, None]:
        state, record = self.state, self.record
        try:
            await state.slots.acquire(self.priority)
        except asyncio.CancelledError:
            record.aborted = True  # the client left while it waited
            raise
        reserved = self.prompt_tokens
        state.kv_tokens += reserved
        state.prompt_tokens_total += self.prompt_tokens
        try:
            for i in range(self.length):
                if state.config.delay_ms:
                    await asyncio.sleep(state.config.delay_ms / 1000)
                state.kv_tokens += 1
                reserved += 1
                state.generation_tokens_total += 1
                record.tokens_sent += 1
                yield self.pieces[i]
            record.finished = True
        finally:
            record.aborted = not record.finished
            state.kv_tokens -= reserved
            state.slots.release()

    def usage(self) -> dict[str, Any]:
        config = self.state.config
        completion = self.record.tokens_sent
        if config.claimed_completion_tokens is not None:
            completion = config.claimed_completion_tokens
        prompt = self.prompt_tokens
        if config.claimed_prompt_tokens is not None:
            prompt = config.claimed_prompt_tokens
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None,
        }


def _state(request: Request[Any, Any, Any]) -> State:
    state: State = request.app.state.fake
    return state


async def _admit(request: Request[Any, Any, Any]) -> tuple[State, Record, dict[str, Any]]:
    """Authenticate, parse, record, and apply any failure the test asked for."""
    state = _state(request)
    _check_key(state.config, request)
    try:
        body = msgspec.json.decode(await request.body())
    except msgspec.DecodeError as exc:
        raise UpstreamError(400, f"invalid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise UpstreamError(400, "the body must be a JSON object")
    record = Record(request.url.path, body)
    state.records.append(record)
    failure = _failure(state, request.headers.get("x-test-fail"))
    if failure is not None:
        record.status = failure[0]
        retry = {"Retry-After": str(failure[1])}
        if failure[0] == 429:  # as OpenAI's: the limit that refused
            retry |= {
                "x-ratelimit-limit-requests": "60",
                "x-ratelimit-remaining-requests": "0",
                "x-ratelimit-reset-requests": f"{failure[1]}s",
            }
        raise UpstreamError(failure[0], "the server is overloaded (test failure)", retry)
    if body.get("model") not in (None, state.config.model):
        raise UpstreamError(404, f"The model `{body.get('model')}` does not exist.")
    return state, record, body


def _check_key(config: Config, request: Request[Any, Any, Any]) -> None:
    if config.api_key is not None and (
        request.headers.get("authorization") != f"Bearer {config.api_key}"
    ):
        raise UpstreamError(401, "Unauthorized")


def _failure(state: State, header: str | None) -> tuple[int, int] | None:
    if header:
        return int(header), state.config.retry_after_s
    if state.planned_failures:
        return state.planned_failures.pop(0)
    if state.config.fail_status is not None:
        return state.config.fail_status, state.config.retry_after_s
    return None


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


async def _generate(request: Request[Any, Any, Any], chat: bool) -> Response[Any]:
    try:
        state, record, body = await _admit(request)
        if chat:
            prompt = tokenize(render_chat(body.get("messages"), body.get("tools")))
        else:
            prompt = prompt_ids(body.get("prompt"))
        generation = Generation(state, record, body, prompt)
    except UpstreamError as exc:
        return exc.response()
    head = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": state.config.model,
    }
    if body.get("stream"):
        options = body.get("stream_options") or {}
        usage = isinstance(options, dict) and bool(options.get("include_usage"))
        events = _stream_events(generation, head, chat, usage)
        if state.config.burst:
            events = _at_once(events)
        return Stream(events, media_type="text/event-stream")
    text = await _unless_disconnected(request, _collect(generation))
    if text is None:
        return Response(b"", status_code=499)  # nobody is there to read it
    return Response(_whole(generation, head, chat, text), media_type=MediaType.JSON)


async def _collect(generation: Generation) -> str:
    return "".join([token async for token in generation.tokens()])


async def _stream_events(
    generation: Generation, head: dict[str, Any], chat: bool, usage: bool
) -> AsyncIterator[bytes]:
    """vLLM's chunks: for chat a first one with the role, then one per token, the last
    carrying finish_reason, then (include_usage) the usage with no choices, then DONE."""
    if chat:
        first = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        yield _sse({**head, "choices": [first]})
    sent = 0
    async with contextlib.aclosing(generation.tokens()) as tokens:  # ends it on disconnect
        async for token in tokens:
            sent += 1
            yield _sse({**head, "choices": [_delta(generation, chat, token, sent)]})
    if usage:
        yield _sse({**head, "choices": [], "usage": generation.usage()})
    yield b"data: [DONE]\n\n"


async def _at_once(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield b"".join([event async for event in events])


def _delta(generation: Generation, chat: bool, token: str, sent: int) -> dict[str, Any]:
    reason = generation.finish_reason if sent == generation.length else None
    if chat and generation.call is not None:
        call: dict[str, Any] = {"index": 0, "function": {"arguments": token}}
        if sent == 1:  # the name, with the call's id
            call = {"index": 0, "id": generation.call_id, "type": "function"}
            call["function"] = {"name": token}
        delta = {"tool_calls": [call]}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
    logprobs = _logprobs(generation, chat, sent - 1, [token])
    if chat:
        content = {"content": token}
        return {"index": 0, "delta": content, "logprobs": logprobs, "finish_reason": reason}
    return {
        "index": 0,
        "text": token,
        "logprobs": logprobs,
        "finish_reason": reason,
        "stop_reason": None,
    }


def _whole(generation: Generation, head: dict[str, Any], chat: bool, text: str) -> bytes:
    reason = generation.finish_reason
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": text, "tool_calls": []}
        if generation.call is not None:
            function = {"name": generation.call, "arguments": text[len(generation.call) :]}
            call = {"id": generation.call_id, "type": "function", "function": function}
            message |= {"content": None, "tool_calls": [call]}
        choice = {
            "index": 0,
            "message": message,
            "logprobs": None if generation.call else _logprobs(generation, chat, 0, list(text)),
            "finish_reason": reason,
            "stop_reason": None,
        }
        kind = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": _logprobs(generation, chat, 0, list(text)),
            "finish_reason": reason,
            "stop_reason": None,
            "prompt_logprobs": None,
        }
        kind = "text_completion"
    whole = {**head, "object": kind, "choices": [choice], "usage": generation.usage()}
    return msgspec.json.encode(whole)


async def _unless_disconnected(request: Request[Any, Any, Any], work: Awaitable[T]) -> T | None:
    """Run `work` unless the client leaves first (vLLM aborts non-streaming requests too)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


async def _disconnect(request: Request[Any, Any, Any]) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request[Any, Any, Any]) -> Response[Any]:
    return await _generate(request, chat=True)


@post("/v1/completions", status_code=200)
async def completions(request: Request[Any, Any, Any]) -> Response[Any]:
    return await _generate(request, chat=False)


@post("/tokenize", status_code=200)
async def tokenize_route(request: Request[Any, Any, Any]) -> Response[Any]:
    state = _state(request)
    try:
        body = msgspec.json.decode(await request.body())
        if not isinstance(body, dict):
            raise UpstreamError(400, "the body must be a JSON object")
        if "messages" in body:
            ids = tokenize(render_chat(body["messages"], body.get("tools")))
        else:
            ids = prompt_ids(body.get("prompt"))
    except UpstreamError as exc:
        return exc.response()
    except msgspec.DecodeError as exc:
        return UpstreamError(400, f"invalid JSON: {exc}").response()
    reply = {
        "count": len(ids),
        "max_model_len": state.config.max_model_len,
        "tokens": ids,
        "token_strs": None,
    }
    return Response(reply)


@get("/v1/models")
async def models(request: Request[Any, Any, Any]) -> Response[Any]:
    config = _state(request).config
    try:
        _check_key(config, request)
    except UpstreamError as exc:
        return exc.response()
    card = {
        "id": config.model,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "vllm",
        "root": config.model,
        "parent": None,
        "max_model_len": config.max_model_len,
    }
    return Response({"object": "list", "data": [card]})


@get("/metrics", media_type="text/plain; version=0.0.4")
async def metrics(request: Request[Any, Any, Any]) -> str:
    state = _state(request)
    labels = f'{{engine="0",model_name="{state.config.model}"}}'
    kv = state.kv_tokens / state.config.kv_capacity_tokens
    rows = [
        (
            "num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            state.slots.running,
        ),
        (
            "num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
            state.slots.waiting,
        ),
        ("kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", kv),
        (
            "prompt_tokens_total",
            "counter",
            "Number of prefill tokens processed.",
            state.prompt_tokens_total,
        ),
        (
            "generation_tokens_total",
            "counter",
            "Number of generation tokens processed.",
            state.generation_tokens_total,
        ),
    ]
    lines = []
    for name, kind, help_text, value in rows:
        lines += [f"# HELP vllm:{name} {help_text}", f"# TYPE vllm:{name} {kind}"]
        lines.append(f"vllm:{name}{labels} {float(value)}")
    return "\n".join(lines) + "\n"


@get("/health")
async def health() -> Response[bytes]:
    return Response(b"", status_code=200)


@get("/_test/requests")
async def recorded(request: Request[Any, Any, Any]) -> dict[str, Any]:
    last = int(request.query_params.get("last", 50))
    records = list(_state(request).records)[-last:] if last > 0 else []
    return {"requests": [asdict(record) for record in records]}


@delete("/_test/requests", status_code=204)
async def forget(request: Request[Any, Any, Any]) -> None:
    _state(request).records.clear()


@post("/_test/fail", status_code=200)
async def plan_failures(request: Request[Any, Any, Any]) -> dict[str, int]:
    """The next `count` generation requests answer `status` with `Retry-After`."""
    body = msgspec.json.decode(await request.body())
    state = _state(request)
    retry = int(body.get("retry_after", state.config.retry_after_s))
    state.planned_failures += [(int(body["status"]), retry)] * int(body.get("count", 1))
    return {"planned": len(state.planned_failures)}


def create_app(config: Config | None = None) -> Litestar:
    config = config or Config()
    app = Litestar(
        route_handlers=[
            chat_completions,
            completions,
            tokenize_route,
            models,
            metrics,
            health,
            recorded,
            forget,
            plan_failures,
        ],
        openapi_config=None,
        logging_config=None,
    )
    app.state.fake = State(config, Slots(config.max_num_seqs), deque(maxlen=config.history))
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--model", default=Config.model)
    parser.add_argument("--tokens", type=int, default=Config.tokens)
    parser.add_argument("--delay-ms", type=float, default=Config.delay_ms)
    parser.add_argument("--max-num-seqs", type=int, default=Config.max_num_seqs)
    parser.add_argument("--max-model-len", type=int, default=Config.max_model_len)
    parser.add_argument(
        "--scheduling-policy", choices=[PRIORITY_POLICY, "fcfs"], default=Config.scheduling_policy
    )
    parser.add_argument("--api-key")
    parser.add_argument("--fail-status", type=int)
    args = parser.parse_args(argv)
    config = Config(
        model=args.model,
        tokens=args.tokens,
        delay_ms=args.delay_ms,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        scheduling_policy=args.scheduling_policy,
        api_key=args.api_key,
        fail_status=args.fail_status,
    )
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
