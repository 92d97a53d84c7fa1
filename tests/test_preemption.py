"""Preemption (trl_ext/runs/preemption.py): SIGTERM saves a complete checkpoint of the current step and exits 0, and
``--resume_from_checkpoint latest`` continues the run. End to end on the builtin model: one process (full fine-tune,
bit for bit against an uninterrupted run; off-policy k = 1; SFT mode), two processes under torchrun, and the sweep's
handling of a preempted child."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zygote
from transformers import TrainerControl, TrainerState

from trl_ext.launch.command import torchrun_command
from trl_ext.runs.checkpoints import MARKER, is_complete, list_checkpoints
from trl_ext.runs.preemption import PreemptionCallback, preemption_handler

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--reward", "happy_binary", "--batch_size", "8", "--num_generations", "4", "--max_completion_length", "24",
        "--max_steps", "6", "--save_steps", "2", "--logging_steps", "1", "--no_wandb", "--lr", "3e-4"]
KEYS = ("loss", "reward", "kl", "grad_norm", "learning_rate", "num_tokens")


# ------------------------------------------------------------------------------------------ in process
def _step_end(callback: PreemptionCallback, step: int) -> TrainerControl:
    state = TrainerState(global_step=step, max_steps=10)
    return callback.on_step_end(None, state, TrainerControl())


def test_sigterm_sets_a_flag_and_the_next_step_boundary_saves_and_stops(capsys):
    before = signal.getsignal(signal.SIGTERM)
    with preemption_handler() as flag:
        callback = PreemptionCallback(flag)
        control = _step_end(callback, 3)
        assert not control.should_save and not control.should_training_stop and callback.stopped_at is None
        os.kill(os.getpid(), signal.SIGTERM)  # the process survives: the handler only records it
        os.kill(os.getpid(), signal.SIGTERM)  # a second one (as while saving) changes nothing
        assert flag.requested and flag.count == 2
        control = _step_end(callback, 4)
        assert control.should_save and control.should_training_stop and callback.stopped_at == 4
        assert "saving checkpoint-4 (step 4 of 10) and stopping" in capsys.readouterr().out
        assert not _step_end(callback, 5).should_save  # decided once
        summary = callback.summary(Path("/r"), 4)
        assert summary["status"] == "preempted" and summary["checkpoint"] == "/r/checkpoint-4"
        assert callback.notice(4, 10, Path("/r")) == ("preempted at step 4 of 10: /r/checkpoint-4 is complete; continue "
                                                      "with the same command and --resume_from_checkpoint latest")
    assert signal.getsignal(signal.SIGTERM) is before  # restored outside the training run


class _TwoRanks:
    """An accelerator of 2 processes whose other rank has (``other=1``) or has not received SIGTERM."""

    num_processes, device = 2, "cpu"

    def __init__(self, other: int):
        self.other, self.calls = other, 0

    def reduce(self, tensor, reduction):
        assert reduction == "sum"
        self.calls += 1
        return tensor + self.other


def test_every_rank_stops_when_any_rank_was_signalled(capsys):
    """The flag is all-reduced at every step boundary (each rank calls it, signalled or not)."""
    with preemption_handler() as flag:
        quiet = PreemptionCallback(flag, _TwoRanks(other=0))
        assert not _step_end(quiet, 2).should_training_stop and quiet.accelerator.calls == 1
        other = PreemptionCallback(flag, _TwoRanks(other=1))  # this rank saw nothing, the other did
        control = _step_end(other, 2)
        assert control.should_save and control.should_training_stop and other.stopped_at == 2
    assert "SIGTERM received (on another process); saving checkpoint-2" in capsys.readouterr().out


PREEMPTED_CHILD = """
import json, sys
from pathlib import Path
from trl_ext.runs.checkpoints import mark_complete
d = Path(sys.argv[sys.argv.index("--dir") + 1])
if "--resume_from_checkpoint" in sys.argv:
    (d / "run_summary.json").write_text(json.dumps({"status": "done", "steps": 6, "wall_s": 1.0, "final_log": {}}))
else:  # stopped by SIGTERM: a complete checkpoint, exit 0
    (d / "checkpoint-3").mkdir(parents=True)
    (d / "checkpoint-3" / "trainer_state.json").write_text(json.dumps({"global_step": 3, "log_history": []}))
    mark_complete(d / "checkpoint-3", 3)
    (d / "run_summary.json").write_text(json.dumps({"status": "preempted", "steps": 3}))
"""


def test_sweep_resumes_a_preempted_child(tmp_path, monkeypatch):
    """A child that exits 0 as "preempted" is listed PREEMPTED (not done); the next sweep resumes it."""
    from trl_ext import sweep

    script = tmp_path / "child.py"
    script.write_text(PREEMPTED_CHILD)
    monkeypatch.setattr(sweep, "TRAIN_SCRIPT", script)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    run_dir, sweep_dir = tmp_path / "out" / "run0", tmp_path / "out" / "sweeps" / "s"
    runs = [sweep.PlannedRun(0, {"i": "0"}, ["--dir", str(run_dir)], run_dir)]
    res, said = sweep.Resources([], 1, 1, None), []
    results, _ = sweep.execute(runs, sweep_dir, res, status_every=60, log_tail=5, say=said.append)
    assert [(r.status, r.returncode, r.steps) for r in results] == [("PREEMPTED", 0, 3)]
    assert not sweep.is_done(run_dir)
    results, _ = sweep.execute(runs, sweep_dir, res, status_every=60, log_tail=5, say=said.append)
    assert [(r.status, r.launched) for r in results] == [("done", True)]
    assert f"[sweep] unfinished run resumes from {run_dir / 'checkpoint-3'}" in said
    assert "--resume_from_checkpoint latest" in (sweep_dir / "logs" / "run0.log").read_text()


# ------------------------------------------------------------------------------------------ end to end
def start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        return zygote.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(predicate, proc: subprocess.Popen, log: Path, what: str, timeout: float = 300):
    deadline = time.time() + timeout
    while not (found := predicate()):
        assert proc.poll() is None, f"ended before {what}: {log.read_text()[-3000:]}"
        assert time.time() < deadline, what
        time.sleep(0.005)
    return found


def checkpoint_done(out: Path, step: int):
    return lambda: next((p.parents[1] for p in out.glob(f"*/checkpoint-{step}/{MARKER}")), None)


def preempt(cmd: list[str], out: Path, pids) -> tuple[Path, subprocess.Popen, Path]:
    """Start ``cmd``; once checkpoint 2 is complete, SIGTERM the processes ``pids(proc)`` names, and again while the
    preemption checkpoint is being saved. Returns (run directory, the finished process, its log)."""
    log = out.with_name(out.name + ".log")
    proc = start(cmd, log)
    run_dir = wait_for(checkpoint_done(out, 2), proc, log, "checkpoint 2")
    targets = pids(proc)
    for pid in targets:
        os.kill(pid, signal.SIGTERM)
    wait_for(lambda: "preempted: SIGTERM received" in log.read_text(), proc, log, "the preemption notice", 120)
    for pid in targets:  # the second SIGTERM lands while the checkpoint is written (or just after)
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    proc.wait(timeout=120)
    return run_dir, proc, log


def check_preempted(run_dir: Path, proc: subprocess.Popen, log: Path) -> int:
    """Exit 0, run_summary.json "preempted" at step s < 6, checkpoint-s complete and the newest; returns s."""
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    summary = json.loads((run_dir / "run_summary.json").read_text())
    step = summary["steps"]
    assert summary["status"] == "preempted" and 3 <= step < 6, summary
    assert summary["checkpoint"] == str(run_dir / f"checkpoint-{step}") and is_complete(summary["checkpoint"])
    assert [s for s, _, done in list_checkpoints(run_dir) if done][-1] == step
    assert all(done for _, _, done in list_checkpoints(run_dir))
    train_log = (run_dir / "train.log").read_text()
    assert f"saving checkpoint-{step} (step {step} of 6)" in train_log and f"preempted at step {step} of 6" in train_log
    return step


def history(run_dir: Path, step: int = 6) -> dict[int, dict]:
    state = json.loads((run_dir / f"checkpoint-{step}" / "trainer_state.json").read_text())
    return {row["step"]: row for row in state["log_history"] if "loss" in row}


def train_py(out: Path, *flags: str) -> list[str]:
    return [sys.executable, "train.py", *BASE, *flags, "--output_dir", str(out)]


def resume(out: Path, *flags: str) -> Path:
    proc = zygote.run(train_py(out, *flags, "--resume_from_checkpoint", "latest"), cwd=ROOT, capture_output=True,
                          text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (run_dir,) = out.iterdir()
    summary = json.loads((run_dir / "run_summary.json").read_text())
    assert summary["status"] == "done" and summary["steps"] == 6
    return run_dir


@pytest.mark.slow
def test_sigterm_then_resume_matches_uninterrupted(builtin_path, tmp_path):
    """One process, full fine-tune: SIGTERM in step 3 or later -> checkpoint of that step, exit 0; the resumed run's
    per-step logs equal the uninterrupted run's exactly."""
    ref = zygote.run(train_py(tmp_path / "a"), cwd=ROOT, capture_output=True, text=True)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run_dir, proc, log = preempt(train_py(tmp_path / "b"), tmp_path / "b", lambda p: [p.pid])
    step = check_preempted(run_dir, proc, log)
    resume(tmp_path / "b")
    assert (run_dir / "train.log").read_text().count("RESUMED from") == 1
    expected, resumed = history(next((tmp_path / "a").iterdir())), history(run_dir)
    assert sorted(resumed) == list(range(1, 7))
    assert any(expected[s]["reward_std"] > 0 for s in range(step + 1, 7))  # resumed steps with a learning signal
    for s in range(1, 7):
        assert {k: resumed[s][k] for k in KEYS} == {k: expected[s][k] for k in KEYS}, (s, step)


@pytest.mark.slow
def test_sigterm_offpolicy_stops_the_generator_and_resumes(builtin_path, tmp_path):
    """Off-policy k = 1: the generator thread stops (the process exits 0) and the resumed run reaches max_steps with
    the lag bound kept."""
    flags = ["--max_async_level", "1"]
    run_dir, proc, log = preempt(train_py(tmp_path / "b", *flags), tmp_path / "b", lambda p: [p.pid])
    check_preempted(run_dir, proc, log)
    resume(tmp_path / "b", *flags)
    resumed = history(run_dir)
    assert sorted(resumed) == list(range(1, 7)) and all(r["offpolicy/policy_lag_max"] <= 1 for r in resumed.values())


def _workers(agent: subprocess.Popen) -> list[int]:
    """The train.py processes torchrun's agent started (its children)."""
    deadline = time.time() + 60
    while True:
        children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
        if len(children) == 2 or time.time() > deadline:
            return [int(c) for c in children]
        time.sleep(0.05)


def two_process_args(out: Path, *flags: str) -> list[str]:
    return ["train.py", *BASE, "--batch_size", "4", *flags, "--output_dir", str(out)]


@pytest.mark.slow
def test_sigterm_two_processes_then_resume_matches_uninterrupted(tmp_path):
    """torchrun, 2 processes: SIGTERM to each rank -> both stop after the same step, one complete checkpoint with
    both ranks' RNG states, every rank exits 0 (so torchrun does); resumed on 2 processes, the per-step logs equal
    an uninterrupted 2-process run's exactly."""
    ref = zygote.torchrun(two_process_args(tmp_path / "a"), cwd=ROOT, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run_dir, proc, log = preempt(torchrun_command(two_process_args(tmp_path / "b")), tmp_path / "b", _workers)
    step = check_preempted(run_dir, proc, log)
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in (run_dir / f"checkpoint-{step}").iterdir()}
    again = zygote.torchrun(two_process_args(tmp_path / "b", "--resume_from_checkpoint", "latest"), cwd=ROOT,
                            timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((run_dir / "run_summary.json").read_text())["status"] == "done"
    expected, resumed = history(next((tmp_path / "a").iterdir())), history(run_dir)
    assert sorted(resumed) == list(range(1, 7))
    assert any(expected[s]["reward_std"] > 0 for s in range(step + 1, 7))  # resumed steps with a learning signal
    for s in range(1, 7):
        assert {k: resumed[s][k] for k in KEYS} == {k: expected[s][k] for k in KEYS}, (s, step)


SFT = ["--mode", "sft", "--env", "arithmetic", "--model", "builtin_env", "--sft_train_size", "64", "--sft_test_size",
       "4", "--sft_epochs", "10", "--batch_size", "8", "--num_generations", "8", "--max_completion_length", "8",
       "--save_steps", "2", "--logging_steps", "1", "--no_wandb", "--lr", "1e-3"]  # fmt: skip  (64 / 8 x 10 = 80 steps)


@pytest.mark.slow
def test_sigterm_sft_mode_then_resume(tmp_path):
    """--mode sft: SIGTERM -> a complete checkpoint of the current step, status preempted, exit 0 and no model saved;
    the resumed run trains the remaining steps (every step logged once) and saves the merged model."""
    from trl_ext.models.builtin_env import ensure_builtin_env

    ensure_builtin_env()
    out = tmp_path / "s"
    cmd = [sys.executable, "train.py", *SFT, "--output_dir", str(out)]
    run_dir, proc, log = preempt(cmd, out, lambda p: [p.pid])
    assert proc.returncode == 0, log.read_text()[-3000:]
    summary = json.loads((run_dir / "run_summary.json").read_text())
    step = summary["steps"]
    assert summary["status"] == "preempted" and summary["mode"] == "sft" and 3 <= step < 80, summary
    assert summary["checkpoint"] == str(run_dir / f"checkpoint-{step}") and is_complete(summary["checkpoint"])
    assert not (run_dir / "model").exists()
    assert f"preempted at step {step} of 80" in (run_dir / "train.log").read_text()
    again = zygote.run([*cmd, "--resume_from_checkpoint", "latest"], cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    summary = json.loads((run_dir / "run_summary.json").read_text())
    assert summary["status"] == "done" and (run_dir / "model" / "config.json").is_file()
    state = json.loads((run_dir / "checkpoint-80" / "trainer_state.json").read_text())
    assert [h["step"] for h in state["log_history"] if "loss" in h] == list(range(1, 81))
