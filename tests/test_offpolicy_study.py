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



def sweep_flags(group: str) -> dict:
    """The flags every run of sweep ``group`` shares: its recipes' (recipes/offpolicy_*.toml), then its fixed values."""
    from trl_ext.runs.recipe import load_recipe
    from trl_ext.sweep import SweepArgs
    from trl_ext.sweep_plan import build_spec

    spec = build_spec(SweepArgs(config=str(study.SWEEPS / f"{group}.yaml")))
    return {**{k: v for path in spec.recipes for k, v in load_recipe(Path(path)).flags.items()}, **spec.fixed}

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


def test_gpu_replication_plans_its_arms_with_the_cpu_study_settings():
    """The GPU replication plans k = 0, strict k = 16 without masks, with the default masks and with kl_tau 1, 6 seeds
    each, with the CPU search study's fixed settings (its model, task, batch, steps, rate) apart from the output
    directory, so that its arms are comparable with the CPU study's."""
    from trl_ext.sweep import SweepArgs
    from trl_ext.sweep_plan import build_spec

    t = study.TASKS["search_gpu"]
    assert t.groups == ("offpolicy_search_gpu_replication",) and t.device != study.TASKS["search"].device
    runs = study.planned(t.groups[0])
    labels = Counter(study.arm_of({k: v for k, v in r.values.items() if k != "seed"}) for r in runs)
    assert labels == {"k=0 sync": 6, "k=16 strict, no masks": 6, "k=16 strict, default masks": 6,
                      "k=16 strict, no masks + kl_tau 1": 6}  # fmt: skip
    assert {str(Path(r.run_dir).parent) for r in runs} == {t.out}

    def fixed(group: str) -> dict:
        spec = build_spec(SweepArgs(config=str(study.SWEEPS / f"{group}.yaml")))
        return {k: v for k, v in spec.fixed.items() if k != "output_dir"}

    assert fixed(t.groups[0]) == fixed("offpolicy_search_lag_nomask")


def test_pending_lists_complete_checkpoints_without_an_evaluation(tmp_path, monkeypatch):
    """The checkpoints a report still has to evaluate: complete ones (checkpoint_complete.json) whose cache key is
    not in evals.json; an incomplete checkpoint and an evaluated one are left out."""
    from types import SimpleNamespace

    monkeypatch.setattr(study, "ROOT", tmp_path)
    for run, step, complete in (("a", 50, True), ("a", 100, False), ("b", 50, True), ("b", 100, True)):
        ckpt = tmp_path / "out" / run / f"checkpoint-{step}"
        ckpt.mkdir(parents=True)
        if complete:
            (ckpt / "checkpoint_complete.json").write_text("{}")
    runs = [SimpleNamespace(run_dir="out/a"), SimpleNamespace(run_dir="out/b")]
    evals = {"out/b/checkpoint-50|200": 0.1, "out/b/checkpoint-100|400": 0.2}  # another level count is another key
    assert study.pending(runs, evals, 200) == {"out/a/checkpoint-50|200": tmp_path / "out/a/checkpoint-50",
                                               "out/b/checkpoint-100|200": tmp_path / "out/b/checkpoint-100"}


@pytest.mark.slow
@pytest.mark.parametrize("jobs", [1, 2])
def test_parallel_evaluation_equals_the_in_process_one(tmp_path, monkeypatch, jobs):
    """``--jobs``: the worker processes (spawned), like the report's own process, give each checkpoint the held-out
    success ``heldout_success`` computes, and cache it under its key in evals.json. 20 levels, on which the pinned
    build succeeds at least once, so that a worker returning nothing could not match."""
    import json
    import shutil

    t = study.TASKS["search_gpu"]
    model = study.ROOT / "experiments/models/builtin_search-7693a12a"
    todo = {}
    for name in ("a", "b"):
        todo[f"{name}|20"] = tmp_path / name
        shutil.copytree(model, tmp_path / name)
    monkeypatch.setattr(study.Task, "evals", property(lambda self: tmp_path / "evals.json"))
    evals = {}
    study.evaluate_pending(t, todo, evals, 20, jobs=jobs)
    expected = study.heldout_success(t, model, 20)
    assert expected > 0
    assert evals == {"a|20": expected, "b|20": expected}
    assert json.loads((tmp_path / "evals.json").read_text()) == evals


@pytest.mark.parametrize("task", ["math", "search", "search_gpu"])
def test_heldout_evaluation_plays_the_trained_task(task):
    """The report evaluates on the environment, parameters, turn limit and turn length the sweeps train with."""
    from environments.base import parse_env_params

    t = study.TASKS[task]
    for group in t.groups:
        fixed = sweep_flags(group)
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


def test_ols_slope_by_hand():
    # xs 0, 1, 2; ys 0, 1, 3: Sxx = 2, Sxy = 3, slope 1.5; residuals 1/6, -1/3, 1/6, SSE = 1/6; SE = sqrt(1/6 / 1 / 2).
    slope, se = study.ols_slope([0, 1, 2], [0, 1, 3])
    assert slope == pytest.approx(1.5) and se == pytest.approx(math.sqrt(1 / 12))
    assert study.ols_slope([0, 1, 2, 3], [5, 3, 1, -1]) == pytest.approx((-2.0, 0.0))  # on a line: SE 0
    for xs, ys in (([0, 1], [0, 1]), ([1, 1, 1], [0, 1, 2])):
        with pytest.raises(ValueError, match="needs >= 3 points"):
            study.ols_slope(xs, ys)


def test_lag_trend_reads_k0_and_strict_no_mask_runs_only():
    def runs(*vals):
        return [{"heldout": {150: v}} for v in vals]

    arms = {"k=0 sync": runs(0.6, 0.4), "k=1 strict, no masks": runs(0.5), "k=3 strict, no masks": runs(0.3, None),
            "k=3 strict, default masks": runs(9.0), "k=3 strict, no masks, lr 1e-3": runs(9.0),
            "k=3 strict, no masks + TIS 2": runs(9.0)}  # fmt: skip
    # x = log2(k + 1): 0, 0, 1, 2 against 0.6, 0.4, 0.5, 0.3: mean x 0.75, mean y 0.45, Sxx 2.75, Sxy -0.25.
    slope, se, n = study.lag_trend(arms, lambda r: r["heldout"].get(150))
    assert n == 4 and slope == pytest.approx(-0.25 / 2.75)
    resid = [y - 0.45 - slope * (x - 0.75) for x, y in ((0, 0.6), (0, 0.4), (1, 0.5), (2, 0.3))]
    assert se == pytest.approx(math.sqrt(sum(e * e for e in resid) / 2 / 2.75))
    assert study.lag_trend({"k=0 sync": runs(0.6, 0.4, 0.5)}, lambda r: r["heldout"][150]) is None  # one lag


def test_archived_runs_stand_in_for_missing_run_directories(tmp_path):
    """A run whose directory is not on this machine is read from the previous report's JSON, per (group, directory):
    one directory planned by two groups keeps each group's values; a run directory with checkpoints wins; an archived
    run whose values differ from the plan, or summarised at another step, is refused."""
    import json

    def summary(seed, acc, **kw):
        return {"dir": "d" + seed, "values": {"max_async_level": "0", "seed": seed, **kw}, "status": "done",
                "heldout": {"50": acc, "150": acc}, "batch_success@150": acc, "batch_reward@150": acc,
                "batch_invalid@150": 0.0}

    path = tmp_path / "results.json"
    path.write_text(json.dumps({"calibration": [summary("0", 0.1, learning_rate="5e-4")], "lag": [summary("0", 0.2)]}))
    archive = study.archived(path)
    assert set(archive) == {("calibration", "d0"), ("lag", "d0")}
    assert archive[("lag", "d0")]["heldout"] == {50: 0.2, 150: 0.2}  # steps are integers again
    assert study.archived(tmp_path / "none.json") == {}

    missing = {"dir": "d0", "values": {"max_async_level": "0", "seed": "0"}, "status": "not finished", "logs": [],
               "heldout": {}, "start_weights": None}
    fresh = study.run_summary(missing, 150, 50)
    merged = study.merge(missing, fresh, archive[("lag", "d0")], 150)
    assert merged["from_archive"] and merged["heldout"] == {50: 0.2, 150: 0.2} and merged["status"] == "done"
    assert study.merge(missing, fresh, None, 150) is fresh  # nothing archived: the run stays unfinished
    assert study.merge(missing, fresh, {**missing, "status": "not finished"}, 150) is fresh  # nor unfinished

    on_disk = {**missing, "status": "done", "heldout": {50: 0.3}, "logs": [{"step": 150, "env/success": 0.5}]}
    mine = study.run_summary(on_disk, 150, 50)
    assert study.merge(on_disk, mine, archive[("lag", "d0")], 150) is mine
    assert mine["batch_success@150"] == 0.5

    with pytest.raises(SystemExit, match="has values"):
        study.merge(missing, fresh, archive[("calibration", "d0")], 150)
    with pytest.raises(SystemExit, match="another step"):
        study.merge(missing, fresh, archive[("lag", "d0")], 600)


def test_start_weights_line_counts_and_refuses_two_starting_points():
    """Finished runs report their one recorded starting point, counting those that predate the record (archived rows
    without the key included); two recorded starting points end the report; unfinished runs do not count."""
    def run(name, weights, done=True, **extra):
        return {"dir": name, "heldout": {150: 0.1} if done else {}, "start_weights": weights, **extra}

    old_row = {"dir": "old", "heldout": {150: 0.1}}  # an archive row written before runs recorded start weights
    assert study.start_weights_line([run("a", None), old_row]) == (
        "Start weights: none of the 2 finished runs records them (they predate the record).")
    line = study.start_weights_line([run("a", "7693"), run("b", "7693"), run("c", None), old_row, run("d", "x", False)])
    assert line == "Start weights: `7693` in 2 of 4 finished runs; 2 predate the record."
    assert study.start_weights_line([run("a", "7693")]) == "Start weights: `7693` in 1 of 1 finished runs."
    with pytest.raises(SystemExit, match=r"different weights: 7693 \(1 runs, e.g. a\); 0ff \(2 runs, e.g. b\)"):
        study.start_weights_line([run("a", "7693"), run("b", "0ff"), run("c", "0ff")])


def test_table_reads_run_summaries():
    """The group table's cells come from the runs' summaries: held-out marks, the paired Δ, batch windows, the count
    of runs that ended invalid, the run means; unfinished runs are counted beside the finished ones."""
    def run(k, seed, acc, invalid, masked=None):
        return {"dir": f"k{k}s{seed}", "values": {"max_async_level": k, "strict_async_level": "true", **study.NO_MASK,
                                                  "seed": seed} if k != "0" else {"max_async_level": "0", "seed": seed},
                "status": "done", "heldout": {150: acc}, "batch_success@150": acc, "batch_reward@150": acc,
                "batch_invalid@150": invalid, "masked_frac": masked, "token_clipped_frac": masked,
                "abs_log_ratio_mean": masked, "mismatch_kl": masked}

    k0 = [run("0", "0", 0.2, 0.0), run("0", "1", 0.4, 0.0)]
    k16 = [run("16", "0", 0.0, 0.75, 0.0), run("16", "1", 0.2, 0.25, 0.0),
           {**run("16", "2", 0.0, 0.0), "status": "not finished", "heldout": {}}]
    arms = {"k=0 sync": k0, "k=16 strict, no masks": k16[:2]}
    lines = study.table(k0 + k16, [150], arms, "success")
    assert lines[2].startswith("| k=0 sync | 2 | 0.300 ± 0.100 | - | 0.300 ± 0.100 |")
    row = lines[3].split(" | ")
    assert row[0:3] == ["| k=16 strict, no masks", "2 (+1 not finished)", "0.100 ± 0.100"]
    assert row[3] == "-0.200 ± 0.000"  # paired by seed: 0.0 - 0.2, 0.2 - 0.4
    assert row[4:7] == ["0.100 ± 0.100", "0.100 ± 0.100", "0.500 ± 0.250"]
    assert row[7] == "1/2"  # invalid >= 0.5 in one run
    assert row[8] == "0.000 ± 0.000"
    one = study.table(k0 + k16[:1], [150], arms, "success")[3].split(" | ")
    assert one[1:4] == ["1", "0.000", "-0.200"]  # one seed: its values, no standard error


def test_search_study_pins_its_committed_starting_model():
    """Every search sweep trains from one committed builtin_search build (a rebuild on another machine differs), and
    the directory's name, its build_info.json and its weights agree on the hash."""
    import hashlib
    import json


    models = {sweep_flags(g)["model"] for name in ("search", "search_gpu") for g in study.TASKS[name].groups}
    assert len(models) == 1
    path = study.ROOT / models.pop()
    weights = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    assert json.loads((path / "build_info.json").read_text())["weights_sha256"] == weights
    assert path.name == f"builtin_search-{weights[:8]}"


def test_delta_column_in_standard_errors_with_the_verdict():
    """The tables' last column: the paired Δ in standard errors and experiments/stats.py's verdict (2 SE or more: an
    effect; fewer than 3 pairs: no verdict; one pair: no SE)."""
    assert study.delta_z([-0.3, -0.1]) == "2.00 (too few values (n=2) for a verdict)"  # mean -0.2, SE 0.1
    assert study.delta_z([-0.3, -0.1, -0.2]) == "3.46 (effect)"  # mean -0.2, SE 0.1 / sqrt(3)
    assert study.delta_z([0.1, -0.1, 0.05]) == "0.28 (no measurable difference)"  # mean 0.0167 / SE 0.0601 = 0.277
    assert study.delta_z([-0.2]) == "-" and study.delta_z([]) == "-"
    lines = study.table([{"dir": "a", "values": {"max_async_level": "0", "seed": "0"}, "status": "done",
                          "heldout": {150: 0.2}, "batch_success@150": 0.2, "batch_reward@150": 0.2,
                          "batch_invalid@150": 0.0, "masked_frac": None, "token_clipped_frac": None,
                          "abs_log_ratio_mean": None, "mismatch_kl": None}], [150], {}, "success")
    assert lines[0].endswith("| mismatch-KL | Δ/SE |") and lines[2].endswith("| - | - |")


def test_sections_and_the_start_record_in_the_json():
    """Snippet section markers (the docs include ``offpolicy_search.md:<group>``), and the starting model's held-out
    value kept under the JSON's '_start' key, which the archive reader skips."""
    import json

    assert study.section("offpolicy_math_calibration", "start") == "<!-- --8<-- [start:offpolicy_math_calibration] -->"
    for name in ("math", "search", "search_gpu"):
        text = (study.RESULTS / f"{study.TASKS[name].results}.md").read_text()
        for group in study.TASKS[name].groups + ("lag_trend",):
            assert f"[start:{group}]" in text and f"[end:{group}]" in text, (name, group)
    assert study.TASKS["search"].start == "experiments/models/builtin_search-7693a12a"
    assert study.TASKS["search_gpu"].start is None and study.TASKS["math"].start is None  # not pinned / other device
    path = study.RESULTS / "offpolicy_search.json"
    start = json.loads(path.read_text())["_start"]
    assert start["model"] == study.TASKS["search"].start and start["n_eval"] == 200
    assert f"held-out success {start['heldout']:.3f}" in (study.RESULTS / "offpolicy_search.md").read_text()
    assert all(not g.startswith("_") for g, _ in study.archived(path))
