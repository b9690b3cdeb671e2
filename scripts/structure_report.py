"""Structure figures of a Tollgate tree: lines per room (package), import cycles between
modules, imports that point against the layers (backend < tenants < gateway, and the
telemetry package below the API), and functions over 60 lines.

    python scripts/structure_report.py [ROOT]     # ROOT: a checkout (default: this one)
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

PACKAGES = ("backend", "tenants", "gateway")
LAYER = {name: rank for rank, name in enumerate(PACKAGES)}
LONG = 60


def modules(root: Path) -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def room(name: str, path: Path) -> str:
    """The package a module lives in, two levels deep at most."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    return ".".join(package.split(".")[:2])


def imports(tree: ast.Module, known: dict[str, Path]) -> set[str]:
    """Modules imported at module level (TYPE_CHECKING blocks included)."""
    found: set[str] = set()
    for node in tree.body:
        for statement in node.body if isinstance(node, ast.If) else [node]:
            if isinstance(statement, ast.ImportFrom) and statement.module and not statement.level:
                subs = [f"{statement.module}.{alias.name}" for alias in statement.names]
                found.update(s for s in subs if s in known)
                if not all(s in known for s in subs) and statement.module in known:
                    found.add(statement.module)
            elif isinstance(statement, ast.Import):
                found.update(a.name for a in statement.names if a.name in known)
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    sys.setrecursionlimit(10_000)
    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def against_layers(a: str, b: str) -> bool:
    if LAYER[b.split(".")[0]] > LAYER[a.split(".")[0]]:
        return True
    return a.startswith("gateway.telemetry") and b.startswith(
        ("gateway.api", "gateway.metering.recorder")
    )


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    known = modules(root)
    lines: dict[str, int] = defaultdict(int)
    edges: dict[str, set[str]] = defaultdict(set)
    long_functions = []
    for name, path in known.items():
        source = path.read_text()
        tree = ast.parse(source)
        lines[room(name, path)] += len(source.splitlines())
        edges[name] = imports(tree, known) - {name}
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > LONG:
                    long_functions.append((length, f"{name}.{node.name}"))
    print("lines per room:")
    for name, count in sorted(lines.items()):
        print(f"  {name:20} {count:6d}")
    print(f"  {'total':20} {sum(lines.values()):6d}")
    found = cycles(edges)
    print(f"import cycles: {len(found)}")
    for component in found:
        print("  " + " <-> ".join(component))
    back = sorted((a, b) for a in edges for b in edges[a] if against_layers(a, b))
    print(f"imports against the layers: {len(back)}")
    for a, b in back:
        print(f"  {a} -> {b}")
    print(f"functions over {LONG} lines: {len(long_functions)}")
    for length, name in sorted(long_functions, reverse=True):
        print(f"  {length:4d} {name}")


if __name__ == "__main__":
    main()
