"""The package layout: one subpackage per feature and no import cycle between the project's modules.

The graph is read from the source (``ast``), with imports inside functions counted too: a lazy import that closes a
cycle is still a cycle (it only moves the failure from import time to call time)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("trl_ext", "environments", "rewards")
FEATURES = ("routing", "offpolicy", "distill", "env", "models", "generation", "runs", "serve")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports (``from a import b`` counts ``a.b`` when that is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # ``import a.b.c`` of a package's attribute: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def project_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    # a package imports its own submodules only through its __init__; edges to a package's __init__ from inside it
    # are not cycles of the layout
    return {name: imports(name, path, known) for name, path in mods.items()}


def test_cycle_finder_on_a_hand_made_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert cycles(project_graph()) == []


@pytest.mark.parametrize("feature", FEATURES)
def test_one_subpackage_per_feature(feature):
    pkg = ROOT / "trl_ext" / feature
    assert (pkg / "__init__.py").is_file()
    assert any(p.name != "__init__.py" for p in pkg.glob("*.py"))


def test_modules_are_small_enough_to_read():
    too_long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > 450}
    assert too_long == {}
