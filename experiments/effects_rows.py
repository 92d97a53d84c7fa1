"""The rows of experiments/effects.py's tables (`Row` and its builders: paired, unpaired, against a constant, rates,
counts, trends) and the readers of the result files they are computed from (markdown tables, the studies' JSON)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"


def _load(name: str):
    """A module of experiments/ (not a package) by file name, registered as ``experiments_<name>`` (a dataclass looks
    its module up in sys.modules; the prefix keeps the bare names free)."""
    key = f"experiments_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, ROOT / "experiments" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod
        spec.loader.exec_module(mod)
    return sys.modules[key]


st = _load("stats")


# --- rows ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One comparison: A against B, the difference A - B, in standard errors, and the verdict."""

    id: str
    what: str
    a: str
    b: str
    diff: str
    z: str
    verdict: str
    interval: str = "-"

    def line(self) -> str:
        return (f"| {self.id} | {self.what} | {self.a} | {self.b} | {self.diff} | {self.interval} | {self.z} | "
                f"{self.verdict} |")


HEAD = ["| row | comparison (A vs B) | A | B | A - B | ±2 SE interval | in SE | verdict |",
        "|---|---|---|---|---|---|---|---|"]


def interval(d: float, se: float, digits: int = 3) -> str:
    """The difference ± 2 SE, the interval the verdict reads ('-' without an SE)."""
    if math.isnan(se):
        return "-"
    return f"[{d - 2 * se:+.{digits}f}, {d + 2 * se:+.{digits}f}]"


def paired(id: str, what: str, a: dict, b: dict, digits: int = 3) -> Row:
    """A and B per seed; the difference is paired over the seeds both have."""
    d, se, n = st.paired_difference(a, b)
    return Row(id, what, st.fmt_mean_se(list(a.values()), digits), st.fmt_mean_se(list(b.values()), digits),
               f"{st.fmt_diff(d, se, digits)} (paired, n={n})", st.fmt_z(d, se), st.verdict(d, se, n),
               interval(d, se, digits))


def unpaired(id: str, what: str, a: list[float], b: list[float], digits: int = 3) -> Row:
    """Independent samples (or samples whose pairing the result file does not keep)."""
    d, se = st.unpaired_difference(a, b)
    return Row(id, what, st.fmt_mean_se(a, digits), st.fmt_mean_se(b, digits),
               f"{st.fmt_diff(d, se, digits)} (unpaired)", st.fmt_z(d, se), st.verdict(d, se, min(len(a), len(b))),
               interval(d, se, digits))


def against(id: str, what: str, a: list[float], b: float, b_label: str, b_se: float = 0.0, digits: int = 3,
            b_digits: int | None = None) -> Row:
    """Seeds against one reference value: with its own SE b_se where it is a random measurement (a sampled
    evaluation: binomial), 0 where it is fixed (a constant, or a greedy evaluation of one model on the same levels)."""
    m, se = st.mean_se(a)
    d, dse = m - b, math.hypot(se, b_se)
    bd = digits if b_digits is None else b_digits
    b_cell = f"{b:.{bd}f} ± {b_se:.{digits}f} ({b_label})" if b_se else f"{b:.{bd}f} ({b_label})"
    return Row(id, what, st.fmt_mean_se(a, digits), b_cell, f"{st.fmt_diff(d, dse, digits)} (n={len(a)})",
               st.fmt_z(d, dse), st.verdict(d, dse, len(a)), interval(d, dse, digits))


def rates(id: str, what: str, p: float, n: int, q: float, m: int, digits: int = 3) -> Row:
    """Two rates of one run each (one seed), each with its binomial SE over its n evaluation items."""
    sp, sq = st.binomial_se(p, n), st.binomial_se(q, m)
    d, se = p - q, math.hypot(sp, sq)
    return Row(id, what, f"{p:.{digits}f} ± {sp:.{digits}f} (n={n})", f"{q:.{digits}f} ± {sq:.{digits}f} (n={m})",
               f"{st.fmt_diff(d, se, digits)} (binomial, one seed)", st.fmt_z(d, se), st.verdict(d, se),
               interval(d, se, digits))


def counts(id: str, what: str, k: int, n: int, j: int, m: int) -> Row:
    """k of n runs against j of m runs, by Fisher's exact test (two-sided)."""
    p = st.fisher_exact(k, n - k, j, m - j)
    return Row(id, what, f"{k}/{n} runs", f"{j}/{m} runs", f"Fisher exact p = {p:.3f}", "-", st.fisher_verdict(p))


def trend(id: str, what: str, slope: float, se: float, n: int, unit: str) -> Row:
    """A least-squares slope against zero."""
    return Row(id, what, f"slope {slope:+.4f} ± {se:.4f} {unit} ({n} runs)", "0 (no trend)",
               f"{slope:+.4f} ± {se:.4f}", st.fmt_z(slope, se), st.verdict(slope, se), interval(slope, se, 4))


def section(name: str, title: str, rows: list[Row], note: str = "") -> list[str]:
    """A titled table between snippet section markers (pymdownx.snippets: ``file.md:name``)."""
    return ([f"## {title}", ""] + ([note, ""] if note else []) + [f"<!-- --8<-- [start:{name}] -->", *HEAD]
            + [r.line() for r in rows] + [f"<!-- --8<-- [end:{name}] -->", ""])  # fmt: skip


# --- reading the result files ----------------------------------------------------------------------------------------


def md_tables(text: str) -> list[list[dict[str, str]]]:
    """Every pipe table of a markdown text, as rows of {header: cell}."""
    tables, head, rows = [], None, []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if head is None:
                head = cells
            elif not set("".join(cells)) <= set("-: "):
                rows.append(dict(zip(head, cells)))
        elif head is not None:
            tables.append(rows)
            head, rows = None, []
    return tables


NUM = r"-?\d+\.\d+"


def three(cell: str) -> list[float]:
    """The values of a 'median (min-max)' or 'median [min, max]' cell over 3 seeds: min, median, max."""
    m = re.fullmatch(rf"({NUM}) (?:\(({NUM})-({NUM})\)|\[({NUM}), ({NUM})\])", cell.strip())
    if m is None:
        raise ValueError(f"not a 'median (min-max)' cell: {cell!r}")
    return sorted(float(x) for x in m.groups() if x is not None)


def read(name: str) -> str:
    return (RESULTS / name).read_text()


def study(name: str) -> dict[str, dict[str, dict]]:
    """An off-policy study's finished runs (experiments/results/<name>.json) by arm and seed; the starting model's
    held-out value, where the report evaluated it, under the key '_start'."""
    ops = _load("offpolicy_study")
    data = json.loads(read(f"{name}.json"))
    arms: dict[str, dict[str, dict]] = {}
    for group, runs in data.items():
        if group.startswith("_"):
            continue
        for r in runs:
            if r["status"] == "done" and r["heldout"]:
                arm = ops.arm_of({k: v for k, v in r["values"].items() if k != "seed"})
                arms.setdefault(arm, {})[r["values"]["seed"]] = r  # one run planned by two groups: the same run
    if "_start" in data:
        arms["_start"] = data["_start"]
    return arms


def held(runs: dict[str, dict], step: int, seeds=None) -> dict[str, float]:
    return {s: r["heldout"][str(step)] for s, r in runs.items() if seeds is None or s in seeds}


def field(runs: dict[str, dict], key: str) -> dict[str, float]:
    return {s: r[key] for s, r in runs.items()}


def invalid_count(runs: dict[str, dict], step: int) -> int:
    return sum((r[f"batch_invalid@{step}"] or 0) >= _load("offpolicy_study").COLLAPSED for r in runs.values())


def lag_slope(arms: dict[str, dict[str, dict]], key) -> tuple[float, float, int]:
    """The report's lag trend (offpolicy_study.ols_slope over k = 0 and strict k without masks)."""
    ops = _load("offpolicy_study")
    pts = [(math.log2(int(a.split()[0][2:]) + 1), key(r)) for a, runs in arms.items()
           if a == "k=0 sync" or a.endswith(" strict, no masks") for r in runs.values()]  # fmt: skip
    slope, se = ops.ols_slope([x for x, _ in pts], [y for _, y in pts])
    return slope, se, len(pts)


# --- off-policy -------------------------------------------------------------------------------------------------------

K16 = "k=16 strict, no masks"
MIS = "k=16 strict, MIS [{}]"
KL = "k=16 strict, no masks + kl_tau {}"
