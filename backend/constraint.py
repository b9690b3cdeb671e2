"""What a request's output must match (structured outputs): pure data that travels with
SamplingParams, compiled into a token mask by backend/grammar.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from backend.errors import ConstraintError

ConstraintKind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]
CONSTRAINT_KINDS: tuple[str, ...] = get_args(ConstraintKind)


@dataclass(frozen=True)
class Constraint:
    """`spec` by kind: json_schema, the schema as JSON text; regex, a pattern the whole
    output matches (Rust regex syntax); choice, a JSON list of the strings allowed;
    grammar, a Lark or GBNF (llama.cpp EBNF) grammar; json_object, unused (any object)."""

    kind: ConstraintKind
    spec: str = ""
    field: str = "response_format"  # the request field it came from, named when refused

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ConstraintError(
                f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}, got {self.kind!r}"
            )
        if not isinstance(self.spec, str):
            raise ConstraintError(f"constraint spec must be a string, got {self.spec!r}")
