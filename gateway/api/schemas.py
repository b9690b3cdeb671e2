"""Request bodies of the OpenAI-compatible API, decoded and validated by msgspec.

Unknown fields are ignored (clients send many); wrong types and out-of-range values
are rejected with the offending field named in `param`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct

from backend.constraint import Constraint
from backend.errors import ConstraintError
from backend.grammar_limits import check_choice_count, check_length
from backend.sampling import (
    MAX_COUNT,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_PENALTY,
    MAX_SEED,
    MIN_PENALTY,
)
from gateway.api.tools import (
    FunctionDef,
    FunctionName,
    NamedToolChoice,
    ToolChoice,
    ToolDef,
    ToolPlan,
    plan,
    template_tools,
)
from gateway.core.errors import InvalidRequest
from gateway.openapi.shapes import ToolCall
from tenants.limits import LOWEST_PRIORITY

# Every number is bounded: an unbounded integer reaches torch (tensors, generator seeds)
# and must be refused here, not fail inside the engine's step.
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
PositiveInt = Annotated[int, Meta(ge=1, le=MAX_COUNT)]
NonNegativeInt = Annotated[int, Meta(ge=0, le=MAX_COUNT)]
TokenId = Annotated[int, Meta(ge=0, le=MAX_COUNT)]
Seed = Annotated[int, Meta(ge=0, le=MAX_SEED)]
MAX_STOP_CHARS = 1024  # each stop string is searched for after every token
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]
StopList = Annotated[list[StopString], Meta(max_length=4)]
MAX_STOP_TOKEN_IDS = 64  # vLLM's extra; each step looks for its token among them
DeadlineMs = Annotated[int, Meta(ge=1, le=3_600_000)]  # an hour: longer is no deadline
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Bias = Annotated[float, Meta(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]


class StreamOptions(Struct):
    include_usage: bool = False


class TextPart(Struct):
    type: Literal["text"]
    text: str


class ChatMessage(Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None: an assistant turn of tool calls
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template(self, at: str) -> dict[str, Any]:
        """The message as chat templates take it (Hugging Face's convention: a call's
        arguments as a parsed object); `at` names it in errors."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.role == "tool":
            if self.tool_call_id is None:
                raise InvalidRequest(
                    "a tool message needs tool_call_id", param=f"{at}.tool_call_id"
                )
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                _template_call(call, f"{at}.tool_calls[{i}]")
                for i, call in enumerate(self.tool_calls)
            ]
        return message

    def chars(self) -> int:
        """Characters this message puts in the prompt, near enough to bound its tokens."""
        calls = self.tool_calls or []
        return len(self.text()) + sum(len(c.function.arguments) for c in calls)


def _template_call(call: ToolCall, at: str) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        raise InvalidRequest(
            "a tool call's arguments must be JSON text", param=f"{at}.function.arguments"
        ) from None
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


class TextResponse(Struct, tag_field="type", tag="text"):
    pass


class JsonObjectResponse(Struct, tag_field="type", tag="json_object"):
    pass


class JsonSchemaSpec(Struct, kw_only=True, omit_defaults=True):
    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    schema: dict[str, Any] | None = None  # None: any JSON object
    strict: bool | None = None  # always enforced: the output is decoded under the schema
    description: str | None = None


class JsonSchemaResponse(Struct, tag_field="type", tag="json_schema"):
    json_schema: JsonSchemaSpec


ResponseFormat = TextResponse | JsonObjectResponse | JsonSchemaResponse


NOT_SUPPORTED = Meta(
    description="Not supported: a 400 naming it, unless it asks for what the server does anyway."
)
# The unsupported fields (best_of aside: it may equal n), each with the values that ask for
# what the server does anyway (text out, nothing stored, no beam search, stops cut).
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "suffix": (),
    "prediction": (),
    "audio": (),
    "modalities": (["text"],),
    "reasoning_effort": (),
    "web_search_options": (),
    "store": (False,),
    "service_tier": ("auto", "default"),
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "prompt_logprobs": (),
    "include_stop_str_in_output": (False,),
    "truncate_prompt_tokens": (),
    "guided_whitespace_pattern": (),
}


class SamplingFields(Struct, kw_only=True):
    """Fields shared by chat and text completions."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: NonNegativeInt | None = None
    n: Annotated[int, Meta(ge=1, le=16)] = 1
    stop: StopString | StopList | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] = []
    seed: Seed | None = None
    ignore_eos: bool = False
    min_tokens: NonNegativeInt = 0
    repetition_penalty: Annotated[float, Meta(ge=MIN_PENALTY, le=MAX_PENALTY)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    logit_bias: dict[str, Annotated[float, Meta(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = (
        None
    )
    # Well-known OpenAI and vLLM fields this server does not honour: refused by name
    # (refuse_unsupported), not ignored, unless they ask for what it does anyway.
    best_of: Annotated[int, NOT_SUPPORTED] | None = None
    suffix: Annotated[str, NOT_SUPPORTED] | None = None
    prediction: Annotated[dict[str, Any], NOT_SUPPORTED] | None = None
    audio: Annotated[dict[str, Any], NOT_SUPPORTED] | None = None
    modalities: Annotated[list[str], NOT_SUPPORTED] | None = None
    reasoning_effort: Annotated[str, NOT_SUPPORTED] | None = None
    web_search_options: Annotated[dict[str, Any], NOT_SUPPORTED] | None = None
    store: Annotated[bool, NOT_SUPPORTED] | None = None
    service_tier: Annotated[str, NOT_SUPPORTED] | None = None
    use_beam_search: Annotated[bool, NOT_SUPPORTED] | None = None
    length_penalty: Annotated[float, NOT_SUPPORTED] | None = None
    allowed_token_ids: Annotated[list[int], NOT_SUPPORTED] | None = None
    bad_words: Annotated[list[str], NOT_SUPPORTED] | None = None
    prompt_logprobs: Annotated[int, NOT_SUPPORTED] | None = None
    include_stop_str_in_output: Annotated[bool, NOT_SUPPORTED] | None = None
    truncate_prompt_tokens: Annotated[int, NOT_SUPPORTED] | None = None
    guided_whitespace_pattern: Annotated[str, NOT_SUPPORTED] | None = None
    priority: Annotated[int, Meta(ge=0, le=LOWEST_PRIORITY)] | None = None  # 0: most urgent
    ttft_deadline_ms: DeadlineMs | None = None  # the first token within this, else 504
    user: str | None = None
    # vLLM's structured-output extras
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Meta(min_length=1)] | None = None
    guided_grammar: str | None = None

    def refuse_unsupported(self) -> None:
        """A 400 naming the first well-known field this server cannot honour, rather than
        an answer that silently ignores it."""
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest("best_of is not supported (use n)", param="best_of")
        for name, as_is in UNSUPPORTED_FIELDS.items():
            value = getattr(self, name)
            if value is not None and value not in as_is:
                raise InvalidRequest(f"{name} is not supported", param=name)

    def token_biases(self) -> dict[int, float]:
        """logit_bias with its keys as token ids; a key that is not one is a 400."""
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequest(
                f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}",
                param="logit_bias",
            )
        try:
            return {int(token): value for token, value in bias.items()}
        except ValueError:
            raise InvalidRequest(
                "logit_bias keys must be token ids (decimal strings)", param="logit_bias"
            ) from None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def output_limit(self) -> int | None:
        return self.max_tokens

    def engine_logprobs(self) -> int | None:
        """How many alternatives per token the engine reports; None: no logprobs."""
        return None

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def constraint(self, tools: ToolPlan | None = None) -> Constraint | None:
        """What the output must match: at most one of the ways to ask for it (a forced
        tool choice is one)."""
        asked = self._constraints()
        if tools is not None and tools.forced is not None:
            asked.append(("tool_choice", _json_schema(tools.forced, "tool_choice")))
        if len(asked) > 1:
            (first, _), (second, _) = asked[:2]
            raise InvalidRequest(
                f"{first} and {second} both constrain the output; use one", param=second
            )
        if not asked:
            return None
        field, chosen = asked[0]
        return replace(chosen, field=field)  # a refusal names the field the client sent

    def _constraints(self) -> list[tuple[str, Constraint]]:
        asked: list[tuple[str, Constraint]] = []
        if self.guided_json is not None:
            schema = _schema_of(self.guided_json)
            asked.append(("guided_json", _json_schema(schema, "guided_json")))
        if self.guided_regex is not None:
            asked.append(("guided_regex", Constraint("regex", self.guided_regex)))
        if self.guided_choice is not None:
            _bounded(check_choice_count, "guided_choice", len(self.guided_choice))
            asked.append(("guided_choice", Constraint("choice", json.dumps(self.guided_choice))))
        if self.guided_grammar is not None:
            asked.append(("guided_grammar", Constraint("grammar", self.guided_grammar)))
        return asked


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    # OpenAI's deprecated form of tools, still sent by older clients: read as tools.
    functions: list[FunctionDef] | None = None
    function_call: Literal["none", "auto"] | FunctionName | None = None

    def __post_init__(self) -> None:
        if self.functions is None and self.function_call is None:
            return
        if self.tools is not None or self.tool_choice is not None:
            raise InvalidRequest(
                "functions and tools both declare tools; use tools", param="functions"
            )
        if self.functions is None:
            raise InvalidRequest("function_call needs functions", param="function_call")
        self.tools = [ToolDef("function", f) for f in self.functions]
        call = self.function_call
        if isinstance(call, FunctionName):
            self.tool_choice = NamedToolChoice("function", call)
        else:
            self.tool_choice = call
        self.parallel_tool_calls = False  # a functions request gets one call

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def tool_plan(self, parser: str) -> ToolPlan | None:
        """How to honour the tools; `parser`: the model's tool-call format. A request
        that used `functions` is answered in that API's shape (`function_call`)."""
        found = plan(self.tools, self.tool_choice, self.parallel_tool_calls, parser)
        if found is None or self.functions is None:
            return found
        return replace(found, legacy=True)

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template(f"messages[{i}]") for i, m in enumerate(self.messages)]

    def template_tools(self) -> list[dict[str, Any]] | None:
        return template_tools(self.tools) if self.tools else None

    def forwarded(self) -> dict[str, Any]:
        """The fields an OpenAI-compatible upstream answers itself, in OpenAI's JSON, as
        sent (ClientPrompt.fields); `parallel_tool_calls` only where it is not the default."""
        fields = {
            "response_format": self.response_format,
            "tools": self.tools,
            "tool_choice": self.tool_choice,
            "parallel_tool_calls": None if self.parallel_tool_calls else False,
        }
        return {name: msgspec.to_builtins(v) for name, v in fields.items() if v is not None}

    def prompt_chars(self) -> int:
        """Characters the prompt is rendered from, near enough to bound its tokens."""
        tools = len(encode(self.tools)) if self.tools else 0
        return sum(m.chars() for m in self.messages) + tools

    def _constraints(self) -> list[tuple[str, Constraint]]:
        asked = super()._constraints()
        rf = self.response_format
        if isinstance(rf, JsonObjectResponse):
            asked.insert(0, ("response_format", Constraint("json_object")))
        elif isinstance(rf, JsonSchemaResponse):
            schema = rf.json_schema.schema
            constraint = (
                Constraint("json_object")
                if schema is None
                else _json_schema(schema, "response_format")
            )
            asked.insert(0, ("response_format", constraint))
        return asked


MAX_PROMPTS = 64  # prompts in one batched completions request


class CompletionRequest(SamplingFields, kw_only=True):
    # A string, token ids, or a batch of either (msgspec allows one list type per union).
    prompt: str | Annotated[list[str | TokenId | list[TokenId]], Meta(min_length=1)]
    echo: bool = False
    logprobs: TopLogprobs | None = None

    def engine_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts, one or a batch: all text or all token ids, at most MAX_PROMPTS."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [[p for p in prompt if isinstance(p, int)]]
        texts = [p for p in prompt if isinstance(p, str)]
        ids = [p for p in prompt if isinstance(p, list)]
        if len(texts) != len(prompt) and len(ids) != len(prompt):
            raise InvalidRequest(
                "prompt must be a string, a list of token ids, a list of strings or a list "
                "of token-id lists; not a mix",
                param="prompt",
            )
        if len(prompt) > MAX_PROMPTS:
            raise InvalidRequest(
                f"prompt is a batch of {len(prompt)}; at most {MAX_PROMPTS} prompts per request",
                param="prompt",
                code="too_many_prompts",
            )
        return texts or ids


def _schema_of(guided_json: dict[str, Any] | str) -> dict[str, Any]:
    if isinstance(guided_json, dict):
        return guided_json
    try:
        schema = json.loads(guided_json)
    except ValueError:
        schema = None
    if not isinstance(schema, dict):
        raise InvalidRequest("guided_json must be a JSON schema (an object)", param="guided_json")
    return schema


def _json_schema(schema: dict[str, Any], field: str) -> Constraint:
    # Sized before it is closed and encoded: those take 0.3 s of the event loop for a
    # 4 MB schema, and the engine refuses one past 64 KiB anyway (grammar_limits.py).
    _bounded(check_length, field, len(msgspec.json.encode(schema)))
    return Constraint("json_schema", json.dumps(closed(schema)))


def _bounded(check: Callable[[str, int], None], field: str, size: int) -> None:
    """A grammar limit the gateway can check cheaply, before work on the event loop."""
    try:
        check(field, size)
    except ConstraintError as exc:
        raise InvalidRequest(str(exc), param=field) from None


# The keywords whose values are schemas, lists of schemas, and maps of names to schemas.
_SUBSCHEMA = (
    *("items", "additionalItems", "contains", "not", "if", "then", "else"),
    *("additionalProperties", "propertyNames", "unevaluatedItems"),
)
_SUBSCHEMAS = ("anyOf", "oneOf", "prefixItems", "items")  # not allOf: its parts add up
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed(schema: Any) -> Any:
    """The schema with every object that does not say otherwise closed to properties it
    does not name (`additionalProperties: false`), as vLLM's default grammar backend
    (xgrammar's strict mode) and OpenAI's `strict` do: a model then cannot wander into
    keys of its own. Every output still matches the schema as given."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if key in out:
            out[key] = closed(out[key])
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), list):
            out[key] = [closed(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    is_object = out.get("type") == "object" or "properties" in out
    says = ("additionalProperties", "unevaluatedProperties", "allOf")
    if is_object and not any(key in out for key in says):
        out["additionalProperties"] = False
    return out


T = TypeVar("T")

_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def decode(body: bytes, kind: type[T]) -> T:
    """Decode a JSON body or raise InvalidRequest naming the offending field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(_clean(str(exc)), param=_param_of(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None


def _param_of(message: str) -> str | None:
    missing = _MISSING.search(message)
    at = _PATH.search(message)
    path = at.group(1) if at else ""
    if missing:
        return f"{path}.{missing.group(1)}" if path else missing.group(1)
    return path or None


def _clean(message: str) -> str:
    return _PATH.sub(lambda m: f" (at '{m.group(1)}')" if m.group(1) else "", message)


def encode(payload: Any) -> bytes:
    return msgspec.json.encode(payload)
