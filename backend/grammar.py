"""Constrained decoding: a request's Constraint, compiled with llguidance against the
model's tokenizer, becomes a matcher that gives each step's allowed tokens as a bitmask
(applied to the logits by layers/sampler.py) and advances with every sampled token.

Compiling happens when a request is submitted, so a bad constraint is refused before it
is queued (ConstraintError). A constraint is first checked in Python against
grammar_limits.py, then compiled on a compile thread of its own (CompilePool): one with a
large stack, so a grammar deep enough to overflow an ordinary thread's cannot crash the
process; off the event loop and the step thread, so nothing else waits on it; one
compile per tenant at a time, each refused past a time limit. Compiled grammars are kept
by tenant (the same salt the prefix cache uses), kind and spec: one tenant's compile
times reveal nothing of another's."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from backend.constraint import Constraint
from backend.errors import ConstraintError, GrammarTooComplexError, RequestFailedError
from backend.grammar_limits import DEFAULT_LIMITS, GrammarLimits, check_limits

if TYPE_CHECKING:  # llguidance is imported where a grammar is compiled or masked: a
    # process that never constrains a request (the GPU image) need not have it.
    import llguidance
    from llguidance._lib import JsonCompileOptions

log = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first
# A compile thread's stack: 32x an ordinary thread's 8 MiB (address space, not memory,
# until used), far past what grammars within the limits need (the native compiler crashed
# on 8 MiB at 950 chained $refs, 2,700 chained rules; limits.py allows far fewer).
COMPILE_STACK_BYTES = 256 * 2**20
COMPILE_TIME_LIMIT_S = 5.0  # from the start of a compile; past it the grammar is refused
MAX_COMPILE_THREADS = 8  # tenants compiling at once (one compile per tenant at a time)
# Compact JSON (no whitespace between tokens): a model cannot wander into endless blanks.
_JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}
_ANY_OBJECT = '{"type": "object"}'
# llguidance's words when a step needs more parser work than its limits allow.
_TOO_COMPLEX = re.compile(r"max is \d+|too complex", re.IGNORECASE)
GrammarKey = tuple[str, str, str]  # (tenant, kind, spec); tenant "": a cache all share
_V = TypeVar("_V")


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
            if _TOO_COMPLEX.search(self._matcher.get_error()):
                raise GrammarTooComplexError("the grammar grew past the parser's limits")
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


@functools.cache
def _parser_limits() -> llguidance.LLParserLimits:
    """llguidance's own limits, with errors that never quote the grammar's internals."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


@dataclass(eq=False)
class _Job:
    """One compile: `started` gets its start time (time.monotonic()), `done` its result."""

    tenant: str
    key: GrammarKey
    work: Callable[[], llguidance.LLMatcher]
    started: Future[float] = field(default_factory=Future)
    done: Future[llguidance.LLMatcher] = field(default_factory=Future)


class CompilePool:
    """Threads with a large stack (COMPILE_STACK_BYTES) that compile grammars: at most one
    compile per tenant at a time (a tenant's next waits for its last: the cost of its
    grammars falls on it), tenants taking turns, one compile per grammar however many
    requests want it. Threads start as needed, up to `max_threads`."""

    def __init__(
        self, max_threads: int = MAX_COMPILE_THREADS, stack_bytes: int = COMPILE_STACK_BYTES
    ) -> None:
        self._max_threads = max_threads
        self._stack_bytes = stack_bytes
        self._cond = threading.Condition()
        self._queues: OrderedDict[str, deque[_Job]] = OrderedDict()  # tenants, next first
        self._busy: set[str] = set()  # tenants with a compile running
        self._jobs: dict[GrammarKey, _Job] = {}  # queued or running, by key
        self._threads = 0
        self._idle = 0

    def submit(
        self, tenant: str, key: GrammarKey, work: Callable[[], llguidance.LLMatcher]
    ) -> _Job:
        with self._cond:
            job = self._jobs.get(key)
            if job is None:
                job = self._jobs[key] = _Job(tenant, key, work)
                self._queues.setdefault(tenant, deque()).append(job)
                if self._idle == 0 and self._threads < self._max_threads:
                    self._start_thread()
                self._cond.notify_all()
            return job

    def _start_thread(self) -> None:
        thread = threading.Thread(target=self._run, name="tollgate-grammar", daemon=True)
        previous = threading.stack_size(self._stack_bytes)  # for threads started now
        try:
            thread.start()
        except RuntimeError:  # no room for another thread: the running ones serve the queue
            if self._threads == 0:
                raise
            log.warning("could not start another grammar compile thread", exc_info=True)
            return
        finally:
            threading.stack_size(previous)
        self._threads += 1

    def _next(self) -> _Job | None:
        """The first queued job of a tenant with none running (the lock held)."""
        for tenant, queue in self._queues.items():
            if tenant not in self._busy:
                job = queue.popleft()
                if queue:
                    self._queues.move_to_end(tenant)  # the others' turn first
                else:
                    del self._queues[tenant]
                self._busy.add(tenant)
                return job
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                self._idle += 1
                while (job := self._next()) is None:
                    self._cond.wait()
                self._idle -= 1
            job.started.set_result(time.monotonic())
            try:
                job.done.set_result(job.work())
            except BaseException as exc:  # handed to whoever waits; the thread goes on
                job.done.set_exception(exc)
            finally:
                with self._cond:
                    self._busy.discard(job.tenant)
                    del self._jobs[job.key]
                    self._cond.notify_all()


class GrammarCompiler:
    """Compiles constraints against one tokenizer (its vocabulary read from
    tokenizer.json on first use), on a CompilePool. Thread-safe: requests are submitted
    from any thread. `share_cache`: every tenant's grammars in one cache (as with a shared
    prefix cache); otherwise each tenant has its own."""

    def __init__(
        self,
        tokenizer_json: Path,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
        *,
        share_cache: bool = False,
        limits: GrammarLimits = DEFAULT_LIMITS,
        time_limit_s: float = COMPILE_TIME_LIMIT_S,
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._cache_size = cache_size
        self._share_cache = share_cache
        self.limits = limits
        self.time_limit_s = time_limit_s
        self._cache: OrderedDict[GrammarKey, llguidance.LLMatcher] = OrderedDict()
        self._refused: OrderedDict[GrammarKey, str] = OrderedDict()  # key -> why
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._pool = CompilePool()

    def matcher(self, constraint: Constraint, tenant: str | None = None) -> GrammarMatcher:
        """A fresh matcher at the grammar's start, compiled (on the pool, waited for) if
        not cached; raises ConstraintError."""
        key = self._key(constraint, tenant)
        compiled = self._known(constraint, key)
        if compiled is None:
            job = self._submit(constraint, tenant, key)
            started = job.started.result()
            try:
                compiled = job.done.result(timeout=self._time_left(started))
            except TimeoutError:
                raise self._too_slow(constraint) from None
        return GrammarMatcher(compiled.deep_copy(), -(-self._vocab_size // 32))

    async def prepare(self, constraint: Constraint, tenant: str | None = None) -> None:
        """Compile the constraint into the cache without blocking the event loop (the
        next matcher() for it is a cache hit); raises ConstraintError."""
        key = self._key(constraint, tenant)
        if self._known(constraint, key) is not None:
            return
        job = self._submit(constraint, tenant, key)
        # shield: a caller that goes away must not cancel the compile others may wait for
        started = await asyncio.shield(asyncio.wrap_future(job.started))
        done = asyncio.shield(asyncio.wrap_future(job.done))
        try:
            await asyncio.wait_for(done, self._time_left(started))
        except TimeoutError:
            raise self._too_slow(constraint) from None

    def cached(self) -> list[GrammarKey]:
        """The (tenant, kind, spec) of each compiled grammar kept, least recently used
        first (tenant "": shared)."""
        with self._lock:
            return list(self._cache)

    def _key(self, constraint: Constraint, tenant: str | None) -> GrammarKey:
        salt = "" if self._share_cache else (tenant or "")
        return (salt, constraint.kind, constraint.spec)

    def _known(self, constraint: Constraint, key: GrammarKey) -> llguidance.LLMatcher | None:
        """The compiled grammar if cached; ConstraintError if it was refused before."""
        with self._lock:
            problem = self._refused.get(key)
            if problem is not None:
                raise _refusal(constraint, problem)
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def _submit(self, constraint: Constraint, tenant: str | None, key: GrammarKey) -> _Job:
        return self._pool.submit(tenant or "", key, lambda: self._compile(constraint, key))

    def _time_left(self, started: float) -> float:
        return max(0.0, started + self.time_limit_s - time.monotonic())

    def _too_slow(self, constraint: Constraint) -> ConstraintError:
        return _refusal(constraint, f"takes longer than {self.time_limit_s:g} s to compile")

    def _compile(self, constraint: Constraint, key: GrammarKey) -> llguidance.LLMatcher:
        """On a pool thread: checked against the limits, then compiled; a refusal or a
        compile past the time limit is remembered, so the same grammar is refused at once."""
        import llguidance

        started = time.monotonic()
        try:
            check_limits(constraint, self.limits)
            with self._lock:
                tokenizer = self._llg_tokenizer()
            grammar = _grammar(constraint)
            compiled = llguidance.LLMatcher(
                tokenizer, grammar, log_level=0, limits=_parser_limits()
            )
            if compiled.is_error():
                raise _refusal(constraint, _native_problem(constraint, compiled.get_error()))
            if time.monotonic() - started > self.time_limit_s:
                raise self._too_slow(constraint)
        except ConstraintError as exc:
            self._remember(self._refused, key, exc.problem)
            raise
        self._remember(self._cache, key, compiled)
        return compiled

    def _remember(self, kept: OrderedDict[GrammarKey, _V], key: GrammarKey, value: _V) -> None:
        with self._lock:
            kept[key] = value
            while len(kept) > self._cache_size:
                kept.popitem(last=False)

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
                raise _refusal(constraint, "must be a JSON object (the schema)")
            return llguidance.LLMatcher.grammar_from_json_schema(spec, _JSON_DEFAULTS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            choices = _json(constraint)
            if not (
                isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)
            ):
                raise _refusal(constraint, "must be a non-empty list of strings")
            return llguidance.grammar_from("choice", spec)
        return llguidance.grammar_from("grammar", spec)
    except ConstraintError:
        raise
    except ValueError as exc:  # llguidance's complaints about the text, told in our words
        raise _refusal(constraint, _native_problem(constraint, str(exc))) from None


def _json(constraint: Constraint) -> object:
    try:
        return json.loads(constraint.spec)
    except (ValueError, RecursionError):
        raise _refusal(constraint, "is not valid JSON") from None


def _refusal(constraint: Constraint, problem: str) -> ConstraintError:
    return ConstraintError(f"{constraint.field} {problem}", constraint.field, problem)


# -- llguidance's error messages, told in our own words ----------------------------------
# Only what is recognised is told, and only names that look like names (keywords, rules,
# formats, JSON pointers): a client never sees the native library's text or a panic.

_NAME = re.compile(r"[A-Za-z0-9_$#/~.:-]{1,80}")
_POSITION = re.compile(r"^(?:at )?(\d+)\((\d+)\): ")
_SCHEMA_PROBLEMS: list[tuple[re.Pattern[str], str]] = [
    (
        re.compile(r"Unimplemented keys: \[(.*?)\]"),
        "uses keywords this server does not support: {}",
    ),
    (re.compile(r"Unknown format: (\S+)"), "uses a format this server does not support: {}"),
    (re.compile(r"Pointer '([^']*)' does not exist"), "has a $ref that points to nothing: {}"),
    (re.compile(r"Resource '([^']*)' is not present"), "has a $ref outside the schema: {}"),
    (re.compile(r"Invalid type: (\S+)"), "names an unknown type: {}"),
    (re.compile(r"Unsatisfiable schema"), "can never be satisfied (its constraints contradict)"),
    (re.compile(r"regex parse error"), "has a pattern that is not a valid regular expression"),
    (re.compile(r"recursion limit"), "is nested too deeply"),
    (re.compile(r"'([A-Za-z$]\w*)'"), "has a keyword with a value it cannot take: {}"),
]
_GRAMMAR_PROBLEMS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r'unknown name: "([^"]*)"'), "refers to an undefined rule or terminal: {}"),
    (re.compile(r"Rule '([^']*)' not found"), "refers to an undefined rule: {}"),
    (re.compile(r'duplicate rule: "([^"]*)"'), "defines a rule twice: {}"),
    (re.compile(r"invalid regex"), "has a regular expression that is not valid"),
    (re.compile(r"too deeply nested"), "is nested too deeply"),
    (re.compile(r"failed to compile JSON schema"), "has a %json schema that cannot be compiled"),
]


def _native_problem(constraint: Constraint, native: str) -> str:
    """What is wrong with the constraint, from llguidance's message, in our words."""
    if constraint.kind == "regex":
        return "is not a valid regular expression"
    if constraint.kind in ("json_schema", "json_object"):
        return _told(native, _SCHEMA_PROBLEMS, "is a JSON schema that cannot be compiled")
    if constraint.kind == "choice":
        return "cannot be compiled"
    problem = _told(native, _GRAMMAR_PROBLEMS, "is not a valid Lark or GBNF grammar")
    position = _POSITION.match(native)
    if position is not None:
        problem += f" (line {position[1]}, column {position[2]})"
    return problem


def _told(native: str, problems: list[tuple[re.Pattern[str], str]], otherwise: str) -> str:
    for pattern, told in problems:
        found = pattern.search(native)
        if found is None:
            continue
        if "{}" not in told:
            return told
        names = [n.strip(' "') for n in (found[1] or "").split(",")]
        if names and all(_NAME.fullmatch(n) for n in names):
            return told.format(", ".join(f'"{n}"' for n in names))
        return told.replace(": {}", "")
    return otherwise
