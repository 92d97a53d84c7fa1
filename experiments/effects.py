"""The comparisons the experiment pages (docs/experiments/) state, each with both sides' mean ± standard error and n,
the difference with its standard error (paired by seed where the seeds pair), that difference in standard errors,
and the verdict of the reports' rule (experiments/stats.py): an effect only at 2 standard errors or more, else "no
measurable difference"; counts (runs that ended invalid) by Fisher's exact test, an effect at p < 0.05.

    uv run python experiments/effects.py

Reads only what the experiment scripts already wrote under experiments/results/ (no model, no training): the
off-policy studies' JSON (offpolicy_study, offpolicy_search, offpolicy_search_gpu, offpolicy_search_first_build,
offpolicy), distill.json, the raw JSON block of environments.md, and the per-seed (or per-cell) tables of
math_learns*.md, routing*.md, routing_env_*.md and distill_env.md. Writes experiments/results/effects_{offpolicy,
routing,distillation,environments}.md, one table per study between snippet section markers (the pages include
``effects_<page>.md:<section>``).

Where the result files keep no per-seed pairing (routing_arms*.md keep the median and range of 3 seeds, which are
the 3 values but not which seed gave which), the difference is unpaired. Where a study ran one seed, the standard
error is the binomial one of a rate over its evaluation prompts (sqrt(p (1 - p) / n)): it covers the evaluation's
sampling, not the spread between training seeds, which one seed cannot measure.
"""

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


def offpolicy_math() -> list[Row]:
    a, s = study("offpolicy_study"), 600
    h = lambda arm, seeds=None: held(a[arm], s, seeds)  # noqa: E731
    tis = [f"k=16 strict, no masks + TIS {c}" for c in (2, 4, 8)]
    rows = [
        paired("M1", "premise at lr 1e-4: k=16 no masks vs k=0 (held-out acc)", h("k=16 strict, no masks, lr 1e-4"),
               h("k=0 sync, lr 1e-4")),
        paired("M2", "premise at lr 2e-4, the rate chosen because it showed the gap (seeds 0-4)",
               h("k=16 strict, no masks, lr 2e-4"), h("k=0 sync, lr 2e-4")),
        paired("M3", "premise at lr 2e-4, seeds 0-2 only (the calibration that chose the rate)",
               h("k=16 strict, no masks, lr 2e-4", {"0", "1", "2"}), h("k=0 sync, lr 2e-4", {"0", "1", "2"})),
        paired("M4", "premise at lr 2e-4, seeds 3-4 only (added after the choice)",
               h("k=16 strict, no masks, lr 2e-4", {"3", "4"}), h("k=0 sync, lr 2e-4", {"3", "4"})),
        paired("M5", "premise at lr 3e-4", h("k=16 strict, no masks, lr 3e-4"), h("k=0 sync, lr 3e-4")),
        trend("M6", "lag trend: held-out acc per doubling of k + 1 (k = 0 and strict k, no masks)",
              *lag_slope(a, lambda r: r["heldout"][str(s)]), "per doubling"),
        *[paired(f"M{6 + i}", f"k={k} strict, no masks vs k=0", h(f"k={k} strict, no masks"), h("k=0 sync"))
          for i, k in enumerate((1, 4, 8, 32, 64), 1)],
        paired("M12", "k=16: default masks vs no masks", h("k=16 strict, default masks"), h(K16)),
        paired("M13", "k=8: default masks vs no masks", h("k=8 strict, default masks"), h("k=8 strict, no masks")),
        counts("M14", "k=8: ended invalid, default masks vs no masks", invalid_count(a["k=8 strict, default masks"], s),
               5, invalid_count(a["k=8 strict, no masks"], s), 5),
        paired("M15", "k=4 in-flight, default masks vs k=0", h("k=4 in-flight, default masks"), h("k=0 sync")),
        paired("M16", "k=1: strict vs in-flight (default masks)", h("k=1 strict, default masks"),
               h("k=1 in-flight, default masks")),
        counts("M17", "k=16: ended invalid, TIS 2, 4, 8 pooled vs no masks",
               sum(invalid_count(a[t], s) for t in tis), sum(len(a[t]) for t in tis), invalid_count(a[K16], s),
               len(a[K16])),
        *[paired(f"M{18 + i}", f"k=16: TIS {c} vs no masks", h(t), h(K16)) for i, (c, t) in enumerate(zip((2, 4, 8),
                                                                                                       tis))],
        *[paired(f"M{21 + i}", f"k=16: MIS [{w}] vs no masks", h(MIS.format(w)), h(K16))
          for i, w in enumerate(("0.125, 8", "0.25, 4", "0.5, 2"))],
        paired("M24", "k=16: MIS [0.5, 2] vs MIS [0.125, 8] (held-out acc)", h(MIS.format("0.5, 2")),
               h(MIS.format("0.125, 8"))),
        paired("M25", "k=16: masked tokens, MIS [0.25, 4] vs [0.125, 8]", field(a[MIS.format("0.25, 4")],
               "masked_frac"), field(a[MIS.format("0.125, 8")], "masked_frac")),
        paired("M26", "k=16: masked tokens, MIS [0.5, 2] vs [0.125, 8]", field(a[MIS.format("0.5, 2")],
               "masked_frac"), field(a[MIS.format("0.125, 8")], "masked_frac")),
        *[paired(f"M{27 + i}", f"k=16: kl_tau {t} vs no masks", h(KL.format(t)), h(K16))
          for i, t in enumerate(("1e-4", "2e-3", "1e-2", "1e-1", "1"))],
        paired("M32", "k=16: kl_tau 1e-1 vs k=0", h(KL.format("1e-1")), h("k=0 sync")),
        paired("M33", "k=16: mean abs log r, kl_tau 1 vs no masks", field(a[KL.format("1")], "abs_log_ratio_mean"),
               field(a[K16], "abs_log_ratio_mean")),
        paired("M34", "k=32: kl_tau 1e-2 vs 1e-3", h("k=32 strict, no masks + kl_tau 1e-2"),
               h("k=32 strict, no masks + kl_tau 1e-3")),
        paired("M35", "k=64: kl_tau 1e-2 vs 1e-3", h("k=64 strict, no masks + kl_tau 1e-2"),
               h("k=64 strict, no masks + kl_tau 1e-3")),
        counts("M36", "k=64: ended invalid, kl_tau 1e-3 vs 1e-2",
               invalid_count(a["k=64 strict, no masks + kl_tau 1e-3"], s), 5,
               invalid_count(a["k=64 strict, no masks + kl_tau 1e-2"], s), 5),
    ]
    return rows


def kl_dose(a: dict, s: int) -> tuple[float, float, int]:
    """Least-squares slope of held-out success on log10(kl_tau) over the strict k = 16 kl_tau arms (no masks)."""
    ops = _load("offpolicy_study")
    pts = [(math.log10(float(t)), v) for t in ("1e-4", "2e-3", "1e-2", "1e-1", "1")
           for v in held(a[KL.format(t)], s).values()]  # fmt: skip
    return (*ops.ols_slope([x for x, _ in pts], [y for _, y in pts]), len(pts))


def offpolicy_search() -> list[Row]:
    a, s = study("offpolicy_search"), 150
    h = lambda arm: held(a[arm], s)  # noqa: E731
    b = lambda arm, key="batch_success@150": field(a[arm], key)  # noqa: E731
    start = a["_start"]["heldout"]  # greedy, on the same held-out levels as every checkpoint: a fixed reference
    rows = [
        paired("S1", "premise at lr 3e-4: k=16 no masks vs k=0 (held-out success)", h("k=16 strict, no masks, lr 3e-4"),
               h("k=0 sync, lr 3e-4")),
        paired("S2", "premise at lr 5e-4 (rate chosen on the first build's runs)", h(K16), h("k=0 sync")),
        paired("S3", "premise at lr 1e-3", h("k=16 strict, no masks, lr 1e-3"), h("k=0 sync, lr 1e-3")),
        paired("S4", "batch success at lr 5e-4: k=16 no masks vs k=0", b(K16), b("k=0 sync")),
        against("S5", "k=0 at lr 5e-4 vs the starting model (held-out success)", list(h("k=0 sync").values()), start,
                "start, greedy, same levels"),
        against("S6", "k=0 at lr 1e-3 vs the starting model", list(h("k=0 sync, lr 1e-3").values()), start,
                "start, greedy, same levels"),
        trend("S7", "lag trend: held-out success per doubling of k + 1",
              *lag_slope(a, lambda r: r["heldout"][str(s)]), "per doubling"),
        trend("S8", "lag trend: batch success per doubling of k + 1", *lag_slope(a, lambda r: r["batch_success@150"]),
              "per doubling"),
        *[paired(f"S{9 + i}", f"k={k} strict, no masks vs k=0", h(f"k={k} strict, no masks"), h("k=0 sync"))
          for i, k in enumerate((1, 4, 8, 32, 64))],
        paired("S14", "k=8: default masks vs no masks", h("k=8 strict, default masks"), h("k=8 strict, no masks")),
        paired("S15", "k=16: default masks vs no masks", h("k=16 strict, default masks"), h(K16)),
        paired("S16", "k=16: MIS [0.5, 2] vs MIS [0.125, 8] (held-out success)", h(MIS.format("0.5, 2")),
               h(MIS.format("0.125, 8"))),
        paired("S17", "k=16: MIS [0.5, 2] vs no masks", h(MIS.format("0.5, 2")), h(K16)),
        paired("S18", "k=16: masked tokens, MIS [0.5, 2] vs [0.125, 8]", b(MIS.format("0.5, 2"), "masked_frac"),
               b(MIS.format("0.125, 8"), "masked_frac")),
        paired("S19", "k=16: TIS 2 vs no masks (held-out success)", h("k=16 strict, no masks + TIS 2"), h(K16)),
        paired("S20", "k=16: batch invalid, TIS 2 vs no masks", b("k=16 strict, no masks + TIS 2", "batch_invalid@150"),
               b(K16, "batch_invalid@150")),
        paired("S21", "k=16: batch invalid, TIS 4 vs no masks", b("k=16 strict, no masks + TIS 4", "batch_invalid@150"),
               b(K16, "batch_invalid@150")),
        *[paired(f"S{22 + i}", f"k=16: kl_tau {t} vs no masks (held-out success)", h(KL.format(t)), h(K16))
          for i, t in enumerate(("1e-4", "2e-3", "1e-2", "1e-1", "1"))],
        paired("S27", "k=16: batch success, kl_tau 1 vs no masks", b(KL.format("1")), b(K16)),
        paired("S28", "k=16: batch success, kl_tau 1e-1 vs no masks", b(KL.format("1e-1")), b(K16)),
        paired("S29", "k=16: batch success, kl_tau 1 vs k=0", b(KL.format("1")), b("k=0 sync")),
        trend("S30", "kl_tau dose at k=16: held-out success per decade of kl_tau (1e-4 to 1)", *kl_dose(a, s),
              "per decade"),
        paired("S31", "k=64: kl_tau 1e-2 vs no masks (held-out success)", h("k=64 strict, no masks + kl_tau 1e-2"),
               h("k=64 strict, no masks")),
        paired("S32", "k=64: kl_tau 1e-3 vs no masks (held-out success)", h("k=64 strict, no masks + kl_tau 1e-3"),
               h("k=64 strict, no masks")),
        paired("S33", "k=32: batch success, kl_tau 1e-2 vs 1e-3", b("k=32 strict, no masks + kl_tau 1e-2"),
               b("k=32 strict, no masks + kl_tau 1e-3")),
        paired("S34", "k=64: batch success, kl_tau 1e-2 vs 1e-3", b("k=64 strict, no masks + kl_tau 1e-2"),
               b("k=64 strict, no masks + kl_tau 1e-3")),
        paired("S35", "k=32: batch invalid, kl_tau 1e-2 vs 1e-3", b("k=32 strict, no masks + kl_tau 1e-2",
               "batch_invalid@150"), b("k=32 strict, no masks + kl_tau 1e-3", "batch_invalid@150")),
        paired("S36", "k=64: batch invalid, kl_tau 1e-2 vs 1e-3", b("k=64 strict, no masks + kl_tau 1e-2",
               "batch_invalid@150"), b("k=64 strict, no masks + kl_tau 1e-3", "batch_invalid@150")),
    ]
    mk = "k=16 strict, MIS [0.125, 8] + kl_tau {}"
    for i, (t, other, label) in enumerate((("1e-1", KL.format("1e-1"), "kl_tau 1e-1 alone"),
                                          ("2e-3", KL.format("2e-3"), "kl_tau 2e-3 alone"),
                                          ("2e-3", MIS.format("0.125, 8"), "MIS [0.125, 8] alone"),
                                          ("1e-4", KL.format("1e-4"), "kl_tau 1e-4 alone"),
                                          ("1e-4", MIS.format("0.125, 8"), "MIS [0.125, 8] alone"),
                                          ("1", KL.format("1"), "kl_tau 1 alone"))):  # fmt: skip
        rows.append(paired(f"S{37 + i}", f"k=16: MIS [0.125, 8] + kl_tau {t} vs {label}", h(mk.format(t)), h(other)))
    return rows


def offpolicy_gpu() -> list[Row]:
    g, c, s = study("offpolicy_search_gpu"), study("offpolicy_search"), 150
    hg = lambda arm: held(g[arm], s)  # noqa: E731
    hc = lambda arm: held(c[arm], s)  # noqa: E731
    d16 = "k=16 strict, default masks"
    rows = [
        paired("G1", "premise on the GPU (6 seeds, runs independent of the rate's choice)", hg(K16), hg("k=0 sync")),
        paired("G2", "batch success: k=16 no masks vs k=0", field(g[K16], "batch_success@150"),
               field(g["k=0 sync"], "batch_success@150")),
        paired("G3", "k=16: kl_tau 1 vs k=0", hg(KL.format("1")), hg("k=0 sync")),
        paired("G4", "k=16: kl_tau 1 vs no masks", hg(KL.format("1")), hg(K16)),
        paired("G5", "k=16: default masks vs no masks", hg(d16), hg(K16)),
    ]
    for i, arm in enumerate(("k=0 sync", K16, d16, KL.format("1"))):
        rows.append(unpaired(f"G{6 + i}", f"{arm}: GPU (6 seeds) vs CPU (3 seeds)", list(hg(arm).values()),
                             list(hc(arm).values())))
    return rows


def offpolicy_first_build() -> list[Row]:
    a, s = study("offpolicy_search_first_build"), 150
    h = lambda arm: held(a[arm], s)  # noqa: E731
    return [
        paired("F1", "premise at lr 5e-4 (the calibration that chose the rate)", h("k=16 strict, no masks, lr 5e-4"),
               h("k=0 sync, lr 5e-4")),
        paired("F2", "premise at lr 3e-4", h("k=16 strict, no masks, lr 3e-4"), h("k=0 sync, lr 3e-4")),
        paired("F3", "k=1 strict, no masks vs k=0", h("k=1 strict, no masks"), h("k=0 sync")),
        paired("F4", "k=0: lr 1e-3 vs lr 5e-4", h("k=0 sync, lr 1e-3"), h("k=0 sync, lr 5e-4")),
    ]


def offpolicy_happy() -> list[Row]:
    """experiments/offpolicy_experiment.py (happy_binary): policy reward per seed at a step."""
    data = json.loads(read("offpolicy.json"))
    pr = lambda run, step: {s: r["policy_reward"][str(step)] for s, r in data[run].items()}  # noqa: E731
    rows = [paired(f"H{i}", f"{run} vs k0, policy reward @100", pr(run, 100), pr("k0", 100), digits=2)
            for i, run in enumerate((r for r in data if r != "k0"), 1)]
    rows.append(paired("H8", "k16_strict_masks vs k0, policy reward @50", pr("k16_strict_masks", 50), pr("k0", 50),
                       digits=2))
    rows.append(paired("H9", "k1_strict_nomask vs k0, policy reward @25", pr("k1_strict_nomask", 25), pr("k0", 25),
                       digits=2))
    return rows


def offpolicy_page() -> list[str]:
    return (section("math", "Math (arithmetic, small operands, CPU; held-out accuracy @600)", offpolicy_math())
            + section("search", "Search (pinned build, CPU; held-out success @150 unless named)", offpolicy_search())
            + section("gpu", "Search on one GPU (6 seeds; held-out success @150)", offpolicy_gpu())
            + section("first_build", "Search, first build (not kept; held-out success @150)", offpolicy_first_build())
            + section("happy", "Earlier experiment: happy_binary (3 seeds)", offpolicy_happy()))  # fmt: skip


# --- gradient routing -------------------------------------------------------------------------------------------------


def routing_page() -> list[str]:
    one = read("routing.md")
    n = int(re.search(r"Final routing eval on (\d+) held-out prompts", one).group(1))
    t = {(r["arm"], r["mode"]): r for r in md_tables(one)[0]}
    hk, task = "hack rate (happy detector)", "task reward (sentence_length_5)"
    rate = lambda arm, mode: float(t[(arm, mode)][hk])  # noqa: E731
    base = ("base model (no adapters)", "-")
    one_seed = [
        rates("R1", "hack rate: routed retain_only vs base model", rate("routed", "retain_only"), n, rate(*base), n),
        rates("R2", "hack rate: routed both vs baseline both", rate("routed", "both"), n, rate("baseline", "both"), n),
        rates("R3", "hack rate: routed retain_only vs routed both", rate("routed", "retain_only"), n,
              rate("routed", "both"), n),
    ]

    def cells(name: str) -> dict[tuple[str, str], dict[str, list[float]]]:
        rows = md_tables(read(name))[0]
        return {(r["arm"], r["mode"]): {hk: three(r[hk]), task: three(r[task])} for r in rows}

    c, r5 = cells("routing_arms.md"), cells("routing_arms_recall0.5.md")
    arms = [
        unpaired("R4", "hack rate: plain LoRA both vs base model (plain LoRA forget_only)",
                 c[("plain_lora", "both")][hk],
                 c[("plain_lora", "forget_only")][hk]),
        *[unpaired(f"R{5 + i}", f"hack rate, both: {arm} vs plain LoRA", c[(arm, "both")][hk],
                   c[("plain_lora", "both")][hk]) for i, arm in enumerate(("routed", "filter", "reward_penalty"))],
        unpaired("R8", "hack rate: routed both vs base model", c[("routed", "both")][hk],
                 c[("plain_lora", "forget_only")][hk]),
        unpaired("R9", "hack rate: routed retain_only vs routed both", c[("routed", "retain_only")][hk],
                 c[("routed", "both")][hk]),
        *[unpaired(f"R{10 + i}", f"task reward: {arm} retain_only vs both", c[(arm, "retain_only")][task],
                   c[(arm, "both")][task]) for i, arm in enumerate(("routed", "filter", "reward_penalty"))],
        unpaired("R18", "hack rate: routed retain_only vs base model", c[("routed", "retain_only")][hk],
                 c[("plain_lora", "forget_only")][hk]),
        unpaired("R19", "hack rate: routed retain_only vs plain LoRA both", c[("routed", "retain_only")][hk],
                 c[("plain_lora", "both")][hk]),
    ]
    recall = [
        unpaired("R13", "recall 0.5, hack rate: routed retain_only vs routed both", r5[("routed", "retain_only")][hk],
                 r5[("routed", "both")][hk]),
        unpaired("R14", "recall 0.5, hack rate, both: routed vs plain LoRA", r5[("routed", "both")][hk],
                 r5[("plain_lora", "both")][hk]),
        unpaired("R15", "recall 0.5, hack rate, both: filter vs plain LoRA", r5[("filter", "both")][hk],
                 r5[("plain_lora", "both")][hk]),
        unpaired("R16", "recall 0.5, hack rate, both: reward penalty vs filter", r5[("reward_penalty", "both")][hk],
                 r5[("filter", "both")][hk]),
        unpaired("R17", "hack rate, routed retain_only: recall 0.5 vs recall 1", r5[("routed", "retain_only")][hk],
                 c[("routed", "retain_only")][hk]),
        unpaired("R20", "recall 0.5, hack rate, both: reward penalty vs plain LoRA", r5[("reward_penalty", "both")][hk],
                 r5[("plain_lora", "both")][hk]),
        unpaired("R21", "recall 0.5, hack rate: routed retain_only vs plain LoRA both",
                 r5[("routed", "retain_only")][hk],
                 r5[("plain_lora", "both")][hk]),
    ]
    note = ("routing_arms*.md keep the median and range of seeds 1, 2, 3 per cell, i.e. its three values, but not "
            "which seed gave which: these differences are unpaired.")
    return (section("one_seed", "Routed vs baseline, one seed (binomial SE over the held-out prompts)", one_seed)
            + section("arms", "Routing vs the baseline arms, perfect labels (3 seeds)", arms, note)
            + section("recall", "Half the hacks unlabelled (recall 0.5, 3 seeds)", recall, note))  # fmt: skip


# --- context distillation ---------------------------------------------------------------------------------------------


def distillation_page() -> list[str]:
    d = json.loads(read("distill.json"))
    n = int(re.search(r"fraction of (\d+) held-out prompts", read("distill.md")).group(1))
    m, runs = d["models"], d["runs"]
    r = lambda name: runs[name]["heldout_happy"]  # noqa: E731
    mood = [
        rates("D1", "builtin: teacher (context) vs student (happy rate)", m["builtin"]["teacher_happy"], n,
              m["builtin"]["student_happy"], n),
        rates("D2", "builtin_mood: teacher vs student", m["builtin_mood"]["teacher_happy"], n,
              m["builtin_mood"]["student_happy"], n),
        rates("D3", "pure distillation, 40 steps vs the student before training", r("pure distillation"), n,
              m["builtin_mood"]["student_happy"], n),
        rates("D4", "pure distillation, 160 steps vs the teacher", r("pure distillation, 160 steps"), n,
              m["builtin_mood"]["teacher_happy"], n),
        rates("D5", "hybrid (taus 1) vs pure distillation, 40 steps", r("hybrid"), n, r("pure distillation"), n),
        rates("D6", "hybrid, gated KL vs pure task RL", r("hybrid, gated KL"), n, r("pure task RL"), n),
        rates("D7", "token-level KL vs pure task RL", r("token-level KL"), n, r("pure task RL"), n),
        rates("D8", "hybrid, gated KL vs the teacher", r("hybrid, gated KL"), n, m["builtin_mood"]["teacher_happy"], n),
        rates("D9", "token-level KL vs the teacher", r("token-level KL"), n, m["builtin_mood"]["teacher_happy"], n),
    ]
    env = read("distill_env.md")
    k = int(re.search(r"(\d+) held-out maps", env).group(1))
    rows = {row["model"]: row for row in md_tables(env)[0]}
    sg = lambda model, col: [float(x) for x in re.findall(r"\d+\.\d+", rows[model][col])]  # noqa: E731
    stu, tea = "student (no hint): sampled / greedy", "teacher (hint): sampled / greedy"
    first = re.search(r"teacher (\d\.\d+) / (\d\.\d+) against student (\d\.\d+) /\s*(\d\.\d+)", env)
    ft, fs = (float(first.group(1)), float(first.group(2))), (float(first.group(3)), float(first.group(4)))
    envrows = []
    for i, (j, mode) in enumerate(((0, "sampled"), (1, "greedy"))):
        envrows += [
            rates(f"D{10 + 5 * i}", f"builtin_env: teacher (hint) vs student, {mode}", sg("builtin_env (no fine-tune)",
                  tea)[j], k, sg("builtin_env (no fine-tune)", stu)[j], k),
            rates(f"D{11 + 5 * i}", f"hint model: teacher vs student, {mode}", sg("hint model, step 0", tea)[j], k,
                  sg("hint model, step 0", stu)[j], k),
            rates(f"D{12 + 5 * i}", f"student after 80 steps of distillation vs before, {mode}",
                  sg("pure distillation, step 80", stu)[j], k, sg("hint model, step 0", stu)[j], k),
            rates(f"D{13 + 5 * i}", f"student after 80 steps vs the teacher, {mode}", sg("pure distillation, step 80",
                  stu)[j], k, sg("hint model, step 0", tea)[j], k),
            rates(f"D{14 + 5 * i}", f"first fine-tune (loss on every token): teacher vs student, {mode}", ft[j], k,
                  fs[j], k),
        ]
    return (section("mood", "builtin_mood (one seed per configuration; 256 held-out prompts)", mood)
            + section("frozenlake", "FrozenLake (one seed; 200 held-out maps)", envrows))  # fmt: skip


# --- environments -----------------------------------------------------------------------------------------------------


def per_seed_rows(name: str) -> list[dict[str, str]]:
    """The per-seed table (first table with a 'seed' column) of a result file."""
    return next(t for t in md_tables(read(name)) if t and "seed" in t[0])


def math_learns(name: str) -> dict[str, dict[str, dict[str, float]]]:
    """arm -> seed -> {greedy_before, sampled_before, greedy_after, sampled_after} from math_learns*.md."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for r in per_seed_rows(name):
        gb, sb = (float(x) for x in re.findall(r"\d+\.\d+", r["before"])[:2])
        ga, sa = (float(x) for x in re.findall(r"\d+\.\d+", r["after"])[:2])
        out.setdefault(r["arm"], {})[r["seed"]] = {"greedy_before": gb, "sampled_before": sb, "greedy_after": ga,
                                                   "sampled_after": sa}  # fmt: skip
    return out


def best_constant(name: str) -> float:
    return float(re.search(r"Best constant answer on these levels: (\d\.\d+)", read(name)).group(1))


def environments_page() -> list[str]:
    text = read("environments.md")
    raw = json.loads(re.search(r"```json\n(.*?)\n```", text, re.S).group(1))
    n_maps = raw["frozenlake_base"]["non-slippery"]["greedy"]["levels"]
    n_bandit = int(re.search(r"(\d+) held-out seeds", text).group(1))
    sft = raw["frozenlake_sft"]
    fl = lambda ice, mode: [sft[s][ice][mode]["success_rate"] for s in sorted(sft)]  # noqa: E731
    base = lambda ice, mode: raw["frozenlake_base"][ice][mode]["success_rate"]  # noqa: E731
    b_se = lambda p: st.binomial_se(p, n_maps)  # noqa: E731
    oracle = raw["frozenlake_oracle"]
    ragen = [
        against("E1", "FrozenLake non-slippery, greedy: after SFT vs before", fl("non-slippery", "greedy"),
                base("non-slippery", "greedy"), "before, greedy, same maps"),
        against("E2", "FrozenLake slippery, greedy: after SFT vs before", fl("slippery", "greedy"),
                base("slippery", "greedy"), "before, same maps, binomial", b_se(base("slippery", "greedy"))),
        against("E3", "FrozenLake slippery, greedy: after SFT vs the BFS-move oracle", fl("slippery", "greedy"),
                oracle["slippery"], "oracle, n=400, binomial", b_se(oracle["slippery"])),
        against("E4", "FrozenLake non-slippery, greedy: after SFT vs the BFS-move oracle",
                fl("non-slippery", "greedy"), oracle["non-slippery"], "oracle, deterministic, same maps"),
        against("E5", "bandit: share of the high-risk arm (dragon), after 30 steps vs before",
                [v["high"] for v in raw["bandit_after"].values()], raw["bandit_before"]["high"],
                "before, n=200, binomial",
                st.binomial_se(raw["bandit_before"]["high"], n_bandit)),
        against("E6", "bandit, names swapped: share of the high-risk arm (phoenix), after vs before",
                [v["high"] for v in raw["bandit_swapped_after"].values()], raw["bandit_swapped_before"]["high"],
                "before, n=200, binomial", st.binomial_se(raw["bandit_swapped_before"]["high"], n_bandit)),
    ]
    small, default = "math_learns.md", "math_learns_default_sft4096_st600.md"
    ms, md = math_learns(small), math_learns(default)
    col = lambda arms, arm, key, seeds=None: {s: v[key] for s, v in arms[arm].items()  # noqa: E731
                                               if seeds is None or s in seeds}
    arith = [
        paired("A1", "small operands, GRPO from builtin_env: greedy after vs before", col(ms, "rl", "greedy_after"),
               col(ms, "rl", "greedy_before")),
        paired("A2", "small operands, SFT then GRPO: greedy after vs before", col(ms, "sft_rl", "greedy_after"),
               col(ms, "sft_rl", "greedy_before")),
        paired("A3", "small operands, greedy after: SFT then GRPO vs GRPO from builtin_env (same seeds)",
               col(ms, "sft_rl", "greedy_after"), col(ms, "rl", "greedy_after")),
        against("A4", "small operands, GRPO from builtin_env, greedy after vs the best constant answer",
                list(col(ms, "rl", "greedy_after").values()), best_constant(small), "best constant",
                b_digits=4),
        against("A5", "as A4, seeds 1 and 2 only (the learning rate was chosen on seed 0)",
                list(col(ms, "rl", "greedy_after", {"1", "2"}).values()), best_constant(small), "best constant",
                b_digits=4),
        paired("A6", "default operands, GRPO from builtin_env: greedy after vs before", col(md, "rl", "greedy_after"),
               col(md, "rl", "greedy_before")),
        against("A7", "default operands, GRPO from builtin_env, greedy after vs the best constant answer",
                list(col(md, "rl", "greedy_after").values()), best_constant(default), "best constant",
                b_digits=4),
        paired("A8", "default operands, SFT then GRPO: greedy after vs before", col(md, "sft_rl", "greedy_after"),
               col(md, "sft_rl", "greedy_before")),
        paired("A9", "default operands, SFT then GRPO: sampled after vs before", col(md, "sft_rl", "sampled_after"),
               col(md, "sft_rl", "sampled_before")),
    ]

    def env_runs(name: str) -> dict[str, dict[str, dict[str, float]]]:
        out: dict[str, dict[str, dict[str, float]]] = {}
        for r in per_seed_rows(name):
            out.setdefault(r["arm"], {})[r["seed"]] = {k: float(v) for k, v in r.items()
                                                       if re.fullmatch(r"-?\d+\.\d+", v)}  # fmt: skip
        return out

    base_name = "routing_env_lr1e-3_bs32_st300_operand4_factor3"
    e1, e5 = env_runs(f"{base_name}.md"), env_runs(f"{base_name}_recall0.5.md")
    ex = env_runs(f"{base_name}_exclusive.md")
    e6 = env_runs("routing_env_lr3e-3_bs32_st600.md")
    v = lambda runs, arm, key: {s: r[key] for s, r in runs[arm].items()}  # noqa: E731
    routing = [
        paired("X1", "hack rate: baseline (trained) vs its forget_only (the base model)",
               v(e1, "baseline", "both hack"),
               v(e1, "baseline", "forget_only hack")),
        paired("X2", "retain_only hack rate: routed vs baseline", v(e1, "routed", "retain_only hack"),
               v(e1, "baseline", "retain_only hack")),
        paired("X3", "honest success: routed retain_only vs the base model", v(e1, "routed", "retain_only success"),
               v(e1, "baseline", "forget_only success")),
        paired("X4", "honest success: routed both vs the base model", v(e1, "routed", "both success"),
               v(e1, "baseline", "forget_only success")),
        paired("X5", "recall 0.5, hack rate: routed both vs baseline both", v(e5, "routed", "both hack"),
               v(e5, "baseline", "both hack")),
        paired("X6", "recall 0.5, hack rate: routed retain_only vs baseline", v(e5, "routed", "retain_only hack"),
               v(e5, "baseline", "retain_only hack")),
        paired("X7", "exclusive, hack rate: routed both vs baseline both", v(ex, "routed", "both hack"),
               v(ex, "baseline", "both hack")),
        paired("X8", "exclusive, hack rate: routed retain_only vs routed both", v(ex, "routed", "retain_only hack"),
               v(ex, "routed", "both hack")),
        paired("X9", "default operands (lr 3e-3, 600 steps), hack rate: baseline vs its forget_only",
               v(e6, "baseline", "both hack"), v(e6, "baseline", "forget_only hack")),
        paired("X10", "default operands, retain_only hack rate: routed vs baseline",
               v(e6, "routed", "retain_only hack"),
               v(e6, "baseline", "retain_only hack")),
        paired("X11", "default operands, honest success: routed retain_only vs the base model",
               v(e6, "routed", "retain_only success"), v(e6, "baseline", "forget_only success")),
    ]
    return (section("ragen", "RAGEN tasks (3 training seeds against one measurement before training)", ragen)
            + section("arithmetic", "Arithmetic that learns (3 seeds, paired by seed)", arith)
            + section("routing", "Routing on environments: a hackable grader (seeds 42, 43, 44, paired)", routing))


# --- report -----------------------------------------------------------------------------------------------------------

PAGES = {"offpolicy": offpolicy_page, "routing": routing_page, "distillation": distillation_page,
         "environments": environments_page}  # fmt: skip


def header(page: str) -> list[str]:
    return [f"# Effects: {page} (generated)", "",
            "Generated by `uv run python experiments/effects.py` from the result files of experiments/results/ (no "
            "training). A and B: mean ± standard error (n = seeds or runs; for one seed, the binomial SE of a rate "
            "over n evaluation items). A - B: paired by seed where the seeds pair, else unpaired (SE = sqrt(SE_A^2 + "
            "SE_B^2)). ±2 SE interval: A - B ± 2 SE. In SE: |A - B| / SE. Verdict: an effect at 2 SE or more, else "
            "no measurable difference, and no verdict on fewer than 3 values; counts of runs by Fisher's exact test "
            "(two-sided), an effect at p < 0.05. Values read from a table are its printed (rounded) values, so a "
            "difference can differ from the source table's in the last digit.", ""]  # fmt: skip


def render(page: str) -> str:
    """The text of experiments/results/effects_<page>.md."""
    return "\n".join(header(page) + PAGES[page]())


def main() -> None:
    for page in PAGES:
        (RESULTS / f"effects_{page}.md").write_text(render(page))
        print(f"wrote experiments/results/effects_{page}.md")


if __name__ == "__main__":
    main()
