"""What a constraint may be, checked in plain Python before any of it reaches llguidance's
native code: a grammar too large or too deep for the native compiler (a long chain of
`$ref`s or of grammar rules overflows its stack and kills the process; a large one holds
a compile thread for seconds) is refused with a ConstraintError naming the field.

The limits sit far below what was measured to break or stall the native compiler on an
8 MiB stack (a compile thread has a far larger one, backend/grammar.py): a chain of 950
`$ref`s or 2,700 Lark rules crashed, 10,000 optional properties took 6 s, 100,000 choices
6 s, a 60 KB regex of `a?` 9 s; GBNF is converted to Lark in Python, 0.6 s per 1,000
rules."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from backend.constraint import Constraint
from backend.errors import ConstraintError


@dataclass(frozen=True)
class GrammarLimits:
    max_chars: int = 64 * 1024  # a spec's characters, whatever its kind
    max_regex_chars: int = 8 * 1024  # one regex (guided_regex, a pattern, a Lark /.../)
    max_schema_depth: int = 128  # JSON nesting, each $ref counted as nesting into its target
    max_schema_properties: int = 1000  # the properties of every object in a schema
    max_optional_properties: int = 400  # of one object (past 500 its matcher fails mid-way)
    max_choices: int = 1000
    max_grammar_rules: int = 256  # rules and terminals of a Lark or GBNF grammar


DEFAULT_LIMITS = GrammarLimits()

# A Lark rule or terminal starts a line: `name:`, `?name:`, `name.2:`; GBNF's are `name ::=`.
_LARK_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(?:\.-?\d+)?[ \t]*:(?!:)", re.M)
_GBNF_RULE = re.compile(r"::=")
_LARK_REGEX = re.compile(r"/(?:[^/\\\n]|\\.)+/")
_LARK_JSON = re.compile(r"%json\s*")
_DECODER = json.JSONDecoder()


def check_limits(constraint: Constraint, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
    """Raise ConstraintError (param: the constraint's field) when the constraint is past a
    limit; never runs native code, and never recurses (a deep spec cannot overflow it)."""
    kind, spec = constraint.kind, constraint.spec
    check_length(constraint.field, len(spec), limits)
    if kind == "regex":
        _check_regex(constraint, spec, limits)
    elif kind == "grammar":
        _check_grammar(constraint, spec, limits)
    elif kind == "choice":
        if spec.count('",') >= limits.max_choices:  # else too few to count them exactly
            choices = _parsed(constraint)
            if isinstance(choices, list):
                check_choice_count(constraint.field, len(choices), limits)
    elif kind == "json_schema":
        _check_schema(constraint, _parsed(constraint), limits)


def check_length(field: str, chars: int, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
    """The size limit alone, for a caller that knows a spec's size before building its
    text (the gateway, before it transforms a schema)."""
    if chars > limits.max_chars:
        problem = f"is {chars} characters long; at most {limits.max_chars}"
        raise ConstraintError(f"{field} {problem}", field, problem)


def check_choice_count(field: str, count: int, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
    if count > limits.max_choices:
        problem = f"has {count} choices; at most {limits.max_choices}"
        raise ConstraintError(f"{field} {problem}", field, problem)


def _check_regex(constraint: Constraint, regex: str, limits: GrammarLimits) -> None:
    if len(regex) > limits.max_regex_chars:
        _refuse(
            constraint,
            f"has a regular expression of {len(regex)} characters; "
            f"at most {limits.max_regex_chars}",
        )


def _check_grammar(constraint: Constraint, grammar: str, limits: GrammarLimits) -> None:
    rules = len(_GBNF_RULE.findall(grammar)) + len(_LARK_RULE.findall(grammar))
    if rules > limits.max_grammar_rules:
        _refuse(constraint, f"has {rules} rules; at most {limits.max_grammar_rules}")
    for regex in _LARK_REGEX.findall(grammar):
        _check_regex(constraint, regex, limits)
    for embedded in _LARK_JSON.finditer(grammar):  # `%json {...}`: a schema inside
        try:
            schema, _ = _DECODER.raw_decode(grammar, embedded.end())
        except (ValueError, RecursionError):
            continue  # not JSON: the compiler refuses it
        _check_schema(constraint, schema, limits)


def _check_schema(constraint: Constraint, schema: Any, limits: GrammarLimits) -> None:
    properties = 0
    for node in _nodes(schema):
        if isinstance(node, dict):
            found = node.get("properties")
            if isinstance(found, dict):
                properties += len(found)
                _check_optional(constraint, found, node.get("required"), limits)
            pattern = node.get("pattern")
            if isinstance(pattern, str):
                _check_regex(constraint, pattern, limits)
    if properties > limits.max_schema_properties:
        _refuse(
            constraint,
            f"has {properties} properties; at most {limits.max_schema_properties} in all",
        )
    depth = _depth(schema) if isinstance(schema, dict | list) else 0
    if depth > limits.max_schema_depth:
        _refuse(
            constraint,
            f"is nested more than {limits.max_schema_depth} levels deep "
            "(counting each $ref as a level into what it points to)",
        )


def _check_optional(
    constraint: Constraint, properties: dict[str, Any], required: Any, limits: GrammarLimits
) -> None:
    """Each optional property multiplies the parser's work at every step of its object:
    llguidance refuses a step past 2,000 items, about 500 optional properties."""
    listed = required if isinstance(required, list) else []
    named = {name for name in listed if isinstance(name, str)} & properties.keys()
    optional = len(properties) - len(named)
    if optional > limits.max_optional_properties:
        _refuse(
            constraint,
            f"has an object with {optional} optional properties; "
            f"at most {limits.max_optional_properties} (list the others in `required`)",
        )


def _nodes(document: Any) -> list[Any]:
    """Every object and array in a JSON document, without recursion."""
    found, stack = [], [document]
    while stack:
        node = stack.pop()
        if isinstance(node, dict | list):
            found.append(node)
            stack.extend(node.values() if isinstance(node, dict) else node)
    return found


def _depth(schema: Any) -> int:
    """The height of the schema's tree of objects and arrays, where a `$ref` nests into
    its target; a ref back into the path being walked (a recursive schema) adds nothing,
    as the compiler refers to it by name. Each node is measured once (iterative post-order
    walk), so a document of any shape costs time linear in its size."""
    height: dict[int, int] = {}  # node id -> its height, once measured
    on_path: set[int] = set()  # nodes entered and not yet measured: the walk's path
    stack: list[tuple[Any, bool]] = [(schema, False)]
    while stack:
        node, entered = stack.pop()
        if entered:
            on_path.discard(id(node))
            below = (height.get(id(child), 0) for child in _children(schema, node))
            height[id(node)] = 1 + max(below, default=0)
        elif id(node) not in height and id(node) not in on_path:
            on_path.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in _children(schema, node))
    return height[id(schema)]


def _children(schema: Any, node: Any) -> list[Any]:
    """A node's objects and arrays, and the target of its `$ref`."""
    found = list(node.values() if isinstance(node, dict) else node)
    if isinstance(node, dict) and isinstance(node.get("$ref"), str):
        found.append(_resolve(schema, node["$ref"]))
    return [child for child in found if isinstance(child, dict | list)]


def _resolve(schema: Any, ref: str) -> Any:
    """The node a local `$ref` ("#/$defs/a") points to; None for any other."""
    if not ref.startswith("#"):
        return None
    node = schema
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _parsed(constraint: Constraint) -> Any:
    try:
        return json.loads(constraint.spec)
    except (ValueError, RecursionError):
        _refuse(constraint, "is not valid JSON")


def _refuse(constraint: Constraint, problem: str) -> Any:
    raise ConstraintError(f"{constraint.field} {problem}", constraint.field, problem)
