"""Fingerprints of a sabotage row's sources: what a recorded result was measured on.

A row of ``tests/sabotage/switches.py`` is proven by a run of its guards under its switch (``results.json``). That
record stays true only while three things are unchanged, each hashed here (sha256 of the exact source text of the
nodes named, read by `ast` from the files, no module executed):

- **target**: the definition of ``module:target``. The module's file is found by `importlib.machinery.PathFinder`
  (the parent packages are not imported); a dotted target goes through ``class``/``def`` bodies; a variable is its
  binding statement. Every statement of that body binding the name counts (a ``def`` later wrapped by an assignment:
  both); an imported name is followed to its definition (``transformers.trainer:skip_first_batches`` is accelerate's
  ``def``), its header ``module:name`` hashed with it.
- **replacement**: the row's replacement expression in switches.py (``copy_nothing``, ``importance_without("...",
  token_clip_high=1e10)``) plus, in the replacement files (`replacement_files`: replacements.py and one
  replacements_*.py per feature), the module-level definitions it names and, transitively, those they name
  (`closure`).
- **guards**: per guard node id (``file::func[params]`` or ``file::Class::func``; the parameters are ignored), the
  test function (its decorators included) plus, transitively, the module-level functions, classes and assignments
  of the same test file it names, a fixture of that file named as an argument included. A weakened ``_assert_...``
  helper changes the hash; an edit of an unrelated test does not. Not covered: conftest.py's fixtures and other
  modules (tests/vllm_runs.py, a helper imported from another test file).

Nothing is normalised: a reformatted or re-commented node is a changed node (rerun the row).

`end_to_end` says whether a guard is an end-to-end test: the rule is its tier, a ``slow`` or ``vllm`` mark on the
test, on its class or in its file's ``pytestmark`` (those tests run train.py, layout.py or real engines).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.machinery
import importlib.util
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
_BLOCKS = (ast.If, ast.Try, ast.With) + ((ast.TryStar,) if hasattr(ast, "TryStar") else ())
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_E2E_MARK = re.compile(r"\bmark\.(slow|vllm)\b(?!_)")


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@functools.lru_cache(maxsize=64)
def _parse_text(text: str) -> ast.Module:
    return ast.parse(text)


def _parse(path: Path) -> tuple[ast.Module, list[str]]:
    text = Path(path).read_text()
    return _parse_text(text), text.splitlines(keepends=True)


def _source(lines: list[str], node: ast.AST) -> str:
    """The whole lines of ``node``, from its first decorator to its end."""
    start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", ()))])
    return "".join(lines[start - 1:node.end_lineno])


def _statements(body: list[ast.stmt]):
    """The statements of a module or class body, those inside its ``if``/``try``/``with`` blocks included."""
    for stmt in body:
        if isinstance(stmt, _BLOCKS):
            for part in ("body", "orelse", "finalbody"):
                yield from _statements(getattr(stmt, part, []))
            for handler in getattr(stmt, "handlers", []):
                yield from _statements(handler.body)
        else:
            yield stmt


def _bound_names(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, _DEFS):
        return [stmt.name]
    if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return [(a.asname or a.name).split(".")[0] for a in stmt.names]
    return []


def bindings(body: list[ast.stmt]) -> dict[str, list[ast.stmt]]:
    """Name -> the statements of ``body`` binding it, in source order (definitions, assignments, imports)."""
    found: dict[str, list[ast.stmt]] = {}
    for stmt in _statements(body):
        for name in _bound_names(stmt):
            found.setdefault(name, []).append(stmt)
    return found


def _references(node: ast.AST) -> set[str]:
    """Names ``node`` uses: every ``Name`` in it, and the arguments of its functions (pytest fixtures by name)."""
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    for fn in ast.walk(node):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = fn.args
            names |= {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
    return names


def closure(roots: list[ast.AST], scopes: list[dict[str, list[ast.stmt]]]) -> list[ast.stmt]:
    """``roots`` plus, transitively, the definitions and assignments (not imports) of ``scopes`` they name, in
    source order; the first scope binding a name wins."""
    seen: dict[int, ast.AST] = {}
    todo = list(roots)
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        for name in _references(node):
            scope = next((s for s in scopes if name in s), None)
            if scope is not None:
                todo += [s for s in scope[name] if not isinstance(s, (ast.Import, ast.ImportFrom))]
    return sorted(seen.values(), key=lambda n: (n.lineno, n.col_offset))


# ------------------------------------------------------------------------------------------ target
def module_file(module: str) -> Path:
    """The ``.py`` file of ``module``, found without importing it or its packages where the path finder can."""
    parts, path, spec = module.split("."), None, None
    for i in range(len(parts)):
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:i + 1]), path)
        if spec is None:
            break
        path = spec.submodule_search_locations
    if spec is None:  # an import hook (editable install, ...): ask importlib, which imports the parents
        spec = importlib.util.find_spec(module)
    if spec is None or not (spec.origin or "").endswith(".py"):
        raise LookupError(f"{module}: no Python source file found")
    return Path(spec.origin)


def _absolute(module: str, is_package: bool, stmt: ast.ImportFrom) -> str:
    if not stmt.level:
        return stmt.module
    package = module if is_package else module.rpartition(".")[0]
    base = package.rsplit(".", stmt.level - 1)[0] if stmt.level > 1 else package
    return f"{base}.{stmt.module}" if stmt.module else base


def target_source(module: str, target: str, _depth: int = 0) -> str:
    """The source `fingerprint` hashes for ``module:target`` (see the module docstring)."""
    if _depth > 8:
        raise LookupError(f"{module}:{target}: imports followed too deep")
    path = module_file(module)
    tree, lines = _parse(path)
    body, parts, chunks = tree.body, target.split("."), []
    for i, part in enumerate(parts):
        found = bindings(body).get(part)
        if not found:
            raise LookupError(f"{module}:{target}: no {part!r} bound in {'.'.join([module, *parts[:i]])}'s body")
        last = found[-1]
        if i < len(parts) - 1:
            if isinstance(last, ast.ClassDef):
                body = last.body
                continue
            if isinstance(last, ast.ImportFrom):  # a class imported into the module: follow it
                alias = next(a for a in last.names if (a.asname or a.name) == part)
                source = _absolute(module, path.name == "__init__.py", last)
                return target_source(source, ".".join([alias.name, *parts[i + 1:]]), _depth + 1)
            raise LookupError(f"{module}:{target}: {part!r} is not a class")
        for stmt in found:
            chunks.append(_source(lines, stmt))
            if isinstance(stmt, ast.ImportFrom):
                alias = next(a for a in stmt.names if (a.asname or a.name) == part)
                source = _absolute(module, path.name == "__init__.py", stmt)
                try:
                    chunks.append(target_source(source, alias.name, _depth + 1))
                except LookupError:  # a submodule, a compiled module: the import statement alone
                    pass
    return f"# {module}:{target}\n" + "".join(chunks)


# ------------------------------------------------------------------------------------------ replacement
def replacement_files(sabotage: Path = HERE) -> list[Path]:
    """The replacement files: ``replacements.py`` (the shared helpers), then ``replacements_*.py`` (one per feature)
    in name order. Where a definition lives does not enter a fingerprint: moving one between them keeps its rows."""
    return [sabotage / "replacements.py", *sorted(sabotage.glob("replacements_*.py"))]


def replacement_source(row_name: str, switches: Path, replacements: Path | list[Path]) -> str:
    """The row's replacement expression in ``switches`` (the 5th argument of the ``M("<row_name>", ...)`` call) and
    the closure of the names it uses, looked up in ``replacements`` (a file, or the files of `replacement_files`,
    the first binding a name winning) first, then in ``switches``."""
    tree, lines = _parse(switches)
    call = next((n for n in ast.walk(tree) if isinstance(n, ast.Call) and len(n.args) >= 6
                 and isinstance(n.args[0], ast.Constant) and n.args[0].value == row_name), None)  # fmt: skip
    if call is None:
        raise LookupError(f"{row_name}: no M({row_name!r}, ...) call in {switches.name}")
    expr = call.args[4]
    text = ast.get_source_segment("".join(lines), expr)
    files = [replacements] if isinstance(replacements, Path) else list(replacements)
    rscope: dict[str, list[ast.stmt]] = {}
    where: dict[int, tuple[int, list[str]]] = {}  # a node's file (its index) and that file's lines
    for index, path in enumerate(files):
        rtree, rlines = _parse(path)
        for name, stmts in bindings(rtree.body).items():
            rscope.setdefault(name, stmts)
        where.update({id(n): (index, rlines) for n in ast.walk(rtree)})
    sscope = {k: v for k, v in bindings(tree.body).items() if k not in rscope}
    chunks = [f"# {switches.name}: {text}\n"]
    roots = [s for name in sorted(_references(expr)) for s in rscope.get(name, [])
             if not isinstance(s, (ast.Import, ast.ImportFrom))]  # fmt: skip
    nodes = sorted(closure(roots, [rscope]), key=lambda n: where[id(n)][0])  # stable: source order within a file
    chunks += [_source(where[id(n)][1], n) for n in nodes]
    local = [s for name in sorted(_references(expr)) for s in sscope.get(name, [])
             if isinstance(s, _DEFS)]  # a replacement defined in switches.py itself  # fmt: skip
    chunks += [_source(lines, n) for n in closure(local, [sscope])]
    return "".join(chunks)


# ------------------------------------------------------------------------------------------ guards
def _find_guard(path: Path, names: list[str]) -> tuple[ast.AST, list[ast.ClassDef], ast.Module, list[str]]:
    tree, lines = _parse(path)
    body, classes, found = tree.body, [], None
    for i, name in enumerate(names):
        found = next((n for n in body if isinstance(n, _DEFS) and n.name == name), None)
        if found is None:
            raise LookupError(f"{path.name}::{'::'.join(names)}: no {name!r}")
        if i < len(names) - 1:
            classes.append(found)
            body = found.body
    return found, classes, tree, lines


def _split(node: str) -> tuple[str, list[str]]:
    file, *names = node.split("::")
    names[-1] = names[-1].partition("[")[0]
    return file, names


def guard_source(node: str, root: Path = ROOT) -> str:
    """The test of node id ``node`` (parameters ignored) and the closure of the names it uses in its file."""
    file, names = _split(node)
    func, classes, tree, lines = _find_guard(root / file, names)
    scopes = [bindings(c.body) for c in reversed(classes)] + [bindings(tree.body)]
    return f"# {file}::{'::'.join(names)}\n" + "".join(_source(lines, n) for n in closure([func], scopes))


def end_to_end(node: str, root: Path = ROOT) -> bool:
    """Whether guard ``node`` is an end-to-end test: a ``slow`` or ``vllm`` mark on it, on its class or in its
    file's (or class's) ``pytestmark``."""
    file, names = _split(node)
    func, classes, tree, _ = _find_guard(root / file, names)
    marks = [*func.decorator_list, *(d for c in classes for d in c.decorator_list)]
    for body in [tree.body, *(c.body for c in classes)]:
        marks += [s.value for s in bindings(body).get("pytestmark", []) if isinstance(s, (ast.Assign, ast.AnnAssign))]
    return any(_E2E_MARK.search(ast.unparse(m)) for m in marks if m is not None)


# ------------------------------------------------------------------------------------------ a row
def fingerprint(row, root: Path = ROOT) -> dict:
    """``{"target": sha, "replacement": sha, "guards": {node: sha}}`` of a `Mechanism` row, from the current
    sources under ``root``."""
    sabotage = root / "tests" / "sabotage"
    return {
        "target": sha256(target_source(row.module, row.target)),
        "replacement": sha256(replacement_source(row.name, sabotage / "switches.py", replacement_files(sabotage))),
        "guards": {g: sha256(guard_source(g, root)) for g in row.guards},
    }
