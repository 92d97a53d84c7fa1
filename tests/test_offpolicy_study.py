"""experiments/offpolicy_study.py: arm labels from sweep values, step windows and the mean ± SE cells, by hand (no
model, no training); every shipped study sweep plans the arms the report expects."""

import importlib.util
import math
import sys
from collections import Counter
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "experiments" / "offpolicy_study.py"
_spec = importlib.util.spec_from_file_location("offpolicy_study", _PATH)
study = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = study  # its dataclass looks its module up there
_spec.loader.exec_module(study)


def test_arm_labels():
    strict16 = {"max_async_level": "16", "strict_async_level": "true"}
    assert study.arm_of({"max_async_level": "0", "learning_rate": "1e-4"}) == "k=0 sync, lr 1e-4"
    assert study.arm_of({**strict16, **study.NO_MASK}) == "k=16 strict, no masks"
    assert study.arm_of({"max_async_level": "8", "strict_async_level": "true"}) == "k=8 strict, default masks"
    assert study.arm_of({"max_async_level": "4"}) == "k=4 in-flight, default masks"
    assert study.arm_of({**strict16, **study.NO_MASK, "token_clip_high": "2"}) == "k=16 strict, no masks + TIS 2"
    mis_kl = {**strict16, **study.NO_MASK, "token_mask_low": "0.125", "token_mask_high": "8", "kl_tau": "1e-2"}
    assert study.arm_of(mis_kl) == "k=16 strict, MIS [0.125, 8] + kl_tau 1e-2"
    # The token window over the defaults is not "MIS": the other masks are on; the flags set are named.
    assert study.arm_of({**strict16, "token_mask_low": "0.5", "token_mask_high": "2"}) == (
        "k=16 strict, masks token_mask_low 0.5, token_mask_high 2")
    assert study.arm_of({**strict16, **study.NO_MASK, "learning_rate": "3e-4"}) == "k=16 strict, no masks, lr 3e-4"


def test_window_and_run_means():
    logs = [{"step": s, "env/success": s / 100} for s in (10, 20, 30, 40)] + [{"step": 50}]
    assert study.window_mean(logs, "env/success", 40, width=20) == pytest.approx((0.3 + 0.4) / 2)  # steps 30, 40
    assert study.window_mean(logs, "env/success", 40, width=5) == pytest.approx(0.4)
    assert study.window_mean(logs, "env/success", 5, width=5) is None
    assert study.run_mean(logs, "env/success") == pytest.approx(0.25)
    assert study.run_mean(logs, "offpolicy/masked_frac") is None


def test_cells():
    assert study.cell([0.2, 0.4, 0.6]) == f"0.400 ± {0.2 / math.sqrt(3):.3f}"
    assert study.cell([0.5]) == "0.500"
    assert study.cell([None, None]) == "-"
    assert study.cell([0.2, None, 0.4]) == "0.300 ± 0.100 (n=2)"  # stdev 0.1414, SE 0.1414 / sqrt(2)


THREE_SEEDS = {"k=0 sync, lr 1e-4", "k=0 sync, lr 3e-4", "k=16 strict, no masks, lr 1e-4",
               "k=16 strict, no masks, lr 3e-4"}  # fmt: skip  (math: the calibration's other rates; other arms have 5)


def study_arms(lrs: tuple[str, ...]) -> dict[str, list[str]]:
    """The issue's arms per command group (the calibration at the learning rates ``lrs``), in plan order."""
    return {
        "calibration": [f"k=0 sync, lr {lr}" for lr in lrs] + [f"k=16 strict, no masks, lr {lr}" for lr in lrs],
        "lag_nomask": ["k=0 sync"] + [f"k={k} strict, no masks" for k in (1, 4, 8, 16, 32, 64)],
        "defaults": [f"k={k} strict, default masks" for k in (1, 8, 16)]
        + [f"k={k} in-flight, default masks" for k in (1, 4)],
        "k16_rescues": [f"k=16 strict, no masks + TIS {c}" for c in (2, 4, 8)]
        + [f"k=16 strict, MIS [{lo}, {hi}]" for lo, hi in (("0.125", 8), ("0.25", 4), ("0.5", 2))]
        + [f"k=16 strict, no masks + kl_tau {t}" for t in ("1e-4", "2e-3", "1e-2", "1e-1", "1")]
        + [f"k=16 strict, MIS [0.125, 8] + kl_tau {t}" for t in ("1e-4", "2e-3", "1e-2", "1e-1", "1")],
        "kl_long_lag": [f"k={k} strict, no masks + kl_tau {t}" for k in (32, 64) for t in ("1e-3", "1e-2")],
    }


@pytest.mark.parametrize(("task", "lrs", "seeds"), [("math", ("1e-4", "2e-4", "3e-4"), 5),
                                                    ("search", ("3e-4", "5e-4", "1e-3"), 3)])  # fmt: skip
def test_study_sweeps_plan_the_seed_arms(task, lrs, seeds):
    """Each command group of each task plans the issue's arms, validated by train.py's parser: math 5 seeds per arm
    (3 for THREE_SEEDS), search 3."""
    expected = {f"offpolicy_{task}_{kind}": arms for kind, arms in study_arms(lrs).items()}
    assert tuple(expected) == study.TASKS[task].groups
    for group, arms in expected.items():
        runs = study.planned(group)
        labels = Counter(study.arm_of({k: v for k, v in r.values.items() if k != "seed"}) for r in runs)
        assert list(labels) == arms, group
        assert labels == {a: 3 if task == "math" and a in THREE_SEEDS else seeds for a in arms}, group
        assert {str(Path(r.run_dir).parent) for r in runs} == {study.TASKS[task].out}, group  # where the report reads


@pytest.mark.parametrize("task", ["math", "search"])
def test_heldout_evaluation_plays_the_trained_task(task):
    """The report evaluates on the environment, parameters, turn limit and turn length the sweeps train with."""
    from environments.base import parse_env_params
    from trl_ext.sweep import SweepArgs
    from trl_ext.sweep_plan import build_spec

    t = study.TASKS[task]
    for group in t.groups:
        fixed = build_spec(SweepArgs(config=str(study.SWEEPS / f"{group}.yaml"))).fixed
        assert fixed["env"] == t.env and parse_env_params(fixed["env_params"]) == t.env_params, group
        assert int(fixed.get("max_turns", 1)) == t.max_turns and int(fixed["max_completion_length"]) == t.max_new_tokens


def test_paired_deltas_and_reference_arm():
    run = lambda seed, acc: {"values": {"seed": seed}, "heldout": {600: acc}}  # noqa: E731
    arm = [run("0", 0.1), run("1", 0.3), run("2", 0.2)]
    ref = [run("1", 0.4), run("0", 0.4), {"values": {"seed": "2"}, "heldout": {400: 0.9}}]  # seed 2: no step 600
    assert study.paired_deltas(arm, ref, 600) == pytest.approx([-0.3, -0.1])
    assert study.paired_deltas(arm, [], 600) == []
    assert study.reference_arm("k=16 strict, no masks, lr 3e-4") == "k=0 sync, lr 3e-4"
    assert study.reference_arm("k=16 strict, no masks + TIS 2") == "k=0 sync"
