"""The off-policy study report's archive (experiments/offpolicy_study.py): the per-run summaries of an earlier report,
used for runs whose directories were on other machines, and the check that every finished run started from the same
weights."""

from __future__ import annotations

import json
from pathlib import Path


def archived(path: Path) -> dict[tuple[str, str], dict]:
    """The per-run summaries of an earlier report (its results JSON) by (group, run directory name): a directory
    can be planned by two groups under different sweep values. Held-out steps are integers again; empty when there
    is no such file."""
    if not path.is_file():
        return {}
    return {(g, r["dir"]): {**r, "heldout": {int(s): v for s, v in r["heldout"].items()}}
            for g, records in json.loads(path.read_text()).items() if not g.startswith("_")
            for r in records}  # fmt: skip


def merge(rec: dict, summary: dict, old: dict | None, end: int) -> dict:
    """A run's summary for the report: the run directory's when it holds a complete checkpoint, else the archived
    one ``old`` of the same group and directory (the run directories of earlier machines are gone; their summaries
    were computed by this script), marked ``from_archive``. An archived run whose sweep values differ from the
    plan's, or that was summarised at another step, is an error, not a silent substitute."""
    if rec["heldout"] or old is None or not old["heldout"]:
        return summary  # an archived run that had no checkpoint either adds nothing
    if old["values"] != rec["values"]:
        raise SystemExit(f"archived run {rec['dir']} has values {old['values']}, the plan {rec['values']}")
    if f"batch_success@{end}" not in old:
        raise SystemExit(f"archived run {rec['dir']} was summarised at another step than {end}")
    return {**old, "from_archive": True}


def start_weights_line(summaries: list[dict]) -> str:
    """The report's line on the finished runs' start weights (`trl_ext.runs.provenance`); runs of two different
    starting points are refused, not averaged. Runs that predate the record (or whose archive row does) are
    counted as such."""
    done = [r for r in summaries if r["heldout"]]
    ids: dict[str, list[str]] = {}
    for r in done:
        if r.get("start_weights"):
            ids.setdefault(r["start_weights"], []).append(r["dir"])
    if len(ids) > 1:
        raise SystemExit("finished runs started from different weights: " + "; ".join(
            f"{w} ({len(d)} runs, e.g. {d[0]})" for w, d in ids.items()))
    missing = len(done) - sum(map(len, ids.values()))
    if not ids:
        return f"Start weights: none of the {len(done)} finished runs records them (they predate the record)."
    ((w, d),) = ids.items()
    return (f"Start weights: `{w}` in {len(d)} of {len(done)} finished runs"
            + (f"; {missing} predate the record." if missing else "."))
