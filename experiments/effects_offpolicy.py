"""The off-policy studies' comparisons (math, search, the GPU replication, the first search build, happy_binary),
for experiments/effects.py."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules, when imported by path (tests)

from effects_rows import (  # noqa: E402
    K16,
    _load,
    KL,
    MIS,
    Row,
    against,
    counts,
    field,
    held,
    invalid_count,
    lag_slope,
    paired,
    read,
    section,
    study,
    trend,
    unpaired,
)


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
