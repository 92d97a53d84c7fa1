"""experiments/math_learns.py: the statistics and the table, against hand-computed values (no model, no training)."""

import argparse
import importlib.util
import math
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "experiments" / "math_learns.py"
_spec = importlib.util.spec_from_file_location("math_learns", _PATH)
ml = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ml)


def test_mean_se_by_hand():
    m, se = ml.mean_se([0.2, 0.4, 0.6])  # stdev 0.2, SE 0.2 / sqrt(3)
    assert m == pytest.approx(0.4) and se == pytest.approx(0.2 / math.sqrt(3))
    m, se = ml.mean_se([0.5])
    assert m == 0.5 and math.isnan(se)


def test_fmt_signs_only_when_a_value_is_negative():
    assert ml.fmt([0.25, 0.35]) == "0.300 ± 0.050"
    assert ml.fmt([-0.1, 0.3]) == "+0.100 ± 0.200"


def test_best_constant():
    assert ml.best_constant([0, 0, 1, 2]) == 0.5
    assert ml.best_constant([7]) == 1.0


def test_heldout_best_constant_of_small_operands():
    """The reference quoted in the report: answer 0 on 89 of the 400 held-out levels."""
    answers = ml.heldout_answers({"max_operand": 4, "max_factor": 3})
    assert len(answers) == 400 and max(answers) <= 9 and ml.best_constant(answers) == 89 / 400


def _row(before: tuple, after: tuple) -> dict:
    ev = lambda g, s: {"greedy": g, "sampled": s, "distinct_greedy": 3}  # noqa: E731
    return {"before": ev(*before), "after": ev(*after), "curve": [[200, after[0]]], "rl_wall_s": 10.0}


def test_summary_rows_pair_the_seeds():
    per = {"0": _row((0.3, 0.2), (0.5, 0.4)), "1": _row((0.2, 0.2), (0.5, 0.3))}
    # greedy: before 0.3, 0.2; after 0.5, 0.5; deltas 0.2, 0.3
    assert ml.summary_rows(per, "greedy") == ["0.250 ± 0.050", "0.500 ± 0.000", "0.250 ± 0.050"]
    assert ml.summary_rows(per, "sampled") == ["0.200 ± 0.000", "0.350 ± 0.050", "0.150 ± 0.050"]


def test_report_has_one_summary_and_one_row_per_seed():
    args = argparse.Namespace(seeds=[0, 1], arms=["rl", "sft_rl"], steps=600, lr="1e-4",
                              env_params="max_operand=4,max_factor=3", sft_levels=1024)
    res = {"rl": {"0": _row((0.0, 0.0), (0.3, 0.3)), "1": _row((0.0, 0.0), (0.2, 0.1))}}
    text = ml.report(res, args, 0.2225)
    assert "| rl | builtin_env | 2 | 0.000 ± 0.000 | 0.250 ± 0.050 | 0.250 ± 0.050 |" in text
    assert "| rl | 1 | 0.000 / 0.000 [3] | 0.200 / 0.100 [3] | 200: 0.200 | - | 10.0 |" in text
    assert "sft_rl |" not in text and "0.2225" in text
