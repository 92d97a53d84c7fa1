"""Run lifecycle pieces with no model: checkpoint markers, resume resolution, the run-directory guard, rollout
shards and numeric-fault checks."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml

from trl_ext.naming import is_defining
from trl_ext.registry import ConfigError
from trl_ext.runs import checkpoints as ck
from trl_ext.runs import rollouts as ro
from trl_ext.runs.faults import NumericFault, check_rewards, first_nonfinite
from trl_ext.runs.rundir import check_run_dir, move_incomplete_checkpoints, previous_run

CONFIG = {"RunArgs": {"reward": "happy_binary", "no_wandb": True},
          "ExtGRPOConfig": {"learning_rate": 1e-4, "logging_steps": 1, "output_dir": "x", "max_steps": 4}}


def _ckpt(run_dir, step, complete=True, config=CONFIG):
    path = run_dir / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_text("w")
    (path / ck.RUN_CONFIG).write_text(yaml.safe_dump(config))
    if complete:
        ck.mark_complete(path, step)
    return path


def test_latest_is_the_newest_complete_checkpoint(tmp_path):
    assert ck.latest_complete(tmp_path / "missing") is None
    _ckpt(tmp_path, 2)
    _ckpt(tmp_path, 10)
    _ckpt(tmp_path, 12, complete=False)  # killed mid-write: never taken
    (tmp_path / "checkpoint-x").mkdir()
    assert [(s, c) for s, _, c in ck.list_checkpoints(tmp_path)] == [(2, True), (10, True), (12, False)]
    assert ck.latest_complete(tmp_path).name == "checkpoint-10"  # numeric order, not lexical
    assert json.loads((tmp_path / "checkpoint-10" / ck.MARKER).read_text())["step"] == 10
    assert not list(tmp_path.glob("checkpoint-10/.*.tmp"))


class _KilledMidWrite(OSError):
    pass


def _dying_writes(monkeypatch, under):
    """Every file opened for writing under ``under`` gets half of what is written to it, then the writer dies (a
    process killed, a full disk): what a reader sees afterwards is what a kill mid-write leaves."""
    import builtins

    real_open = builtins.open

    class Dying:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            self.f.write(text[: len(text) // 2])
            self.f.flush()
            raise _KilledMidWrite("killed while writing")

        def __getattr__(self, name):
            return getattr(self.f, name)

    def dying_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return Dying(f) if "w" in mode and str(file).startswith(str(under)) else f

    monkeypatch.setattr(builtins, "open", dying_open)


def test_interrupted_marker_write_leaves_no_marker(tmp_path, monkeypatch):
    """The marker is written to a temporary file and renamed: a write killed half way leaves no marker (the
    checkpoint stays incomplete) and leaves an existing file whole, never a half-written one."""
    ckpt = tmp_path / "checkpoint-3"
    ckpt.mkdir()
    kept = tmp_path / "kept.json"
    ck.write_atomic(kept, '{"old": true}')
    _dying_writes(monkeypatch, tmp_path)
    with pytest.raises(_KilledMidWrite):
        ck.mark_complete(ckpt, 3)
    assert not ck.is_complete(ckpt) and ck.latest_complete(tmp_path) is None
    with pytest.raises(_KilledMidWrite):
        ck.write_atomic(kept, '{"new": true, "longer": "than the old text"}')
    assert json.loads(kept.read_text()) == {"old": True}


def test_resolve_resume_errors(tmp_path):
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        ck.resolve_resume("latest", tmp_path)
    _ckpt(tmp_path, 3, complete=False)
    with pytest.raises(ConfigError, match=r"incomplete, never resumed from: checkpoint-3"):
        ck.resolve_resume("latest", tmp_path)
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        ck.resolve_resume(str(tmp_path / "checkpoint-3"), tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        ck.resolve_resume(str(tmp_path / "checkpoint-9"), tmp_path)
    good = _ckpt(tmp_path, 4)
    assert ck.resolve_resume("latest", tmp_path) == good == ck.resolve_resume(str(good), tmp_path)


def test_config_differences_name_defining_values_only():
    changed = {"RunArgs": {**CONFIG["RunArgs"], "no_wandb": False},
               "ExtGRPOConfig": {**CONFIG["ExtGRPOConfig"], "logging_steps": 5, "output_dir": "y",
                                 "learning_rate": 3e-4, "beta": 0.1}}
    diffs = ck.config_differences(CONFIG, changed, is_defining)
    assert diffs == ["beta: checkpoint '<absent>', command 0.1", "learning_rate: checkpoint 0.0001, command 0.0003"]


def test_check_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    assert check_run_dir(run_dir, None, False, CONFIG) is None  # fresh
    run_dir.mkdir()
    (run_dir / "train.log").write_text("old")
    assert previous_run(run_dir) == "train.log"
    with pytest.raises(ConfigError, match=r"already holds a run \(train.log\).*--resume_from_checkpoint latest.*"
                                          r"--overwrite_run"):
        check_run_dir(run_dir, None, False, CONFIG)
    assert check_run_dir(run_dir, None, True, CONFIG) is None  # overwrite allowed (moving is the caller's)
    c2, c4 = _ckpt(run_dir, 2), _ckpt(run_dir, 4)
    assert check_run_dir(run_dir, "latest", False, CONFIG) == c4
    with pytest.raises(ConfigError, match="exclude each other"):
        check_run_dir(run_dir, "latest", True, CONFIG)
    with pytest.raises(ConfigError, match=r"newer checkpoints \(checkpoint-4\)"):
        check_run_dir(run_dir, str(c2), False, CONFIG)
    other = {**CONFIG, "ExtGRPOConfig": {**CONFIG["ExtGRPOConfig"], "max_steps": 8}}
    with pytest.raises(ConfigError, match="max_steps: checkpoint 4, command 8"):
        check_run_dir(run_dir, "latest", False, other)
    relaxed = {**CONFIG, "ExtGRPOConfig": {**CONFIG["ExtGRPOConfig"], "logging_steps": 7}}
    assert check_run_dir(run_dir, "latest", False, relaxed) == c4  # logging is not run-defining


def test_incomplete_checkpoints_are_moved_not_deleted(tmp_path):
    _ckpt(tmp_path, 2)
    partial = _ckpt(tmp_path, 4, complete=False)
    moved = move_incomplete_checkpoints(tmp_path)
    assert not partial.exists() and len(moved) == 1 and (moved[0] / "model.safetensors").is_file()
    assert moved[0].name.startswith("incomplete-checkpoint-4-")
    assert ck.latest_complete(tmp_path).name == "checkpoint-2"


# --------------------------------------------------------------------------- rollouts
def test_split_segments_at_turn_boundaries():
    ids, trained = [5, 6, 7, 8, 9, 10], [1, 1, 0, 0, 1, 0]
    segs = ro.split_segments(ids, trained, lambda xs: "-".join(map(str, xs)))
    assert segs == [{"source": "agent", "text": "5-6"}, {"source": "env", "text": "7-8"},
                    {"source": "agent", "text": "9"}, {"source": "env", "text": "10"}]
    assert ro.split_segments([], [], str) == []
    assert ro.split_segments([5, 1], [1, 0], lambda xs: "" if xs == [1] else "a") == [{"source": "agent", "text": "a"}]


def test_sequence_values_and_sums():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert ro.sequence_values(torch.tensor([0.5, -1.0]), mask) == [0.5, -1.0]
    assert ro.sequence_values(torch.tensor([[1.0, 3.0, 100.0], [2.0, 100.0, 100.0]]), mask) == [2.0, 2.0]
    assert ro.masked_sums(torch.tensor([[1.0, 3.0, 100.0], [2.0, 100.0, 100.0]]), mask) == [4.0, 2.0]


def _row(step, n=2, **over):
    cols = {"step": [step] * n, "sample": list(range(n)), "group": [0] * n, "prompt": ["p"] * n,
            "completion": ["c"] * n, "segments": [[{"source": "agent", "text": "c"}]] * n, "reward": [1.0] * n,
            "reward/r": [1.0] * n, "advantage": [0.0] * n, "completion_tokens": [3] * n,
            **{k: [None] * n for k in ro.OPTIONAL_COLUMNS}}
    cols.update(over)
    return cols


def test_shards_load_together_and_late_ones_are_discarded(tmp_path, capsys):
    feats = ro.features(["r"], [])
    for step in (1, 2, 3):
        versions = {"policy_version_min": [step - 1] * 2} if step == 2 else {}
        ro.write_shard(ro.shard_path(tmp_path, step), _row(step, **versions), feats)
    everything = ro.load_rollouts(tmp_path)
    assert len(everything) == 6 and everything.features == feats
    one = ro.load_rollouts(tmp_path, step=2)
    assert one["policy_version_min"] == [1, 1] and one["is_rh"] == [None, None]
    with pytest.raises(FileNotFoundError, match=r"saved: steps 1\.\.3"):
        ro.load_rollouts(tmp_path, step=9)
    assert ro.main([str(tmp_path), "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert "step 2, 2 rollouts" in out and "policy_version_min=1" in out and "agent: c" in out
    folder = ro.discard_after(tmp_path, 1)
    assert sorted(p.name for p in folder.iterdir()) == ["step-000002-rank0.parquet", "step-000003-rank0.parquet"]
    assert sorted(ro.shard_steps(tmp_path)) == [1] and ro.discard_after(tmp_path, 1) is None


# --------------------------------------------------------------------------- numeric faults
def test_first_nonfinite():
    assert first_nonfinite(torch.zeros(2, 3)) is None
    t = torch.tensor([[0.0, 1.0], [math.inf, math.nan]])
    assert first_nonfinite(t) == (1, 0)


def test_check_rewards_names_function_step_and_completion():
    check_rewards(torch.tensor([[1.0, 0.0], [0.5, 2.0]]), ["a", "b"], ["x", "y"], step=3)
    with pytest.raises(NumericFault, match=r"step 7: reward function 'b' returned nan .*completion 1: 'bad one'"):
        check_rewards(torch.tensor([[1.0, 0.0], [0.5, math.nan]]), ["a", "b"], ["ok", "bad one"], step=7)
    with pytest.raises(NumericFault, match="rewards of shape"):
        check_rewards(torch.zeros(3, 2), ["a", "b"], ["x", "y"], step=1)
