"""Structure figures of a Tollgate tree, and the check that keeps its layers.

The report: lines per room (package, two levels deep), import cycles between modules
(module-level imports), and functions over 60 lines. The check (issue 35), whose
violations make the exit status 1:

- every import points down the layers: the gateway's composition root (app factory,
  `Runtime`, CLI) -> routes (controllers, the auth dependency, /metrics, OpenAPI
  shapes) -> application services -> tenants/ -> backend/. Services import neither
  Litestar nor `Runtime`; tenants/ imports nothing of the gateway.
- no cycle between the gateway's folders, counting every import: those inside
  functions and under TYPE_CHECKING too (they defer the import, not the dependency).
  Cycles between the folders of backend/ and tenants/ are reported, not checked.

    python scripts/structure_report.py [ROOT]          # the report and the check
    python scripts/structure_report.py --check [ROOT]  # the check alone (make lint)
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("backend", "tenants", "gateway")
LONG = 60

# Highest first: a module may import its own layer and those after it.
LAYERS = ("root", "routes", "services", "tenants", "backend")
GATEWAY_FOLDERS = {
    "gateway": "root",  # app.py (the factory), runtime.py (the composition root)
    "gateway.cli": "root",
    "gateway.api": "routes",
    "gateway.admin": "routes",
    "gateway.console": "routes",
    "gateway.http": "routes",
    "gateway.openapi": "routes",
    "gateway.admission": "services",
    "gateway.batches": "services",
    "gateway.billing": "services",
    "gateway.core": "services",
    "gateway.dispatch": "services",
    "gateway.metering": "services",
    "gateway.settings": "services",
    "gateway.telemetry": "services",
}
# Process entry points named by what loads them (Celery's `-A gateway.billing.worker`, and
# the batch tasks it registers): composition roots like the app factory, each its own
# folder here, wherever its name must stand.
ENTRY_POINTS = ("gateway.billing.worker", "gateway.batches.worker")
GATEWAY_FOLDERS.update(dict.fromkeys(ENTRY_POINTS, "root"))
# Libraries a layer must not import (HTTP stays at the edge; backend/ has its own server).
BANNED = dict.fromkeys(("services", "tenants"), ("litestar",))


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # a module of the tree, or a library's top-level name
    line: int
    top_level: bool  # at module level (TYPE_CHECKING blocks included)

    def where(self) -> str:
        return f"{self.source}:{self.line} imports {self.target}"


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


def layer(folder: str) -> str | None:
    """A folder's layer; None for a gateway folder no layer names (itself a violation)."""
    top = folder.split(".")[0]
    return GATEWAY_FOLDERS.get(folder) if top == "gateway" else top


def _top_level_nodes(tree: ast.Module) -> set[ast.AST]:
    found: set[ast.AST] = set()
    for node in tree.body:
        found.update(node.body if isinstance(node, ast.If) else [node])
    return found


def _absolute(statement: ast.ImportFrom, name: str, path: Path) -> str:
    """`from .x import y` in module `name` as an absolute module name."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    base = package.split(".")
    base = base[: len(base) - statement.level + 1]
    return ".".join([*base, statement.module] if statement.module else base)


def _targets(
    node: ast.Import | ast.ImportFrom, name: str, path: Path, known: Mapping[str, Path]
) -> set[str]:
    """What one import statement imports: the tree's modules by their full name (a name
    from a module, the module), a library by its top-level name."""
    if isinstance(node, ast.Import):
        wanted = [alias.name for alias in node.names]
    else:
        module = _absolute(node, name, path) if node.level else node.module or ""
        subs = [f"{module}.{alias.name}" for alias in node.names]
        wanted = [s for s in subs if s in known]
        if len(wanted) < len(subs):
            wanted.append(module)
    found = set()
    for target in wanted:
        while target not in known and "." in target:  # a name from a module: the module
            target = target.rsplit(".", 1)[0]
        found.add(target)
    return found - {name}


def imports(tree: ast.Module, name: str, path: Path, known: dict[str, Path]) -> list[Import]:
    """Every import of a module, wherever it stands (in a function too)."""
    top = _top_level_nodes(tree)
    return [
        Import(name, target, node.lineno, node in top)
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for target in sorted(_targets(node, name, path, known))
    ]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
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
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


@dataclass
class Tree:
    """A tree's modules, read once: their folders, lines, imports and long functions."""

    known: dict[str, Path]
    folder: dict[str, str]
    lines: dict[str, int]
    edges: list[Import]
    long_functions: list[tuple[int, str]]

    @classmethod
    def read(cls, root: Path) -> Tree:
        known = modules(root)
        tree = cls(known, {}, defaultdict(int), [], [])
        for name, path in known.items():
            source = path.read_text()
            parsed = ast.parse(source)
            tree.folder[name] = name if name in ENTRY_POINTS else room(name, path)
            tree.lines[tree.folder[name]] += len(source.splitlines())
            tree.edges += imports(parsed, name, path, known)
            for node in ast.walk(parsed):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    length = (node.end_lineno or node.lineno) - node.lineno + 1
                    if length > LONG:
                        tree.long_functions.append((length, f"{name}.{node.name}"))
        return tree

    def internal(self) -> list[Import]:
        return [i for i in self.edges if i.target in self.known]

    def module_cycles(self) -> list[list[str]]:
        edges: dict[str, set[str]] = defaultdict(set)
        for i in self.internal():
            if i.top_level:
                edges[i.source].add(i.target)
        return cycles(edges)

    def folder_cycles(self, package: str) -> list[list[str]]:
        """Cycles between the folders of `package`."""
        edges: dict[str, set[str]] = defaultdict(set)
        for i in self.internal():
            source, target = self.folder[i.source], self.folder[i.target]
            if source != target and _within(source, package) and _within(target, package):
                edges[source].add(target)
        return cycles(edges)

    def cycle_imports(self, component: list[str]) -> list[Import]:
        """The imports that close a folder cycle: those between its folders."""
        inside = set(component)
        return [
            i
            for i in self.internal()
            if self.folder[i.source] in inside
            and self.folder[i.target] in inside
            and self.folder[i.source] != self.folder[i.target]
        ]

    def layer_violations(self) -> list[str]:
        found = [
            f"{folder}: a gateway folder in no layer (name it in GATEWAY_FOLDERS)"
            for folder in sorted(set(self.folder.values()))
            if layer(folder) is None
        ]
        for i in self.edges:
            source = layer(self.folder[i.source])
            if source is None:
                continue
            if i.target not in self.known:
                if i.target in BANNED.get(source, ()):
                    found.append(f"{i.where()}: {source} must not import {i.target}")
                continue
            target = layer(self.folder[i.target])
            if target is not None and LAYERS.index(target) < LAYERS.index(source):
                found.append(f"{i.where()}: {source} must not import {target}")
        return found


def _within(folder: str, package: str) -> bool:
    return folder.split(".")[0] == package


def check(tree: Tree) -> int:
    """Print the layer violations and folder cycles; the count of both."""
    violations = tree.layer_violations()
    print("gateway layers: " + " -> ".join(LAYERS))
    print(f"layer violations: {len(violations)}")
    for violation in violations:
        print(f"  {violation}")
    found = tree.folder_cycles("gateway")
    print(f"cycles between the gateway's folders (function-level imports included): {len(found)}")
    for component in found:
        print("  " + " <-> ".join(component))
        for i in tree.cycle_imports(component):
            print(f"    {i.where()}")
    return len(violations) + len(found)


def report(tree: Tree) -> None:
    print("lines per room:")
    for name, count in sorted(tree.lines.items()):
        print(f"  {name:20} {count:6d}")
    print(f"  {'total':20} {sum(tree.lines.values()):6d}")
    found = tree.module_cycles()
    print(f"import cycles between modules (module level): {len(found)}")
    for component in found:
        print("  " + " <-> ".join(component))
    for package in ("tenants", "backend"):
        elsewhere = tree.folder_cycles(package)
        print(f"cycles between the folders of {package} (not checked): {len(elsewhere)}")
        for component in elsewhere:
            print("  " + " <-> ".join(component))
    print(f"functions over {LONG} lines: {len(tree.long_functions)}")
    for length, name in sorted(tree.long_functions, reverse=True):
        print(f"  {length:4d} {name}")


def main(argv: list[str]) -> int:
    check_only = "--check" in argv
    paths = [a for a in argv if a != "--check"]
    tree = Tree.read(Path(paths[0] if paths else "."))
    if not check_only:
        report(tree)
    return 1 if check(tree) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
