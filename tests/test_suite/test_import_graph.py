"""The product's import graph (Python under core/, adapters/, grammar/, gateway/), read from the source:

- no cycle between modules, function-local imports included (a local import only hides a cycle; `if
  TYPE_CHECKING:` imports never run and are left out);
- every function-local import says why it is local (a `#` comment on its line or the line above): an optional
  dependency, torch kept out of `loraplex serve --help`, a feature that is off, a module run as a script.

The walker is tested on a planted cycle and a planted bare local import, so neither check can pass vacuously.
"""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "adapters", "grammar", "gateway")


@dataclass
class ImportGraph:
    edges: dict[str, set[str]] = field(default_factory=dict)
    bare_local_imports: list[str] = field(default_factory=list)   # "path:line: import ..." without a reason


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def build_graph(root: Path) -> ImportGraph:
    modules = _modules(root)

    def resolve(dotted: str) -> str | None:   # the longest product module a dotted name starts with
        parts = dotted.split(".")
        for k in range(len(parts), 0, -1):
            if ".".join(parts[:k]) in modules:
                return ".".join(parts[:k])
        return None

    graph = ImportGraph()
    for mod, path in modules.items():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source, str(path))
        type_only: set[int] = set()
        in_function: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                type_only.update(id(sub) for stmt in node.body for sub in ast.walk(stmt))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                in_function.update(id(sub) for sub in ast.walk(node) if sub is not node)
        edges = graph.edges.setdefault(mod, set())
        for node in ast.walk(tree):
            if id(node) in type_only or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                    package = package[:len(package) - (node.level - 1)]
                    base = ".".join(package + ([base] if base else []))
                subs = [f"{base}.{alias.name}" for alias in node.names]
                # `from pkg import submodule` needs the submodule, not what pkg/__init__.py re-exports
                targets = subs + ([] if all(resolve(s) == s for s in subs) else [base])
            for target in targets:
                dep = resolve(target)
                if dep and dep != mod and not mod.startswith(dep + "."):   # a parent package always runs first
                    edges.add(dep)
            if id(node) in in_function:
                above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
                if "#" not in lines[node.lineno - 1] and not above.startswith("#"):
                    graph.bare_local_imports.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return graph


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(edges):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_no_import_cycle() -> None:
    graph = build_graph(ROOT)
    assert len(graph.edges) > 200   # the walk found the product
    assert cycles(graph.edges) == []


def test_every_function_local_import_says_why() -> None:
    assert build_graph(ROOT).bare_local_imports == []


def _write(root: Path, files: dict[str, str]) -> None:
    for pkg in PACKAGES:
        (root / pkg).mkdir(parents=True, exist_ok=True)
        (root / pkg / "__init__.py").write_text("")
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_walker_finds_a_cycle_hidden_in_a_function(tmp_path: Path) -> None:
    _write(tmp_path, {
        "core/a.py": "from core.b import g\n",
        "core/b.py": "def g():\n    from core import a  # lazy: hides the cycle\n    return a\n",
        "core/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from core.a import g\n",
        "grammar/x/__init__.py": "from grammar.x.y import f\n",
        "grammar/x/y.py": "from grammar.x import z\ndef f():\n    return z\n",
        "grammar/x/z.py": "",
    })
    graph = build_graph(tmp_path)
    assert cycles(graph.edges) == [["core.a", "core.b"]]   # not c (type-only), not a package and its submodules
    assert graph.bare_local_imports == []


def test_the_walker_finds_a_local_import_without_a_reason(tmp_path: Path) -> None:
    _write(tmp_path, {"gateway/h.py": "def f():\n    import json\n    return json\n\n"
                                      "def g():\n    # optional dependency\n    import yaml\n    return yaml\n"})
    assert build_graph(tmp_path).bare_local_imports == ["gateway/h.py:2: import json"]
