"""An OpenAI-compatible upstream (vLLM, SGLang, any server with /v1/chat/completions) as
an EngineClient, for registry models of kind `openai`.

The gateway's request path stays what it is for its own engine: it counts the prompt
itself (a local tokenizer folder, or the upstream's `POST /tokenize`) for the worst-case
reservation, and reads this client's outputs as it reads the engine's. The client sends
chat requests as messages (the upstream applies its own template) and completions as the
client's text or token ids, always streamed and always with `include_usage`, so the
ledger takes the upstream's usage; where it disagrees with the gateway's count, that is
a metric and a log line. What is billed never exceeds what was reserved (the gateway's
count of the prompt, `max_tokens` per completion), nor what was streamed (a token is at
least a byte of text in a byte-level vocabulary: a completion's bytes, plus its stop
string and end token, which are counted but not sent): an upstream that claims more is
capped there, counted (metric and log line) and marked suspect (Replica.overclaims, shown
by the admin API), so a faulty or hostile upstream cannot drain a tenant's budget.

What the upstream answers itself goes to it as the client sent it (ClientPrompt.fields:
`response_format`, `tools`, `tool_choice`, `parallel_tool_calls`; and `logprobs`), and
its answer comes back as it sent it: `delta.tool_calls` and `logprobs` ride on the
outputs (RequestOutput.tool_calls, .relayed_logprobs). vLLM's older `guided_*` extras
are refused.

Every request carries the tenant's `cache_salt` (an HMAC of the tenant id under the
gateway's secret), so tenants never share the upstream's prefix cache, unless the model
is configured to share it. `priority` goes only to models configured for it, in their
convention: vLLM refuses a non-zero priority (400) unless it was started with
`--scheduling-policy priority`, and orders lower first, as the gateway does, so the value
passes as it is; SGLang runs higher values first by default, so it gets the negation.

Within the pool, targets are chosen by routing.pick (prefix affinity, their own load from
/metrics, weights); a request moves to another target only before its first token and
only after a retryable failure (refused connection, 429, 5xx), never after a 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import httpx
import msgspec

from backend import RequestOutput, SamplingParams
from backend.tokenizer import Tokenizer
from gateway.core.errors import (
    ApiError,
    EngineUnavailable,
    InvalidRequest,
    Overloaded,
    RateLimited,
    UpstreamFailed,
)
from gateway.core.tasks import Periodic
from gateway.dispatch import load
from gateway.dispatch.engine_client import TARGET_PARSES, GenerateRequest, LocalTokens
from gateway.dispatch.http1 import Http1Pool, Response, TransportError
from gateway.dispatch.routing import Replica, affinity_key, pick
from gateway.settings import PriorityOrder
from gateway.telemetry.request import current_request
from tenants.registry import UPSTREAM_KEY_PREFIX, ModelSpec, is_upstream_key_env

log = logging.getLogger(__name__)

PROBE_EVERY_S = 1.0
CONNECT_TIMEOUT_S = 2.0
ASK_TIMEOUT_S = 10.0  # /tokenize and /v1/models; generation has the request's deadlines
# Without the upstream's vocabulary, a generous bound on characters per token for the
# cheap "too long to tokenize" check (real vocabularies have long whitespace runs).
UNKNOWN_TOKEN_CHARS = 128
REFUSALS = (400, 413, 422)  # the request itself is wrong: the client hears why


# Records a disagreement: model, "prompt" or "completion", gateway's count, upstream's.
Disagreement = Callable[[str, str, int, int], None]
# Records usage capped at the reservation: model, upstream URL, kind, claimed, billed.
Overclaim = Callable[[str, str, str, int, int], None]


def _ignore(model: str, kind: str, ours: int, theirs: int) -> None:
    pass


def _ignore_overclaim(model: str, upstream: str, kind: str, claimed: int, billed: int) -> None:
    pass


@dataclass(frozen=True)
class UpstreamOptions:
    """What the gateway adds to every upstream request, from its settings."""

    salt_secret: bytes
    priority: PriorityOrder | None = None  # how the upstream orders by priority; None: not
    salted: bool = True  # send cache_salt: tenants do not share the upstream's prefix cache
    on_disagreement: Disagreement = _ignore
    on_overclaim: Overclaim = _ignore_overclaim
    probe_every_s: float = PROBE_EVERY_S


class _FunctionDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class _ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """One entry of `delta.tool_calls`: the first of a call has its id and name, the
    rest add to its arguments (vLLM and SGLang always send `index`)."""

    index: int
    id: str | None = None
    type: str | None = None
    function: _FunctionDelta | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    tool_calls: list[_ToolCallDelta] | None = None


class _Choice(msgspec.Struct):
    index: int = 0
    delta: _Delta | None = None  # chat
    text: str | None = None  # completions
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None  # in the endpoint's own shape


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _Details | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: Any = None  # a mid-stream error event
    object: str | None = None


class _Tokenized(msgspec.Struct):
    tokens: list[int]
    max_model_len: int | None = None


class TargetFailed(Exception):
    """One attempt on one target failed; `retryable` when another target may succeed."""

    def __init__(self, error: ApiError, *, retryable: bool, down: bool = False) -> None:
        super().__init__(error.message)
        self.error = error
        self.retryable = retryable
        self.down = down  # the target itself is unreachable: out of routing until probed back


def cache_salt(secret: bytes, tenant: str) -> str:
    """Opaque and stable per tenant; without the secret nobody can derive another's."""
    return hmac.new(secret, b"cache_salt:" + tenant.encode(), hashlib.sha256).hexdigest()


class OpenAIUpstreamClient:
    def __init__(
        self,
        spec: ModelSpec,
        options: UpstreamOptions,
        api_key: str | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.model_name = spec.name
        self.upstream_model = spec.upstream_model or spec.name
        self.max_model_len = spec.context_length or 0  # 0 until learnt (connect)
        self.targets = [Replica(t.url.rstrip("/"), weight=t.weight) for t in spec.targets]
        self.options = options
        self.local = LocalTokens(tokenizer) if tokenizer is not None else None
        self.max_token_chars = tokenizer.max_token_chars if tokenizer else UNKNOWN_TOKEN_CHARS
        self.tool_call_parser = TARGET_PARSES  # tools and tool_choice go upstream as sent
        self.hidden_size: int | None = None  # embeddings are refused (embed)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # The request path's calls (generation, /tokenize) on lean keep-alive connections;
        # the once-a-second probes and the one /v1/models on httpx.
        self._pool = Http1Pool(headers, connect_timeout_s=CONNECT_TIMEOUT_S)
        self._http = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=8),
        )
        self._open: dict[str, Response] = {}  # request id -> its upstream stream
        self._probes = Periodic([(self.refresh, options.probe_every_s)])
        self._warned_no_usage = False

    @classmethod
    async def connect(cls, spec: ModelSpec, options: UpstreamOptions) -> OpenAIUpstreamClient:
        """Probe the pool and learn what the registry left out (the context length)."""
        tokenizer = None
        if spec.tokenizer is not None:
            tokenizer = await asyncio.to_thread(Tokenizer, Path(spec.tokenizer))
        client = cls(spec, options, _api_key(spec), tokenizer)
        try:
            await client.refresh()
            if not client.max_model_len:
                client.max_model_len = await client._learn_context_length()
        except BaseException:
            await client.close()
            raise
        client._probes.start()
        return client

    # -- counting ------------------------------------------------------------------------

    async def tokenize(self, text: str) -> list[int]:
        if self.local is not None:
            return await self.local.tokenize(text)
        return await self._remote_tokens({"prompt": text}, "prompt")

    async def tokenize_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """With the local tokenizer where its chat template knows tools (or none are
        given), else the upstream's `/tokenize`, which takes the tools as vLLM's does."""
        if self.local is not None and (not tools or self.local.tokenizer.knows_tools):
            return await self.local.tokenize_chat(messages, tools)
        payload: dict[str, Any] = {"messages": as_sent(messages)}
        if tools:
            payload["tools"] = tools
        return await self._remote_tokens(payload, "messages")

    def decode(self, ids: list[int]) -> str:
        if self.local is None:
            raise InvalidRequest(
                f"model {self.model_name!r} has no local tokenizer to turn token ids back "
                "into text (echo of a token-id prompt)",
                param="echo",
            )
        return self.local.decode(ids)

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    async def _remote_tokens(self, payload: dict[str, Any], param: str) -> list[int]:
        """vLLM's `POST /tokenize`, on the first healthy target that answers."""
        body = msgspec.json.encode({"model": self.upstream_model, **payload})
        for target in self._healthy():
            try:
                async with asyncio.timeout(ASK_TIMEOUT_S):
                    status, headers, content = await self._post(f"{target.url}/tokenize", body)
            except (TransportError, TimeoutError):
                target.healthy = False  # the probes bring it back
                continue
            if status in REFUSALS:
                raise _refusal(status, headers, content).error
            try:
                tokenized = msgspec.json.decode(content, type=_Tokenized)
            except msgspec.DecodeError:  # an error page, or no /tokenize there: the next one
                continue
            if tokenized.max_model_len and not self.max_model_len:
                self.max_model_len = tokenized.max_model_len
            return tokenized.tokens
        raise EngineUnavailable(
            f"no upstream of model {self.model_name!r} could count the {param}",
            headers={"Retry-After": "1"},
        )

    async def _post(self, url: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        headers = {"Content-Type": "application/json"}
        async with await self._pool.request("POST", url, body, headers=headers) as response:
            return response.status_code, response.headers, await response.read()

    # -- generation ----------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """The upstream has no fairness `weight`; the caller enforces the `deadline` (it
        closes the stream); the request moves only before its first token, restartable
        or not."""
        source = request.source
        chat = source is not None and source.messages is not None
        body = msgspec.json.encode(self._body(request))
        path = "/v1/chat/completions" if chat else "/v1/completions"
        key = affinity_key(request.tenant, request.prompt)
        tried: set[str] = set()
        refusal: ApiError | None = None  # what to answer if every target fails
        while True:
            adapter = None if request.lora is None else request.lora.name
            target = pick(self.targets, key, exclude=tried, adapter=adapter)
            if target is None:
                raise refusal or EngineUnavailable(
                    f"no upstream of model {self.model_name!r} is available",
                    headers={"Retry-After": "1"},
                )
            tried.add(target.url)
            current_request().route(target.url)
            reader = StreamReader(
                self, target, request.request_id, len(request.prompt), request.params
            )
            target.in_flight += 1
            try:
                async with contextlib.aclosing(self._attempt(target, path, body, reader)) as outs:
                    async for out in outs:
                        yield out
                return
            except TargetFailed as failed:
                if failed.down:
                    target.healthy = False
                if reader.started or not failed.retryable:
                    raise failed.error from failed
                if refusal is None or not failed.down:  # an upstream's own answer says more
                    refusal = failed.error
                log.warning(
                    "upstream %s failed a request before its first token; moving on",
                    target.url,
                    extra={"model": self.model_name, "error": failed.error.code},
                )
            finally:
                target.in_flight -= 1

    def _body(self, request: GenerateRequest) -> dict[str, Any]:
        params, source, tenant = request.params, request.source, request.tenant
        forwarded = source.fields if source is not None else {}
        constraint = params.constraint  # from a forwarded field: the upstream enforces it
        if constraint is not None and constraint.field not in forwarded:
            refuse(self.model_name, constraint.field)  # vLLM's guided_* extras
        # A LoRA adapter goes by its name, as vLLM's --lora-modules serve one.
        model = self.upstream_model if request.lora is None else request.lora.name
        body: dict[str, Any] = {"model": model}
        top = params.logprobs  # the alternatives asked for per token; None: no logprobs
        if source is not None and source.messages is not None:
            body["messages"] = as_sent(source.messages)
            if top is not None:
                body |= {"logprobs": True, "top_logprobs": top}
        else:
            body["prompt"] = source.text if source is not None and source.text else request.prompt
            if top is not None:
                body["logprobs"] = top
        body |= sampling_fields(params) | forwarded
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        if tenant is not None and self.options.salted:
            body["cache_salt"] = cache_salt(self.options.salt_secret, tenant)
        if self.options.priority is not None and request.priority:
            lower_first = self.options.priority == "lower-first"  # the gateway's convention
            body["priority"] = request.priority if lower_first else -request.priority
        return body

    async def _attempt(
        self, target: Replica, path: str, body: bytes, reader: StreamReader
    ) -> AsyncGenerator[RequestOutput, None]:
        headers = {"Content-Type": "application/json", "X-Request-Id": reader.request_id}
        try:
            response = await self._pool.request(
                "POST", f"{target.url}{path}", body, headers=headers
            )
            async with response:
                if response.status_code != 200:
                    content = await response.read()
                    raise _refusal(response.status_code, response.headers, content)
                self._open[reader.request_id] = response
                try:
                    async for lines in response.line_batches():
                        for out in reader.lines(lines):
                            yield out
                        if reader.done:
                            return
                finally:
                    self._open.pop(reader.request_id, None)
        except TransportError as exc:
            error = EngineUnavailable(
                f"the upstream of model {self.model_name!r} could not be reached"
                if not reader.started
                else "the upstream serving this request failed",
                code="upstream_unreachable",
                headers={"Retry-After": "1"},
            )
            raise TargetFailed(error, retryable=True, down=True) from exc
        failed = UpstreamFailed("the upstream's stream ended before the request finished")
        raise TargetFailed(failed, retryable=True)

    async def embed(self, prompts: list[list[int]]) -> list[list[float]]:
        raise InvalidRequest(
            f"embeddings are not available for model {self.model_name!r} yet", param="model"
        )

    def abort(self, request_id: str) -> None:
        """Close the request's upstream connection now: vLLM aborts on disconnect."""
        response = self._open.pop(request_id, None)
        if response is not None:
            response.close()

    def compare(self, kind: str, ours: int, theirs: int) -> None:
        """The upstream's usage against the gateway's own count: a difference is a metric
        and a log line (counts only), never silent."""
        if ours == theirs:
            return
        self.options.on_disagreement(self.model_name, kind, ours, theirs)
        log.info(
            "upstream usage differs from the gateway's count",
            extra={
                "model": self.model_name,
                "usage_kind": kind,
                "gateway_tokens": ours,
                "upstream_tokens": theirs,
            },
        )

    def overclaimed(
        self, target: Replica, request_id: str, kind: str, claimed: int, billed: int
    ) -> None:
        """The upstream claimed more `kind` tokens than were reserved or streamed:
        `billed` is what the ledger takes; the upstream is marked suspect."""
        target.overclaims += 1
        self.options.on_overclaim(self.model_name, target.url, kind, claimed, billed)
        log.warning(
            "upstream usage exceeds what was reserved or streamed: billed at most that",
            extra={
                "model": self.model_name,
                "upstream": target.url,
                "request_id": request_id,
                "usage_kind": kind,
                "upstream_tokens": claimed,
                "billed_tokens": billed,
            },
        )

    def upstreams(self) -> list[dict[str, Any]]:
        """Each target as this gateway sees it: health, and whether it is suspect."""
        return [
            {
                "url": t.url,
                "healthy": t.healthy,
                "suspect": t.overclaims > 0,
                "usage_overclaims": t.overclaims,
            }
            for t in self.targets
        ]

    def warn_no_usage(self) -> None:
        if not self._warned_no_usage:
            self._warned_no_usage = True
            log.warning(
                "the upstream of model %s ignored include_usage: billing the gateway's counts",
                self.model_name,
            )

    # -- the pool ------------------------------------------------------------------------

    def is_ready(self) -> bool:
        return any(t.healthy for t in self.targets)

    def is_alive(self) -> bool:
        return True  # an upstream is its own operator's to restart

    def interactive_work(self) -> int:
        return 0  # an upstream does not say: its batch lines are not held back

    async def refresh(self) -> None:
        """Probe every target: health, and load for routing."""
        await asyncio.gather(*(load.probe(self._http, t) for t in self.targets))

    def _healthy(self) -> list[Replica]:
        return sorted((t for t in self.targets if t.healthy), key=Replica.load)

    async def _learn_context_length(self) -> int:
        """From `/v1/models` (vLLM's `max_model_len`), else from `/tokenize`."""
        for target in self._healthy():
            with contextlib.suppress(httpx.HTTPError, msgspec.DecodeError, KeyError, TypeError):
                response = await self._http.get(f"{target.url}/v1/models", timeout=ASK_TIMEOUT_S)
                for card in response.json()["data"]:
                    if card.get("id") == self.upstream_model and card.get("max_model_len"):
                        return int(card["max_model_len"])
        with contextlib.suppress(ApiError, msgspec.DecodeError):
            await self._remote_tokens({"prompt": ""}, "prompt")
        if self.max_model_len:
            return self.max_model_len
        raise EngineUnavailable(
            f"cannot learn the context length of model {self.model_name!r} from its "
            "upstreams; give it in the registry"
        )

    async def close(self) -> None:
        await self._probes.close()
        for response in list(self._open.values()):
            response.close()
        await self._pool.close()
        await self._http.aclose()


def refuse(model: str, param: str) -> NoReturn:
    raise InvalidRequest(f"{param} is not available for model {model!r} yet", param=param)


def as_sent(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages in OpenAI's shape: the gateway's are in chat templates' (Hugging
    Face's convention), where a tool call's arguments are an object, not JSON text."""
    return [
        {**m, "tool_calls": [_call_as_sent(c) for c in m["tool_calls"]]} if "tool_calls" in m else m
        for m in messages
    ]


def _call_as_sent(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    arguments = function["arguments"]
    if not isinstance(arguments, str):
        arguments = msgspec.json.encode(arguments).decode()
    return {**call, "function": {**function, "arguments": arguments}}


def sampling_fields(params: SamplingParams) -> dict[str, Any]:
    """The sampling parameters as OpenAI's API names them, and vLLM's extensions only
    where they differ from their defaults (a strict OpenAI server refuses unknown ones)."""
    fields: dict[str, Any] = {
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
    }
    optional: dict[str, Any] = {
        "n": params.n if params.n != 1 else None,
        "seed": params.seed,
        "stop": params.stop or None,
        "presence_penalty": params.presence_penalty or None,
        "frequency_penalty": params.frequency_penalty or None,
        "top_k": params.top_k or None,
        "min_tokens": params.min_tokens or None,
        "repetition_penalty": params.repetition_penalty if params.penalized else None,
        "ignore_eos": params.ignore_eos or None,
        "stop_token_ids": params.stop_token_ids or None,
        "min_p": params.min_p or None,
        "logit_bias": {str(t): b for t, b in params.logit_bias.items()} or None,
    }
    if optional["repetition_penalty"] == 1:
        optional["repetition_penalty"] = None
    return fields | {name: value for name, value in optional.items() if value is not None}


@dataclass
class StreamReader:
    """One attempt's server-sent events turned into the gateway's outputs: a text delta
    (or tool-call deltas) per chunk (one token each, vLLM's rhythm), then, once the usage
    chunk came, each completion's final output with the upstream's counts. The text
    deltas of a completion that came in one read go on as one output (they are there
    together anyway: an upstream that sends faster than the gateway reads, or vLLM's
    stream_interval), so a backlog costs one pass through the request path, not one a
    token; tool-call and logprob deltas go one by one, as sent."""

    client: OpenAIUpstreamClient
    target: Replica
    request_id: str
    prompt_tokens: int  # the gateway's own count: what was reserved for the prompt
    params: SamplingParams  # `n` completions of at most `max_tokens` each were reserved
    started: bool = False  # an output went to the caller: no failover from here
    done: bool = False
    arrival: float = field(default_factory=time.monotonic)
    counted: dict[int, int] = field(default_factory=dict)
    streamed_bytes: int = 0  # of text and tool calls, all choices: what caps the bill
    finish: dict[int, str] = field(default_factory=dict)
    usage: _Usage | None = None

    def lines(self, lines: list[bytes]) -> list[RequestOutput]:
        """The outputs of lines that came together: a completion's text deltas in a row
        go as one output."""
        outs: list[RequestOutput] = []
        for line in lines:
            for choice in self._choices(line, outs):
                self._add(choice, outs)
            if self.done:
                break
        return outs

    def _choices(self, line: bytes, outs: list[RequestOutput]) -> list[_Choice]:
        """A line's choices; `data: [DONE]` puts each completion's final output in `outs`."""
        if not line.startswith(b"data:"):
            return []  # blank separators, comments, event names
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = True
            outs.extend(self._final())
            return []
        try:
            chunk = _chunk(data)
        except msgspec.DecodeError as exc:
            unreadable = UpstreamFailed(f"unreadable upstream event: {exc}")
            raise TargetFailed(unreadable, retryable=True) from exc
        if chunk.error is not None or chunk.object == "error":
            raise TargetFailed(UpstreamFailed("the upstream failed this request"), retryable=True)
        if chunk.usage is not None and not chunk.choices:
            self.usage = chunk.usage
        return chunk.choices

    def _add(self, choice: _Choice, outs: list[RequestOutput]) -> None:
        """The choice's delta as a new output, or added to the last one when both are
        plain text of the same completion."""
        if choice.finish_reason is not None:
            self.finish[choice.index] = choice.finish_reason
        text = choice.text if choice.delta is None else choice.delta.content
        calls = None if choice.delta is None else choice.delta.tool_calls
        if not text and not calls and choice.logprobs is None:
            return  # the role announcement, or a chunk that only finishes
        self.streamed_bytes += len(text.encode()) if text else 0
        self.streamed_bytes += len(msgspec.json.encode(calls)) if calls else 0
        count = min(self.counted.get(choice.index, 0) + bool(text or calls), self.max_tokens)
        self.counted[choice.index] = count
        self.started = True
        last = outs[-1] if outs else None
        if (
            last is not None
            and text
            and not calls
            and choice.logprobs is None
            and _plain(last, choice.index)
        ):
            last.text += text
            last.completion_tokens = count
            return
        now = time.monotonic()
        outs.append(
            RequestOutput(
                self.request_id,
                text or "",
                [],
                False,
                None,
                self.prompt_tokens,
                count,
                arrival_time=self.arrival,
                first_token_time=now if count == 1 else None,
                token_times=[now],
                index=choice.index,
                tool_calls=msgspec.to_builtins(calls) if calls else None,
                relayed_logprobs=choice.logprobs,
            )
        )

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    def _final(self) -> list[RequestOutput]:
        """Each completion's last output. The prompt and output tokens billed are the
        upstream's, up to what was reserved; a difference from the gateway's counts is
        recorded, never hidden."""
        if len(self.finish) < self.n:
            raise TargetFailed(
                UpstreamFailed("the upstream ended the stream before every choice finished"),
                retryable=True,
            )
        counted = [self.counted.get(index, 0) for index in range(self.n)]
        prompt, cached = self.prompt_tokens, 0
        if self.usage is None:
            self.client.warn_no_usage()
        else:
            usage = self.usage
            details = usage.prompt_tokens_details
            self.client.compare("prompt", self.prompt_tokens, usage.prompt_tokens)
            self.client.compare("completion", sum(counted), usage.completion_tokens)
            prompt = self._capped("prompt", usage.prompt_tokens, self.prompt_tokens)
            cached = min((details.cached_tokens or 0) if details is not None else 0, prompt)
            completion = self._capped("completion", usage.completion_tokens, self._most())
            counted = _spread(completion, counted, self.max_tokens)
        self.started = True
        return [
            RequestOutput(
                self.request_id,
                "",
                [],
                True,
                self.finish[index],
                prompt,
                counted[index],
                cached_tokens=cached,
                arrival_time=self.arrival,
                index=index,
            )
            for index in range(self.n)
        ]

    def _most(self) -> int:
        """The most completion tokens billed: what was reserved, and what was streamed
        (a byte a token, and each completion's stop string and end token, not sent)."""
        stop_bytes = max((len(stop.encode()) for stop in self.params.stop), default=0)
        unsent = self.n * (stop_bytes + 1)
        return min(self.n * self.max_tokens, self.streamed_bytes + unsent)

    def _capped(self, kind: str, claimed: int, most: int) -> int:
        """What is billed of an upstream's `claimed` count: at most `most`."""
        billed = max(0, min(claimed, most))
        if claimed > most:
            self.client.overclaimed(self.target, self.request_id, kind, claimed, billed)
        return billed


def _spread(total: int, counted: list[int], cap: int) -> list[int]:
    """`total` completion tokens over the choices: each keeps what was streamed of it, as
    far as `total` goes, and any rest goes to the first with room; none over `cap`."""
    billed = [min(count, cap) for count in counted]
    rest = total - sum(billed)
    for index, count in enumerate(billed):
        change = max(min(rest, cap - count), -count)
        billed[index] += change
        rest -= change
    return billed


_CHUNKS = msgspec.json.Decoder(_Chunk)


def _chunk(data: bytes) -> _Chunk:
    try:
        return _CHUNKS.decode(data)
    except msgspec.DecodeError:  # perhaps bytes that are not UTF-8: read them as replaced
        return _CHUNKS.decode(data.decode(errors="replace"))


def _plain(out: RequestOutput, index: int) -> bool:
    """`out` is a text delta of completion `index` that more text can be added to."""
    return (
        out.index == index
        and not out.finished
        and out.tool_calls is None
        and out.relayed_logprobs is None
    )


def _refusal(status: int, headers: dict[str, str], content: bytes) -> TargetFailed:
    """An upstream's error answer as the gateway's error: 429 and 503 keep their
    Retry-After, a 400 its message and parameter, anything else is a 502. `headers`: the
    lean client's, names in lower case."""
    message, param = _error_fields(content)
    retry = headers.get("retry-after")
    passed = {"Retry-After": retry} if retry else {}
    if status in REFUSALS:
        refused = message or f"the upstream refused the request (HTTP {status})"
        return TargetFailed(InvalidRequest(refused, param=param), retryable=False)
    if status == 429:  # the upstream's limit refused: its x-ratelimit-* headers say which
        limits = {k: v for k, v in headers.items() if k.startswith("x-ratelimit-")}
        limited = RateLimited(
            message or "the upstream is rate limiting", headers={**limits, **passed}
        )
        return TargetFailed(limited, retryable=True)
    if status == 503:
        overloaded = Overloaded(message or "the upstream is overloaded", headers=passed)
        return TargetFailed(overloaded, retryable=True)
    if status in (401, 403):
        denied = UpstreamFailed("the upstream refused the gateway's credentials")
        return TargetFailed(denied, retryable=False)
    return TargetFailed(UpstreamFailed(f"the upstream answered HTTP {status}"), retryable=True)


def _error_fields(content: bytes) -> tuple[str | None, str | None]:
    """`message` and `param` of an OpenAI-shaped error (or vLLM's older flat one)."""
    try:
        body = msgspec.json.decode(content)
    except msgspec.DecodeError:
        return None, None
    error = body.get("error", body) if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return None, None
    message, param = error.get("message"), error.get("param")
    return (
        str(message)[:2000] if message else None,
        str(param) if isinstance(param, str) else None,
    )


def _api_key(spec: ModelSpec) -> str | None:
    """The value of the model's key variable; a name stored before names were limited to
    UPSTREAM_KEY_PREFIX is refused here too, never read."""
    if spec.api_key_env is None:
        return None
    if not is_upstream_key_env(spec.api_key_env):
        raise EngineUnavailable(
            f"model {spec.name!r}: its api key variable {spec.api_key_env} is not named "
            f"{UPSTREAM_KEY_PREFIX}<NAME>, and only such variables are sent upstream: "
            "rename it (tollgate models update NAME --api-key-env ...)"
        )
    key = os.environ.get(spec.api_key_env, "").strip()
    if not key:
        raise EngineUnavailable(
            f"model {spec.name!r}: the environment variable {spec.api_key_env} holding its "
            "upstream API key is not set on this gateway"
        )
    return key
