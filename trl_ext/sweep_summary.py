"""Sweep results: one row per run (status, steps, final reward and KL), the summary files, and the merge of the
shards of a sweep run on several machines.

A sweep run whole writes ``summary.json``, ``summary.csv`` and ``reward_curves.png`` in its sweep directory. A
shard (``sweep.py --shard K/N``) writes ``summary.shardKofN.*`` instead, so that N machines sharing the sweep
directory never write one file. ``sweep.py ... --summarize`` merges them into the unsharded names: every planned
run, in plan order, with its row from the newest summary file that has one, its status corrected by its run
directory (a ``run_summary.json`` saying "done" is done, whatever an older row says) and its metrics re-read.
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

SUMMARY_COLUMNS = ("label", "status", "launched", "steps", "reward", "kl", "wall_s", "train_s", "returncode",
                   "device", "shard", "name", "run_dir")  # fmt: skip


@dataclass
class RunResult:
    label: str
    name: str
    run_dir: str
    status: str  # done | FAILED | PREEMPTED | BUSY | INTERRUPTED | NOT_STARTED | UNFINISHED (merge only)
    launched: bool
    steps: int | None = None
    reward: float | None = None
    kl: float | None = None
    wall_s: float | None = None  # process wall time seen by this sweep
    train_s: float | None = None  # trainer.train() wall time (run_summary.json)
    returncode: int | None = None
    device: str | None = None
    log: str | None = None
    log_tail: list[str] = field(default_factory=list)
    shard: str | None = None  # "K/N" when run by a shard


def is_done(run_dir: Path) -> bool:
    path = run_dir / "run_summary.json"
    return path.is_file() and json.loads(path.read_text()).get("status") == "done"


def fill_metrics(result: RunResult) -> RunResult:
    """Steps, final reward and KL: from run_summary.json when done, else from the newest checkpoint."""
    from trl_ext.evaluate import latest_trainer_state

    run_dir = Path(result.run_dir)
    if is_done(run_dir):
        summary = json.loads((run_dir / "run_summary.json").read_text())
        result.steps, result.train_s, last = summary["steps"], summary["wall_s"], summary["final_log"]
    elif (state_path := latest_trainer_state(run_dir)) is not None:
        state = json.loads(state_path.read_text())
        result.steps = state["global_step"]
        last = next((h for h in reversed(state["log_history"]) if "reward" in h), {})
    else:
        return result
    result.reward, result.kl = last.get("reward"), last.get("kl")
    return result


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def summary_table(results: list[RunResult]) -> str:
    cols = ("label", "status", "steps", "reward", "kl", "train_s", "wall_s", "name")
    rows = [cols] + [tuple(_fmt(getattr(r, c)) for c in cols) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in rows)


def shard_suffix(shard: tuple[int, int] | None) -> str:
    return f".shard{shard[0]}of{shard[1]}" if shard else ""


def summary_paths(sweep_dir: Path, shard: tuple[int, int] | None = None) -> dict[str, Path]:
    s = shard_suffix(shard)
    return {"json": sweep_dir / f"summary{s}.json", "csv": sweep_dir / f"summary{s}.csv",
            "png": sweep_dir / f"reward_curves{s}.png"}  # fmt: skip


def write_summary(results: list[RunResult], sweep_dir: Path, shard: tuple[int, int] | None = None) -> dict[str, Path]:
    """summary.json, summary.csv and reward_curves.png in ``sweep_dir`` (``summary.shardKofN.*`` for a shard)."""
    from trl_ext.evaluate import latest_trainer_state, plot_curves, reward_history

    paths = summary_paths(sweep_dir, shard)
    paths["json"].write_text(json.dumps([asdict(r) for r in results], indent=2))
    with open(paths["csv"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(SUMMARY_COLUMNS)
        w.writerows([getattr(r, c) for c in SUMMARY_COLUMNS] for r in results)
    curves = {}
    for r in results:
        state = latest_trainer_state(Path(r.run_dir))
        rows = reward_history(state) if state else []
        if rows:
            curves[r.label] = ([h["step"] for h in rows], [h["reward"] for h in rows])
    title = f"reward: {sweep_dir.name}" + (f" (shard {shard[0]}/{shard[1]})" if shard else "")
    plot_curves(curves, paths["png"], title=title, ylabel="reward")
    return paths


def merge_results(runs, sweep_dir: Path) -> list[RunResult]:
    """One row per planned run (``runs``: `trl_ext.sweep_plan.PlannedRun`, plan order) from every summary file in
    ``sweep_dir`` (shards' and earlier merges'; for a run in several, the newest file's row), corrected by the run
    directory: "done" when its run_summary.json says so, else the row's status; a run with no row is UNFINISHED
    when its directory exists (a shard still running it, or one that stopped before writing its summary), else
    NOT_STARTED. A row saying "done" whose directory no longer is becomes UNFINISHED / NOT_STARTED likewise."""
    known = {f.name for f in fields(RunResult)}
    rows: dict[str, dict] = {}
    for path in sorted(sweep_dir.glob("summary*.json"), key=lambda p: (p.stat().st_mtime, p.name)):
        for row in json.loads(path.read_text()):
            rows[row["name"]] = {k: v for k, v in row.items() if k in known}
    out = []
    for run in runs:
        row = rows.get(run.name)
        r = RunResult(**row) if row else RunResult(run.label, run.name, str(run.run_dir), "NOT_STARTED", False)
        r.label, r.run_dir = run.label, str(run.run_dir)
        if is_done(run.run_dir):
            r.status = "done"
        elif row is None or r.status == "done":
            r.status = "UNFINISHED" if run.run_dir.exists() else "NOT_STARTED"
        out.append(fill_metrics(r))
    return out
