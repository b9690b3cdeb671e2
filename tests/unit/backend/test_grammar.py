"""backend/grammar.py without a model: what it needs imported, and what it refuses before
a grammar reaches llguidance's native code."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from typing import Any

import pytest

from backend.builtin import BUILTIN_MODEL_DIR
from backend.constraint import Constraint
from backend.errors import ConstraintError
from backend.grammar import CompilePool, GrammarCompiler
from backend.grammar_limits import check_limits
from backend.tokenizer import Tokenizer
from tests.support.hostile_grammars import (
    compact_lark_chain,
    compact_ref_chain,
    gbnf_chain,
    lark_chain,
    optional_properties,
    ref_chain,
)

# A meta-path finder that makes `import llguidance` fail, as on an image without it.
_NO_LLGUIDANCE = """
import sys
class NoLlguidance:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "llguidance":
            raise ImportError("llguidance is not installed here")
sys.meta_path.insert(0, NoLlguidance())
import backend.engine.engine, backend.engine.model_runner, backend.grammar
assert "llguidance" not in sys.modules
"""


def test_the_engine_imports_without_llguidance() -> None:
    """The GPU image has no llguidance; only compiling or masking a grammar needs it."""
    done = subprocess.run(
        [sys.executable, "-c", _NO_LLGUIDANCE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]


# -- limits: refused in Python before any native code ----------------------------------


def _grammar_compiler(**options: Any) -> GrammarCompiler:
    tokenizer = Tokenizer(BUILTIN_MODEL_DIR)
    return GrammarCompiler(
        BUILTIN_MODEL_DIR / "tokenizer.json", 4096, tokenizer.eos_token_ids, **options
    )


# Each crashed a process on an 8 MiB stack (llguidance 1.9.1); the compact ones are
# under the size limit, so the depth and rule limits are what refuse them.
@pytest.mark.parametrize(
    ("constraint", "says"),
    [
        (Constraint("json_schema", json.dumps(ref_chain(1000))), "characters long"),
        (Constraint("json_schema", json.dumps(compact_ref_chain(1000))), "levels deep"),
        (Constraint("grammar", lark_chain(4000)), "characters long"),
        (Constraint("grammar", compact_lark_chain(4000)), "4002 rules"),
        (Constraint("grammar", gbnf_chain(5000)), "characters long"),
        (Constraint("grammar", gbnf_chain(1000)), "1002 rules"),
        (Constraint("choice", json.dumps([str(i) for i in range(5000)])), "5000 choices"),
        (Constraint("json_schema", json.dumps(optional_properties(500))), "500 optional"),
        (Constraint("regex", "a?" * 5000), "regular expression of 10000"),
        (Constraint("grammar", "start: /" + "a?" * 5000 + "/"), "regular expression"),
        (Constraint("grammar", "start: %json " + json.dumps(compact_ref_chain(1000))), "deep"),
    ],
)
def test_grammars_past_the_limits_are_refused_before_native_code(
    constraint: Constraint, says: str
) -> None:
    with pytest.raises(ConstraintError, match=says) as refused:
        check_limits(replace(constraint, field="guided_x"))
    assert refused.value.param == "guided_x"
    assert refused.value.args[0].startswith("guided_x ")


def test_recursive_schemas_are_within_the_depth_limit() -> None:
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            }
        },
        "$ref": "#/$defs/node",
    }
    for schema in (tree, {"$ref": "#"}, ref_chain(30)):
        check_limits(Constraint("json_schema", json.dumps(schema)))


# Compiles the compact 1,000-link chain, the limits lifted: on a compile thread it
# compiles; the same compile on a thread of an ordinary 8 MiB stack is the control that
# it would crash.
_DEEP_COMPILE = """
import json, sys, threading
from backend.builtin import BUILTIN_MODEL_DIR
from backend.constraint import Constraint
from backend.grammar import GrammarCompiler, _grammar
from backend.grammar_limits import GrammarLimits
from tests.support.hostile_grammars import compact_ref_chain
import llguidance
constraint = Constraint("json_schema", json.dumps(compact_ref_chain(1000)))
lifted = GrammarLimits(max_schema_depth=10**6)
compiler = GrammarCompiler(BUILTIN_MODEL_DIR / "tokenizer.json", 4096, [0], limits=lifted)
if sys.argv[1] == "pool":
    compiler.matcher(constraint)
else:  # a thread of an explicit 8 MiB stack, whatever `ulimit -s` says
    tokenizer, grammar = compiler._llg_tokenizer(), _grammar(constraint)
    threading.stack_size(8 * 2**20)
    compile = lambda: llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    thread = threading.Thread(target=compile)
    thread.start()
    thread.join()
print("compiled")
"""


def test_a_grammar_too_deep_for_an_ordinary_stack_compiles_on_the_pool() -> None:
    def run(where: str) -> subprocess.CompletedProcess[str]:
        args = [sys.executable, "-c", _DEEP_COMPILE, where]
        return subprocess.run(args, capture_output=True, text=True, timeout=120)

    pool = run("pool")
    assert pool.returncode == 0 and "compiled" in pool.stdout, pool.stderr[-2000:]
    control = run("8 MiB thread")
    assert control.returncode == -signal.SIGSEGV, (control.returncode, control.stderr[-500:])


# -- the compile pool: one compile per tenant at a time, tenants take turns ------------


def _result(job: Any) -> object:
    """What a pool job's work returned (these return names, not compiled grammars)."""
    done: object = job.done.result(timeout=30)
    return done


def test_a_tenants_compiles_run_one_at_a_time_while_other_tenants_go_first() -> None:
    pool = CompilePool(max_threads=4)
    release = threading.Event()
    order: list[str] = []

    def work(name: str, wait: bool = False) -> Any:
        def run() -> str:
            order.append(name)
            if wait:
                assert release.wait(30)
            return name

        return run

    first = pool.submit("a", ("a", "regex", "1"), work("a1", wait=True))
    first.started.result(timeout=30)
    second = pool.submit("a", ("a", "regex", "2"), work("a2"))
    other = pool.submit("b", ("b", "regex", "1"), work("b1"))
    assert _result(other) == "b1"  # b is not held up by a's slow compile
    assert not second.started.done()  # a's second waits for its first
    release.set()
    assert _result(second) == "a2"
    assert order == ["a1", "b1", "a2"]


def test_requests_for_the_same_grammar_share_one_compile() -> None:
    pool = CompilePool()
    release = threading.Event()
    runs: list[int] = []

    def work() -> Any:
        runs.append(1)
        assert release.wait(30)
        return "compiled"

    key = ("a", "regex", "x")
    jobs = [pool.submit("a", key, work) for _ in range(3)]
    release.set()
    assert [_result(job) for job in jobs] == ["compiled"] * 3
    assert runs == [1]


def test_a_compile_past_the_time_limit_is_refused_then_refused_at_once() -> None:
    compiler = _grammar_compiler(time_limit_s=0.001)
    slow = Constraint("json_schema", json.dumps(optional_properties(300)), "guided_json")
    with pytest.raises(ConstraintError, match=r"guided_json takes longer than 0\.001 s"):
        compiler.matcher(slow)
    job = compiler._pool._jobs.get(("", "json_schema", slow.spec))
    if job is not None:  # still compiling on its thread: wait for it to end
        with contextlib.suppress(ConstraintError):
            job.done.result(timeout=30)
    started = time.monotonic()
    with pytest.raises(ConstraintError, match="takes longer than"):
        asyncio.run(compiler.prepare(replace(slow, field="response_format")))
    assert time.monotonic() - started < 0.5  # remembered: not compiled again
    assert compiler.cached() == []


# -- the cache is kept per tenant (issue 32 item 10) -----------------------------------


def test_compiled_grammars_are_kept_per_tenant_unless_the_cache_is_shared() -> None:
    constraint = Constraint("regex", "[a-z]{3}")
    separate = _grammar_compiler()
    separate.matcher(constraint, "tenant-a")
    separate.matcher(constraint, "tenant-a")
    asyncio.run(separate.prepare(constraint, "tenant-b"))  # a miss: compiled for b
    assert separate.cached() == [
        ("tenant-a", "regex", "[a-z]{3}"),
        ("tenant-b", "regex", "[a-z]{3}"),
    ]
    shared = _grammar_compiler(share_cache=True)
    shared.matcher(constraint, "tenant-a")
    shared.matcher(constraint, "tenant-b")
    assert shared.cached() == [("", "regex", "[a-z]{3}")]


# -- llguidance's messages in our own words (issue 32 item 11) -------------------------


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (
            Constraint("json_schema", '{"type": "object", "if": {}, "then": {}}', "guided_json"),
            'guided_json uses keywords this server does not support: "if", "then"',
        ),
        (
            Constraint("json_schema", '{"$ref": "#/$defs/nope"}', "response_format"),
            'response_format has a $ref that points to nothing: "/$defs/nope"',
        ),
        (
            Constraint("json_schema", '{"type": "string", "pattern": "(a"}', "guided_json"),
            "guided_json has a pattern that is not a valid regular expression",
        ),
        (
            Constraint("regex", "(unclosed", "guided_regex"),
            "guided_regex is not a valid regular expression",
        ),
        (
            Constraint("grammar", "start: foo", "guided_grammar"),
            'guided_grammar refers to an undefined rule or terminal: "foo" (line 1, column 8)',
        ),
        (
            Constraint("grammar", "root ::= foo", "guided_grammar"),
            'guided_grammar refers to an undefined rule: "foo"',
        ),
    ],
)
def test_grammar_errors_are_told_in_own_words(constraint: Constraint, message: str) -> None:
    with pytest.raises(ConstraintError) as refused:
        _grammar_compiler().matcher(constraint)
    assert refused.value.args[0] == message
    assert refused.value.param == constraint.field
