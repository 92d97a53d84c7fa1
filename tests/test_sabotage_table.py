"""The sabotage table (tests/sabotage/switches.py) cannot rot silently: every row's module imports, its target
exists, every guard names an existing test, and the injection hook fails loudly on a missing target. The sabotage
runs themselves are the ``sabotage`` tier (tests/sabotage/test_sabotage.py, docs/testing.md)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
SABOTAGE = ROOT / "tests" / "sabotage"


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


SWITCHES = _load("_sabotage_switches_table", SABOTAGE / "switches.py")
MECHANISMS = SWITCHES.MECHANISMS
DOCUMENTED = ("docs/", "trl_ext/")


def test_rows_are_named_once_and_described():
    names = [row.name for row in MECHANISMS]
    assert len(names) == len(set(names)), [n for n in names if names.count(n) > 1]
    for row in MECHANISMS:
        assert row.claim.startswith(DOCUMENTED) and ": " in row.claim, f"{row.name}: the claim names no document"
        assert len(row.switch) > 20, f"{row.name}: the replacement has no docstring saying what the switch does"
        assert row.guards and all(g.startswith("tests/") and "::" in g for g in row.guards), row.name
        assert not any(g.split("::")[0] == "tests/sabotage/test_sabotage.py" for g in row.guards), row.name


@pytest.mark.parametrize("row", MECHANISMS, ids=lambda r: r.name)
def test_target_exists_and_replacement_builds(row):
    owner = importlib.import_module(row.module)
    for part in row.target.split("."):
        assert hasattr(owner, part), f"{row.name}: {row.module}:{row.target} does not exist (renamed?)"
        owner = getattr(owner, part)
    assert callable(owner) and callable(row.replacement(owner)), row.name


def _parametrize_ids(func: ast.FunctionDef) -> list[str] | None:
    """pytest's ids of ``func``'s literal ``@pytest.mark.parametrize`` decorators (the nearest decorator's part
    first, as pytest joins them), or None when one is not made of literals."""
    ids = [""]
    for deco in reversed(func.decorator_list):
        if not (isinstance(deco, ast.Call) and ast.unparse(deco.func).endswith("mark.parametrize")):
            continue
        if deco.keywords or len(deco.args) != 2:
            return None
        try:
            values = ast.literal_eval(deco.args[1])
        except ValueError:
            return None
        argnames = [n.strip() for n in ast.literal_eval(deco.args[0]).split(",") if n.strip()]
        parts = []
        for i, v in enumerate(values):  # pytest: a number, string, bool or None as itself, else argname + index
            items = v if len(argnames) > 1 else (v,)
            parts.append("-".join(str(x) if isinstance(x, (str, int, float, bool)) or x is None else f"{name}{i}"
                                  for name, x in zip(argnames, items, strict=True)))
        ids = [f"{a}-{b}" if a else b for a in ids for b in parts]
    return ids


def _find_test(path: Path, names: list[str]) -> ast.FunctionDef | None:
    body = ast.parse(path.read_text()).body
    for i, name in enumerate(names):
        found = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name), None)
        if found is None:
            return None
        if i < len(names) - 1:
            body = found.body
    return found if isinstance(found, ast.FunctionDef) else None


@pytest.mark.parametrize("guard", sorted({g for row in MECHANISMS for g in row.guards}))
def test_guard_exists(guard):
    file, *names = guard.split("::")
    path = ROOT / file
    assert path.is_file(), f"{guard}: no file {file}"
    names[-1], _, param = names[-1].partition("[")
    func = _find_test(path, names)
    assert func is not None and func.name.startswith("test_"), f"{guard}: no such test in {file}"
    if param:
        ids = _parametrize_ids(func)
        assert ids is not None, f"{guard}: name the whole test function (its parameters are not literals)"
        assert param.removesuffix("]") in ids, f"{guard}: no parameter set [{param}; ids: {ids}"


# ------------------------------------------------------------------------------------------ the injection hook
HOOK = SABOTAGE / "inject" / "sitecustomize.py"


def test_hook_fails_loudly_on_a_missing_target(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXT_SABOTAGE_LOG", str(tmp_path / "log"))
    monkeypatch.delenv("TRL_EXT_SABOTAGE", raising=False)
    hook = _load("_sabotage_hook_table", HOOK)
    module = ModuleType("fake")
    module.Engine = type("Engine", (), {"load": lambda self: "loaded"})
    row = SimpleNamespace(name="fake_row", module="fake", target="Engine.reload", replacement=lambda orig: orig)
    with pytest.raises(hook.SabotageError, match=r"fake.Engine has no attribute 'reload'"):
        hook.apply(row, module)
    assert (tmp_path / "log").read_text().startswith("MISSING fake_row fake:Engine.reload")
    row = SimpleNamespace(name="fake_row", module="fake", target="Engine.load",
                          replacement=lambda orig: lambda self: "sabotaged")
    hook.apply(row, module)
    engine = module.Engine()
    assert engine.load() == "sabotaged" and engine.load() == "sabotaged"
    log = (tmp_path / "log").read_text().splitlines()
    assert [line.split()[0] for line in log] == ["MISSING", "applied", "hit"]  # hit: once per process


def test_hook_switches_in_a_fresh_process_and_refuses_unknown_rows(tmp_path):
    """With the folder on PYTHONPATH, a new interpreter imports the row's module already switched; an unknown row
    stops the interpreter at start-up."""
    import os

    env = {**os.environ, "PYTHONPATH": str(HOOK.parent), "TRL_EXT_SABOTAGE": "env_loss_mask",
           "TRL_EXT_SABOTAGE_LOG": str(tmp_path / "log")}  # fmt: skip
    code = ("import torch; from trl_ext.batch import loss_mask; "
            "b = {'completion_mask': torch.ones(1, 2), 'tool_mask': torch.tensor([[1, 0]])}; "
            "print(loss_mask(b).tolist(), loss_mask.__sabotaged__)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[[1.0,", "1.0]]", "env_loss_mask"]  # the environment token is no longer masked
    assert [line.split()[:2] for line in (tmp_path / "log").read_text().splitlines()] == [
        ["applied", "env_loss_mask"], ["hit", "env_loss_mask"]]
    env["TRL_EXT_SABOTAGE"] = "no_such_row"
    bad = subprocess.run([sys.executable, "-c", "print('ran')"], env=env, capture_output=True, text=True)
    assert bad.returncode == 3 and "ran" not in bad.stdout and "no sabotage row 'no_such_row'" in bad.stderr
