"""experiments/stats.py (mean, SE, paired and unpaired differences, Fisher's exact test, the 2 SE verdict) and
experiments/effects_rows.py's table readers, against hand-computed values (no model, no training)."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

_EXP = Path(__file__).resolve().parents[1] / "experiments"


_spec = importlib.util.spec_from_file_location("experiments_effects", _EXP / "effects.py")
effects = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = effects
_spec.loader.exec_module(effects)
rows = sys.modules["effects_rows"]  # experiments/effects_rows.py, imported by effects.py
st = rows.st  # experiments/stats.py


def test_mean_se_by_hand():
    m, se = st.mean_se([0.2, 0.4, 0.6])  # stdev 0.2 (n - 1), SE 0.2 / sqrt(3)
    assert m == pytest.approx(0.4) and se == pytest.approx(0.2 / math.sqrt(3))
    m, se = st.mean_se([0.5])
    assert m == 0.5 and math.isnan(se)
    with pytest.raises(ValueError):
        st.mean_se([])


def test_paired_difference_pairs_by_key():
    # common seeds 0, 1, 2: differences 0.3, 0.1, -0.1; mean 0.1, stdev 0.2; seed 3 has no partner
    d, se, n = st.paired_difference({"0": 0.5, "1": 0.3, "2": 0.1}, {"2": 0.2, "0": 0.2, "1": 0.2, "3": 9.0})
    assert (d, se, n) == (pytest.approx(0.1), pytest.approx(0.2 / math.sqrt(3)), 3)
    with pytest.raises(ValueError, match="no key"):
        st.paired_difference({"0": 1.0}, {"1": 1.0})


def test_unpaired_difference_adds_the_variances():
    # [1, 3]: mean 2, stdev sqrt(2), SE 1; [2, 2, 2]: mean 2, SE 0; difference 0 ± 1
    assert st.unpaired_difference([1, 3], [2, 2, 2]) == (pytest.approx(0.0), pytest.approx(1.0))
    # [0.1, 0.3]: SE 0.1; [0.5, 0.9]: SE 0.2; SE of the difference sqrt(0.01 + 0.04)
    d, se = st.unpaired_difference([0.1, 0.3], [0.5, 0.9])
    assert d == pytest.approx(-0.5) and se == pytest.approx(math.sqrt(0.05))


def test_binomial_se():
    assert st.binomial_se(0.5, 100) == pytest.approx(0.05)
    assert st.binomial_se(0.2, 25) == pytest.approx(0.08)
    assert st.binomial_se(0.0, 10) == 0.0
    with pytest.raises(ValueError):
        st.binomial_se(1.5, 10)


def test_fisher_exact_by_hand():
    # 0 of 15 against 2 of 5: P(0) = C(18, 15) / C(20, 15) = 816 / 15504 = 1/19; the tables with 1 and 2 in the first
    # row (0.395, 0.553) are more probable, so the two-sided p is P(0).
    assert st.fisher_exact(0, 15, 2, 3) == pytest.approx(1 / 19)
    # Fisher's tea tasting, [[3, 1], [1, 3]]: P(k) = C(4, k) C(4, 4 - k) / 70 = 1, 16, 36, 16, 1 (/ 70); p = 34 / 70
    assert st.fisher_exact(3, 1, 1, 3) == pytest.approx(34 / 70)
    # 2 of 5 against 1 of 5: every table is as probable as the observed one or less: p = 1
    assert st.fisher_exact(2, 3, 1, 4) == pytest.approx(1.0)
    assert st.fisher_exact(5, 0, 0, 5) == pytest.approx(2 / 252)  # C(10, 5) = 252; the two extreme tables
    with pytest.raises(ValueError):
        st.fisher_exact(-1, 1, 1, 1)


def test_verdict_and_z():
    assert st.verdict(0.2, 0.1) == "effect"  # exactly 2 SE
    assert st.verdict(-0.3, 0.1) == "effect"
    assert st.verdict(0.19, 0.1) == st.NO_DIFFERENCE
    assert st.verdict(0.1, 0.0) == "effect" and st.fmt_z(0.1, 0.0) == "inf"  # every seed moved by the same amount
    assert st.verdict(0.0, 0.0) == st.NO_DIFFERENCE and st.fmt_z(0.0, 0.0) == "-"
    assert st.verdict(0.5, float("nan")) == "no SE (one value)"
    assert st.verdict(0.5, 0.01, n=2) == "too few values (n=2) for a verdict"
    assert st.verdict(0.5, 0.01, n=3) == "effect"
    assert st.fmt_z(-0.177, 0.083) == "2.13"
    assert st.fisher_verdict(0.049) == "effect" and st.fisher_verdict(1 / 19) == st.NO_DIFFERENCE


def test_formatting():
    assert st.fmt_mean_se([0.2, 0.4, 0.6]) == "0.400 ± 0.115 (n=3)"
    assert st.fmt_mean_se([0.5]) == "0.500 (n=1)"
    assert st.fmt_diff(-0.1773, 0.0831) == "-0.177 ± 0.083"
    assert st.fmt_diff(0.0064, 0.0027, 4) == "+0.0064 ± 0.0027"


def test_rows_by_hand():
    row = rows.paired("X", "a vs b", {"0": 0.5, "1": 0.3, "2": 0.1}, {"0": 0.2, "1": 0.2, "2": 0.2})
    assert row.line() == ("| X | a vs b | 0.300 ± 0.115 (n=3) | 0.200 ± 0.000 (n=3) | +0.100 ± 0.115 (paired, n=3) "
                          "| [-0.131, +0.331] | 0.87 | no measurable difference |")
    row = rows.counts("Y", "invalid", 0, 15, 2, 5)
    assert (row.a, row.b, row.diff, row.verdict, row.interval) == ("0/15 runs", "2/5 runs", "Fisher exact p = 0.053",
                                                                   st.NO_DIFFERENCE, "-")
    row = rows.rates("Z", "one seed", 0.5, 100, 0.3, 100)  # SEs 0.05 and 0.0458; difference 0.2 ± 0.0678
    assert row.diff == "+0.200 ± 0.068 (binomial, one seed)" and row.z == "2.95" and row.verdict == "effect"
    row = rows.against("W", "vs a constant", [0.4, 0.5, 0.6], 0.2, "best constant", b_digits=4)
    assert (row.b, row.diff, row.verdict) == ("0.2000 (best constant)", "+0.300 ± 0.058 (n=3)", "effect")
    row = rows.against("V", "vs a sampled rate", [0.4, 0.5, 0.6], 0.2, "before", b_se=0.04)  # hypot(0.0577, 0.04)
    assert (row.b, row.diff) == ("0.200 ± 0.040 (before)", "+0.300 ± 0.070 (n=3)")


def test_table_readers():
    text = "intro\n\n| arm | v |\n|---|---|\n| a | 0.1 |\n| b | 0.2 |\n\ntext\n| x |\n|---|\n| 1 |\n"
    assert rows.md_tables(text) == [[{"arm": "a", "v": "0.1"}, {"arm": "b", "v": "0.2"}], [{"x": "1"}]]
    assert rows.three("0.782 (0.721-0.792)") == [0.721, 0.782, 0.792]  # the range's hyphen is not a sign
    assert rows.three("-0.703 [-0.984, -0.105]") == [-0.984, -0.703, -0.105]
    with pytest.raises(ValueError):
        rows.three("0.5")
