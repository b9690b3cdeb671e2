"""Grammars that once crashed or stalled the gateway (issue 32): generators shared by the
poison suite (tests/e2e/test_poison_grammar.py), the grammar unit tests and the fuzz
suite. Each builds its text without recursion, whatever its depth."""

from __future__ import annotations

from typing import Any


def ref_chain(n: int) -> dict[str, Any]:
    """The issue's schema: n objects, each requiring a property that $refs the next."""
    defs: dict[str, Any] = {
        f"d{i}": {
            "type": "object",
            "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}},
            "required": ["a"],
        }
        for i in range(n)
    }
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def compact_ref_chain(n: int) -> dict[str, Any]:
    """A chain as deep in fewer bytes (1,000 links: 52 KB, under the size limit)."""
    defs: dict[str, Any] = {
        f"d{i}": {"properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)
    }
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def lark_chain(n: int) -> str:
    rules = [f'r{i}: "x{i}" r{i + 1} | "y"' for i in range(n)]
    return "\n".join(["start: r0", *rules, f'r{n}: "z"'])


def compact_lark_chain(n: int) -> str:
    """A rule chain in fewer bytes (4,000 rules: 50 KB, under the size limit)."""
    return "\n".join(["start: r0", *(f"r{i}: r{i + 1}" for i in range(n)), f'r{n}: "z"'])


def gbnf_chain(n: int) -> str:
    rules = [f'r{i} ::= "x{i}" r{i + 1} | "y"' for i in range(n)]
    return "\n".join(["root ::= r0", *rules, f'r{n} ::= "z"'])


def optional_properties(n: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


def objects_of_optional_properties(objects: int, each: int) -> dict[str, Any]:
    inner = optional_properties(each)
    return {"type": "object", "properties": {f"o{j}": inner for j in range(objects)}}
