"""Grammar compiles against the built-in model's tokenizer (issue 32): for each hostile
shape and size, what grammar_limits.py says, and what llguidance's native compiler does
with it on an ordinary 8 MiB stack (a thread of a subprocess: "crash" when it dies on a
signal) and on the compile pool's thread (limits lifted). In process, on the CPU.

    python -m bench.grammar_compile [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from backend.builtin import BUILTIN_MODEL_DIR
from backend.constraint import Constraint
from backend.errors import ConstraintError
from backend.grammar import GrammarCompiler, _grammar, _parser_limits
from backend.grammar_limits import GrammarLimits, check_limits
from tests.support import hostile_grammars as hostile

Shape = tuple[str, str, Callable[[int], Any]]
SHAPES: list[Shape] = [
    ("$ref chain", "json_schema", hostile.ref_chain),
    ("$ref chain, compact", "json_schema", hostile.compact_ref_chain),
    ("Lark rule chain", "grammar", hostile.lark_chain),
    ("Lark rule chain, compact", "grammar", hostile.compact_lark_chain),
    ("GBNF rule chain", "grammar", hostile.gbnf_chain),
    ("optional properties", "json_schema", hostile.optional_properties),
    ("choices", "choice", lambda n: [f"c{i:09d}" for i in range(n)]),
    ("regex a?", "regex", lambda n: "a?" * n),
]
SIZES = [250, 1000, 3000, 10_000]
QUICK_SIZES = [250, 1000]
SLOWEST = {"GBNF rule chain": 5000}  # converted to Lark in Python: 90 s for 10,000 rules
LIFTED = GrammarLimits(
    max_chars=2**30,
    max_regex_chars=2**30,
    max_schema_depth=2**30,
    max_schema_properties=2**30,
    max_optional_properties=2**30,
    max_choices=2**30,
    max_grammar_rules=2**30,
)


def constraint(shape: Shape, size: int) -> Constraint:
    _, kind, build = shape
    value = build(size)
    return Constraint(kind, value if isinstance(value, str) else json.dumps(value))  # type: ignore[arg-type]


def compile_on_8_mib(shape_index: int, size: int) -> None:
    """In the subprocess: one compile on a thread of an explicit 8 MiB stack (an ordinary
    thread's, whatever `ulimit -s` says); prints its seconds."""
    import llguidance

    compiler = GrammarCompiler(BUILTIN_MODEL_DIR / "tokenizer.json", 4096, [2])
    tokenizer = compiler._llg_tokenizer()
    grammar = _grammar(constraint(SHAPES[shape_index], size))

    def run() -> None:
        started = time.perf_counter()
        llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=_parser_limits())
        print(f"{time.perf_counter() - started:.3f}")

    threading.stack_size(8 * 2**20)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()


def on_8_mib(shape_index: int, size: int) -> str:
    args = [sys.executable, "-m", "bench.grammar_compile", "--one", str(shape_index), str(size)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if done.returncode < 0:
        return "crash"
    if done.returncode != 0:
        return "error"
    return f"{float(done.stdout.split()[-1]):.3f} s"


def on_the_pool(spec: Constraint) -> str:
    compiler = GrammarCompiler(
        BUILTIN_MODEL_DIR / "tokenizer.json", 4096, [2], limits=LIFTED, time_limit_s=600
    )
    compiler.matcher(Constraint("regex", "warm"))  # the tokenizer loaded, not timed
    started = time.perf_counter()
    try:
        compiler.matcher(spec)
    except ConstraintError as exc:
        return f"refused ({exc.problem[:40]})"
    return f"{time.perf_counter() - started:.3f} s"


def verdict(spec: Constraint) -> str:
    started = time.perf_counter()
    try:
        check_limits(spec)
    except ConstraintError as exc:
        return f"refused in {(time.perf_counter() - started) * 1000:.1f} ms: {exc.problem}"
    return "allowed"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--one", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        compile_on_8_mib(*args.one)
        return
    print(f"{'shape':26} {'size':>6} {'bytes':>8}  {'8 MiB stack':>11}  {'pool':>10}  limits")
    for index, shape in enumerate(SHAPES):
        sizes = QUICK_SIZES if args.quick else SIZES
        for size in sorted({min(size, SLOWEST.get(shape[0], size)) for size in sizes}):
            spec = constraint(shape, size)
            small_stack = on_8_mib(index, size)
            pool = on_the_pool(spec)
            print(
                f"{shape[0]:26} {size:>6} {len(spec.spec):>8}  {small_stack:>11}  {pool:>10}  "
                f"{verdict(spec)}",
                flush=True,
            )


if __name__ == "__main__":
    main()
