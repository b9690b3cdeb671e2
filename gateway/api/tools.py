"""Tool calling: the request's tools, the constraint a forced choice puts on the output,
and the parsers that turn a model's output into OpenAI `tool_calls`.

`tool_choice` "required" and a named function are enforced by constrained decoding (the
output is then plain JSON: the arguments of the named function, or a list of calls);
"auto" lets the model answer freely and parses the output in the model's own tool-call
format (Hermes `<tool_call>` blocks or Llama 3.1 JSON). A target that parses its own
output (TARGET_PARSES: an OpenAI-compatible upstream) gets the tools and tool_choice as
the client sent them and sends the calls itself: its plan is checked, then inactive.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from msgspec import Struct

from gateway.core.errors import InvalidRequest
from gateway.dispatch.engine_client import TARGET_PARSES
from gateway.openapi.shapes import CalledFunction, ToolCall


class FunctionDef(Struct, kw_only=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def schema(self) -> dict[str, Any]:
        return self.parameters or {"type": "object", "properties": {}}


class ToolDef(Struct):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Struct):
    name: str


class NamedToolChoice(Struct):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolPlan:
    """What the request's tools mean for one generation: a JSON schema the output must
    follow (a forced choice), or a parser for free output ("auto"), or neither."""

    tools: list[ToolDef]
    forced: dict[str, Any] | None = None  # the output's JSON schema, when forced
    named: str | None = None  # the output is this function's arguments
    parser: str | None = None  # "auto": the model's tool-call format
    legacy: bool = False  # asked with `functions`: answered as `function_call`

    @property
    def active(self) -> bool:
        return self.forced is not None or self.parser is not None

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The content and the tool calls of a finished output."""
        if self.named is not None:
            return None, [_call(self.named, _arguments(text))]
        if self.forced is not None:
            return None, [_call(c["name"], c["parameters"]) for c in _json(text)]
        if self.parser is not None:
            return PARSERS[self.parser].parse(text)
        return text, []


def plan(
    tools: list[ToolDef] | None,
    choice: ToolChoice | None,
    parallel: bool,
    parser: str,
) -> ToolPlan | None:
    """Check the request's tools against its tool_choice and say how to honour them."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        return None
    _check_names(tools)
    chosen = None
    if isinstance(choice, NamedToolChoice):
        chosen = next((t for t in tools if t.function.name == choice.function.name), None)
        if chosen is None:
            raise InvalidRequest(
                f"tool_choice names {choice.function.name!r}, which is not among the tools",
                param="tool_choice",
            )
    if parser == TARGET_PARSES or choice == "none":  # the target's own, or no calls
        return ToolPlan(tools)
    if choice is None or choice == "auto":
        return ToolPlan(tools, parser=parser)
    if choice == "required":
        return ToolPlan(tools, forced=_calls_schema(tools, parallel))
    assert chosen is not None
    return ToolPlan(tools, forced=chosen.function.schema(), named=chosen.function.name)


def assembled(deltas: list[dict[str, Any]]) -> list[ToolCall]:
    """Streamed `delta.tool_calls` entries put together, call by call (by `index`): the
    first of a call has its id and name, the rest add to its arguments."""
    calls: dict[int, _Assembling] = {}
    for delta in deltas:
        function = delta.get("function") or {}
        call = calls.setdefault(delta.get("index", 0), _Assembling())
        call.id = call.id or delta.get("id")
        call.name += function.get("name") or ""
        call.arguments.append(function.get("arguments") or "")
    return [
        ToolCall(
            id=call.id or new_call_id(),
            function=CalledFunction(name=call.name, arguments="".join(call.arguments)),
        )
        for _, call in sorted(calls.items())
    ]


@dataclass
class _Assembling:
    id: str | None = None
    name: str = ""
    arguments: list[str] = field(default_factory=list)


def template_tools(tools: list[ToolDef]) -> list[dict[str, Any]]:
    """The tools as chat templates take them (Hugging Face's convention)."""
    return [
        {
            "type": "function",
            "function": {
                "name": t.function.name,
                "description": t.function.description or "",
                "parameters": t.function.schema(),
            },
        }
        for t in tools
    ]


def _check_names(tools: list[ToolDef]) -> None:
    names = [t.function.name for t in tools]
    for name in names:
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise InvalidRequest(
                f"function name {name[:80]!r} must be 1-64 letters, digits, _ or -",
                param="tools",
            )
    if len(set(names)) != len(names):
        raise InvalidRequest("function names must be unique", param="tools")


def _calls_schema(tools: list[ToolDef], parallel: bool) -> dict[str, Any]:
    """vLLM's shape for "required": a list of {name, parameters}, at least one."""
    one_of = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": t.function.schema(),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _call(name: str, arguments: Any) -> ToolCall:
    text = arguments if isinstance(arguments, str) else _compact(arguments)
    return ToolCall(id=new_call_id(), function=CalledFunction(name=name, arguments=text))


def _compact(value: Any) -> str:
    """Arguments as JSON text in one spacing, whichever way the call was read (a named
    function's raw output, a parsed list of calls): no spaces, as OpenAI's calls."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        # Only a forced output that ran out of max_tokens can be cut short.
        raise InvalidRequest(
            "the tool call was cut short by max_tokens; raise max_tokens", param="max_tokens"
        ) from None


def _arguments(text: str) -> str:
    return _compact(_json(text))


Split = tuple[str, bool]  # (the text that is safe to send now, whether a call has begun)


@dataclass(frozen=True)
class Parser:
    """One model family's tool-call format."""

    parse: Callable[[str], tuple[str | None, list[ToolCall]]]
    split: Callable[[str, bool], Split]  # (text so far, content sent yet?) -> Split


_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_HERMES_START = "<tool_call>"


def _parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks."""
    head, marker, _ = text.partition(_HERMES_START)
    if not marker:
        return text, []
    calls = [c for c in (_named_call(m) for m in _HERMES_CALL.findall(text)) if c is not None]
    if not calls:
        return text, []
    return head.strip() or None, calls


def _split_hermes(text: str, _sent: bool) -> Split:
    at = text.find(_HERMES_START)
    if at >= 0:
        return text[:at], True
    for keep in range(min(len(text), len(_HERMES_START) - 1), 0, -1):
        if _HERMES_START.startswith(text[-keep:]):  # may be the start of a marker
            return text[:-keep], False
    return text, False


_PYTHON_TAG = "<|python_tag|>"


def _parse_llama3(text: str) -> tuple[str | None, list[ToolCall]]:
    """Llama 3.1/3.2 JSON: `{"name": ..., "parameters": {...}}`, optionally after
    `<|python_tag|>`, several separated by `;`."""
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    calls = [_named_call(part) for part in _split_objects(body)]
    if not calls or any(c is None for c in calls):
        return text, []
    return None, [c for c in calls if c is not None]


def _split_llama3(text: str, sent: bool) -> Split:
    """A Llama call is the whole output: only its very start can begin one."""
    head = text.lstrip()
    if sent or (head and not head.startswith("{") and not _PYTHON_TAG.startswith(head[:14])):
        return text, False
    return "", head.startswith(("{", _PYTHON_TAG))


def _split_objects(body: str) -> list[str]:
    decoder = json.JSONDecoder()
    parts, at = [], 0
    while at < len(body):
        try:
            _, end = decoder.raw_decode(body, at)
        except ValueError:
            return [body]  # not a sequence of objects: the caller sees it fail to parse
        parts.append(body[at:end])
        at = end
        while at < len(body) and body[at] in " \n\t;":
            at += 1
    return parts


def _named_call(text: str) -> ToolCall | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return _call(value["name"], arguments)


PARSERS: dict[str, Parser] = {
    "hermes": Parser(parse=_parse_hermes, split=_split_hermes),
    "llama3_json": Parser(parse=_parse_llama3, split=_split_llama3),
}


@dataclass
class ToolStream:
    """For an active plan: streams content while the output cannot be a tool call; what
    may be one is held back from content (content deltas never carry a call's text) and
    streamed as tool-call deltas as it is read (`scanner`), then parsed at the end.
    Answered with `functions` (legacy): the call is sent whole at the end."""

    plan: ToolPlan
    pending: str = ""
    holding: bool = False  # a call has begun (or the output is forced): hold the rest
    sent: bool = False
    scanner: CallScanner | None = None

    def __post_init__(self) -> None:
        if not self.plan.legacy:
            self.scanner = CallScanner(named=self.plan.named)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The part of the output so far that can be sent as content now, and the
        tool-call deltas of what is held."""
        self.pending += text
        if self.holding or self.plan.parser is None:  # forced: all of the output is calls
            self.holding = True
            return "", self._scan(text)
        out, self.holding = PARSERS[self.plan.parser].split(self.pending, self.sent)
        self.pending = self.pending[len(out) :]
        self.sent = self.sent or bool(out)
        return out, self._scan(self.pending) if self.holding else []

    def _scan(self, held: str) -> list[dict[str, Any]]:
        return self.scanner.feed(held) if self.scanner is not None else []

    def finish(self) -> tuple[str | None, list[ToolCall]]:
        """What was held back at the end: content still unsent, and the parsed calls."""
        return self.plan.calls(self.pending)


_SCALAR = frozenset("0123456789+-.eEtrufalsnNIinfy")  # numbers, true, false, null, NaN…


def _canonical_escape(escape: str) -> str:
    """A string's escape (`\\u00e9`, `\\/`, a surrogate pair) as json.dumps writes it."""
    try:
        return json.dumps(json.loads(f'"{escape}"'), ensure_ascii=False)[1:-1]
    except ValueError:
        return escape


def _canonical_scalar(token: str) -> str:
    try:
        return json.dumps(json.loads(token))
    except ValueError:
        return token


@dataclass
class _Canonical:
    """A JSON value's text fed a character at a time, written out as `_compact` writes the
    whole value: no spaces, escapes and numbers as json.dumps writes them. So what is
    streamed is a prefix of the arguments the finished call gets."""

    out: list[str] = field(default_factory=list)
    in_string: bool = False
    escape: str = ""
    token: str = ""  # a number or literal being read

    def feed(self, ch: str) -> None:
        if self.in_string:
            self._string_char(ch)
        elif ch in _SCALAR:
            self.token += ch
        else:
            self.flush()
            if ch not in " \t\r\n":
                self.in_string = ch == '"'
                self.out.append(ch)

    def _string_char(self, ch: str) -> None:
        if self.escape:
            self.escape += ch
            if self._escape_done():
                self.out.append(_canonical_escape(self.escape))
                self.escape = ""
        elif ch == "\\":
            self.escape = ch
        else:
            self.in_string = ch != '"'
            self.out.append(ch)

    def _escape_done(self) -> bool:
        """`\\n` is whole at 2 characters, `\\uXXXX` at 6, a surrogate pair at 12."""
        escape = self.escape
        if escape[1] != "u":
            return True
        if len(escape) < 6:
            return False
        high = escape[2:4].lower() in ("d8", "d9", "da", "db")
        return not high or len(escape) == 12 or (len(escape) >= 7 and escape[6] != "\\")

    def flush(self) -> None:
        if self.token:
            self.out.append(_canonical_scalar(self.token))
            self.token = ""


@dataclass
class _Call:
    """A call as its text streams: its name once read, its arguments as they come."""

    id: str = field(default_factory=new_call_id)
    name: str | None = None
    arguments: _Canonical | None = None
    announced: bool = False  # its first delta (id, type, name) was sent
    sent: int = 0  # pieces of its arguments' text sent (a prefix of `arguments.out`)


_ARGUMENT_KEYS = frozenset({"arguments", "parameters"})


@dataclass
class CallScanner:
    """Reads held tool-call text as it grows (Hermes blocks, Llama JSON, a forced list of
    calls: each call a JSON object with `name` and `arguments` or `parameters`; or, for a
    named function, the arguments alone) and says what to stream: a call's first delta
    once its name is read, then its arguments as they are generated, as OpenAI and vLLM
    stream them. Text between the call objects is not read."""

    named: str | None = None  # the whole output is this function's arguments
    calls: list[_Call] = field(default_factory=list)
    _stack: list[str] = field(default_factory=list)  # open brackets of the current call
    _in_string: bool = False
    _escaped: bool = False
    _string: list[str] = field(default_factory=list)  # a key or the name being read
    _key: str | None = None
    _role: str | None = None  # the depth-1 value being read: name, args, skip; None: a key

    def __post_init__(self) -> None:
        if self.named is not None:
            self.calls.append(_Call(name=self.named, arguments=_Canonical()))

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Read `text`, the output's next part; returns the deltas to send for it."""
        for ch in text:
            if self.named is not None:
                arguments = self.calls[0].arguments
                assert arguments is not None
                arguments.feed(ch)
            else:
                self._read(ch)
        return self._deltas()

    def finish(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        """The deltas that complete the stream once the output is parsed into `calls`:
        the arguments not sent yet, or whole calls that were never announced."""
        deltas = []
        for index, call in enumerate(calls):
            streamed = self.calls[index] if index < len(self.calls) else None
            if streamed is None or not streamed.announced:
                deltas += _whole_call(index, call)
                continue
            sent = "".join(streamed.arguments.out[: streamed.sent]) if streamed.arguments else ""
            rest = call.function.arguments
            if rest.startswith(sent) and len(rest) > len(sent):
                deltas.append({"index": index, "function": {"arguments": rest[len(sent) :]}})
        return deltas

    @property
    def announced(self) -> bool:
        return any(call.announced for call in self.calls)

    def _deltas(self) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(self.calls):
            if call.name is None:
                continue
            if not call.announced:
                call.announced = True
                named = {"name": call.name, "arguments": ""}
                deltas.append(
                    {"index": index, "id": call.id, "type": "function", "function": named}
                )
            pieces = call.arguments.out if call.arguments is not None else []
            new = "".join(pieces[call.sent :])  # only what came since: no quadratic joins
            call.sent = len(pieces)
            if new:
                deltas.append({"index": index, "function": {"arguments": new}})
        return deltas

    def _read(self, ch: str) -> None:
        if not self._stack:  # between calls: a `{` begins one
            if ch == "{":
                self._stack.append(ch)
                self.calls.append(_Call())
                self._role, self._key = None, None
            return
        args = self.calls[-1].arguments if self._role == "args" else None
        if self._in_string:
            self._string_char(ch, args)
        elif ch == '"':
            self._in_string, self._string = True, []
            if args is not None and len(self._stack) == 1:  # arguments as a JSON string:
                self.calls[-1].arguments, self._role = None, "skip"  # sent whole at the end
            elif args is not None:
                args.feed(ch)
        elif ch in "{[":
            self._stack.append(ch)
            if args is not None:
                args.feed(ch)
        elif ch in "}]":
            self._close(ch, args)
        elif len(self._stack) == 1 and ch in ":,":
            self._punctuation(ch, args)
        elif args is not None:
            args.feed(ch)

    def _string_char(self, ch: str, args: _Canonical | None) -> None:
        if args is not None:
            args.feed(ch)
        if self._escaped:
            self._escaped = False
        elif ch == "\\":
            self._escaped = True
        elif ch == '"':
            self._in_string = False
            if len(self._stack) == 1:
                self._string_done()
            return
        self._string.append(ch)

    def _string_done(self) -> None:
        """A string at the call object's own level ended: a key, the name, or a value."""
        try:
            value = json.loads('"' + "".join(self._string) + '"')
        except ValueError:
            value = None
        if self._role is None:
            self._key = value
        elif self._role == "name" and isinstance(value, str):
            self.calls[-1].name = value
            self._role = "skip"
        elif self._role == "args":
            self._end_args()

    def _punctuation(self, ch: str, args: _Canonical | None) -> None:
        if ch == ":" and self._role is None:
            self._role = "skip"
            if self._key == "name":
                self._role = "name"
            elif self._key in _ARGUMENT_KEYS:
                self._role = "args"
                self.calls[-1].arguments = _Canonical()
        elif ch == ",":
            if args is not None:
                self._end_args()
            self._role, self._key = None, None

    def _close(self, ch: str, args: _Canonical | None) -> None:
        if len(self._stack) == 1:  # the call object ends
            if args is not None:
                self._end_args()
            self._stack.pop()
            return
        self._stack.pop()
        if args is not None:
            args.feed(ch)
            if len(self._stack) == 1:  # the arguments' object or list ended
                self._end_args()

    def _end_args(self) -> None:
        arguments = self.calls[-1].arguments
        if arguments is not None:
            arguments.flush()
        self._role = "skip"


def _whole_call(index: int, call: ToolCall) -> list[dict[str, Any]]:
    """A call sent at once: its first delta, then all of its arguments."""
    named = {"name": call.function.name, "arguments": ""}
    return [
        {"index": index, "id": call.id, "type": call.type, "function": named},
        {"index": index, "function": {"arguments": call.function.arguments}},
    ]
