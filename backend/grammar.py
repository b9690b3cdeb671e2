"""Constrained decoding: a request's Constraint, compiled with llguidance against the
model's tokenizer, becomes a matcher that gives each step's allowed tokens as a bitmask
(applied to the logits by layers/sampler.py) and advances with every sampled token.

Compiling happens when a request is submitted, so a bad constraint is refused before it
is queued (ConstraintError); compiled grammars are kept by (kind, spec)."""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from backend.constraint import Constraint
from backend.errors import ConstraintError, RequestFailedError

if TYPE_CHECKING:  # llguidance is imported where a grammar is compiled or masked: a
    # process that never constrains a request (the GPU image) need not have it.
    import llguidance
    from llguidance._lib import JsonCompileOptions

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first
MAX_ERROR_CHARS = 500
# Compact JSON (no whitespace between tokens): a model cannot wander into endless blanks.
_JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}
_ANY_OBJECT = '{"type": "object"}'


class GrammarMatcher:
    """One completion's place in its grammar."""

    __slots__ = ("_matcher", "mask_words")

    def __init__(self, matcher: llguidance.LLMatcher, mask_words: int) -> None:
        self._matcher = matcher
        self.mask_words = mask_words  # int32 words in its bitmask: ceil(vocab / 32)

    def advance(self, token: int) -> bool:
        """Consume the sampled token; True once the grammar is complete (nothing but EOS
        may follow), so the request stops."""
        if not self._matcher.consume_token(token):
            raise RequestFailedError(f"token {token} is outside the request's grammar")
        return self._matcher.is_stopped()


def fill_bitmasks(matchers: Sequence[GrammarMatcher]) -> np.ndarray:
    """[len(matchers), mask_words] int32: bit j of word w allows token 32 w + j."""
    words = matchers[0].mask_words
    masks = np.empty((len(matchers), words), dtype=np.int32)
    if len(matchers) == 1:  # no hand-off to the pool for the common case
        matchers[0]._matcher.unsafe_compute_mask_ptr(masks.ctypes.data, masks.nbytes)
    else:
        rows = [(m._matcher, i) for i, m in enumerate(matchers)]
        _executor().unsafe_compute_mask_ptr(rows, masks.ctypes.data, words * 4, len(matchers))
    return masks


@functools.cache
def _executor() -> llguidance.LLExecutor:
    """llguidance's thread pool, for the masks of several constrained rows at once."""
    import llguidance

    return llguidance.LLExecutor()


class GrammarCompiler:
    """Compiles constraints against one tokenizer (its vocabulary read from
    tokenizer.json on first use). Thread-safe: requests are submitted from any thread."""

    def __init__(
        self,
        tokenizer_json: Path,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None

    def matcher(self, constraint: Constraint) -> GrammarMatcher:
        """A fresh matcher at the grammar's start; raises ConstraintError."""
        compiled = self._compiled(constraint)
        return GrammarMatcher(compiled.deep_copy(), -(-self._vocab_size // 32))

    def cached(self) -> list[tuple[str, str]]:
        """The (kind, spec) of each compiled grammar kept, least recently used first."""
        with self._lock:
            return list(self._cache)

    def _compiled(self, constraint: Constraint) -> llguidance.LLMatcher:
        key = (constraint.kind, constraint.spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            tokenizer = self._llg_tokenizer()
        import llguidance

        compiled = llguidance.LLMatcher(tokenizer, _grammar(constraint), log_level=0)
        if compiled.is_error():
            raise ConstraintError(_message(constraint, compiled.get_error()), constraint.field)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            import llguidance

            self._tokenizer = llguidance.LLTokenizer(
                self._tokenizer_json.read_text(encoding="utf-8"),
                n_vocab=self._vocab_size,
                eos_token=self._eos,
            )
        return self._tokenizer


def _grammar(constraint: Constraint) -> str:
    """llguidance's grammar text for a constraint; raises ConstraintError for a spec that
    is not even well formed (a grammar's own errors show when it is compiled)."""
    import llguidance

    kind, spec = constraint.kind, constraint.spec
    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(_ANY_OBJECT, _JSON_DEFAULTS)
        if kind == "json_schema":
            if not isinstance(_json(constraint), dict):
                raise ConstraintError(
                    _message(constraint, "the schema must be a JSON object"), constraint.field
                )
            return llguidance.LLMatcher.grammar_from_json_schema(spec, _JSON_DEFAULTS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            choices = _json(constraint)
            if not (
                isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)
            ):
                raise ConstraintError(
                    _message(constraint, "must be a non-empty list of strings"), constraint.field
                )
            return llguidance.grammar_from("choice", spec)
        return llguidance.grammar_from("grammar", spec)
    except ConstraintError:
        raise
    except ValueError as exc:  # llguidance's own complaints about the text
        raise ConstraintError(_message(constraint, str(exc)), constraint.field) from exc


def _json(constraint: Constraint) -> object:
    try:
        return json.loads(constraint.spec)
    except (ValueError, RecursionError) as exc:
        raise ConstraintError(
            _message(constraint, f"not valid JSON: {exc}"), constraint.field
        ) from exc


def _message(constraint: Constraint, problem: str) -> str:
    problem = " ".join(problem.split())  # one line: llguidance draws carets under the text
    if len(problem) > MAX_ERROR_CHARS:
        problem = problem[:MAX_ERROR_CHARS] + "..."
    return f"{constraint.kind} constraint: {problem}"
