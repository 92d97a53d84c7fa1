"""Runs survive interruption, end to end on the builtin models: a run killed with SIGKILL right after checkpoint 2
(in step 3) and resumed with ``--resume_from_checkpoint latest`` logs exactly what the uninterrupted run logs; no
silent overwrite; saved rollouts; numeric faults stop the run after saving the last good state."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zygote
import torch
from datasets import Dataset

from trl_ext.config import train_config
from trl_ext.models import load_tokenizer, prepare_tokenizer
from trl_ext.models.builtin_mood import ensure_builtin_mood
from trl_ext.runs.checkpoints import MARKER, latest_complete, list_checkpoints
from trl_ext.runs.faults import NumericFault
from trl_ext.runs.rollouts import load_rollouts
from trl_ext.trainer import ExtGRPOTrainer

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--reward", "happy_binary", "--batch_size", "8", "--num_generations", "4", "--max_completion_length", "24",
        "--max_steps", "6", "--save_steps", "2", "--logging_steps", "1", "--no_wandb", "--lr", "3e-4"]
KIND = {
    "full": [],
    "lora": ["--lora_rank", "4"],
    "routed": ["--reward", "sentence_length_5_with_happy", "--gradient_routing", "--routing_mode", "shared",
               "--lora_config", "r4", "--eval_routing_steps", "3", "--eval_routing_prompts", "4"],
    "offpolicy": ["--max_async_level", "1"],
}
KEYS = ("loss", "reward", "kl", "grad_norm", "learning_rate")


def train(out: Path, *flags: str, check=True) -> subprocess.CompletedProcess:
    proc = zygote.run([sys.executable, "train.py", *flags, "--output_dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def wait_for_checkpoint(out: Path, step: int, proc: subprocess.Popen, log: Path) -> Path:
    """Poll until checkpoint ``step`` of the run under ``out`` is complete (its marker exists)."""
    deadline = time.time() + 300
    while not (done := list(out.glob(f"*/checkpoint-{step}/{MARKER}"))):
        assert proc.poll() is None, f"ended before checkpoint {step}: {log.read_text()[-3000:]}"
        assert time.time() < deadline
        time.sleep(0.002)
    return done[0].parents[1]


def kill_after_checkpoint(out: Path, flags: list[str], step: int) -> Path:
    """Start train.py, SIGKILL it as soon as checkpoint ``step`` is complete; return the run directory."""
    log = out.with_name(out.name + ".log")
    with open(log, "w") as f:
        proc = zygote.Popen([sys.executable, "train.py", *flags, "--output_dir", str(out)], cwd=ROOT,
                                stdout=f, stderr=subprocess.STDOUT)  # fmt: skip
    run_dir = wait_for_checkpoint(out, step, proc, log)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert not (run_dir / "run_summary.json").exists()  # really interrupted before the end
    return run_dir


def history(run_dir: Path, step: int = 6) -> dict[int, dict]:
    state = json.loads((run_dir / f"checkpoint-{step}" / "trainer_state.json").read_text())
    return {row["step"]: row for row in state["log_history"] if "loss" in row}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["full", "lora", "routed", "offpolicy"])
def test_sigkill_and_resume_matches_uninterrupted(builtin_path, tmp_path, kind):
    flags = [*BASE, *KIND[kind], "--save_rollouts"]
    ref_dir = next((tmp_path / "a").glob("*")) if train(tmp_path / "a", *flags) else None
    run_dir = kill_after_checkpoint(tmp_path / "b", flags, step=2)
    refused = train(tmp_path / "b", *flags, check=False)  # the same command again would overwrite it
    assert refused.returncode == 2 and "already holds a run" in refused.stderr and "--overwrite_run" in refused.stderr
    train(tmp_path / "b", *flags, "--resume_from_checkpoint", "latest")

    log = (run_dir / "train.log").read_text()
    assert log.count("RESUMED from") == 1 and log.index("RESUMED from") > log.index("run dir:")
    assert log.index("as at this run's start") > log.index("RESUMED from")  # start weights checked (provenance)
    assert json.loads((run_dir / "run_summary.json").read_text())["steps"] == 6
    ref, resumed = history(ref_dir), history(run_dir)
    assert sorted(resumed) == list(range(1, 7))
    if kind == "offpolicy":  # a new queue from the resumed policy: right step count, lag within k
        assert all(resumed[s]["offpolicy/policy_lag_max"] <= 1 for s in range(1, 7))
        ro = load_rollouts(run_dir, step=4)
        assert set(ro["policy_version_max"]) <= {2, 3} and min(ro["policy_version_min"]) >= 2
        return
    for step in range(3, 7):
        for key in KEYS:
            assert math.isclose(resumed[step][key], ref[step][key], rel_tol=0, abs_tol=1e-6), (step, key)
    ref_ro, res_ro = load_rollouts(ref_dir), load_rollouts(run_dir)
    assert len(ref_ro) == 6 * 8 and ref_ro["completion"] == res_ro["completion"]
    assert ref_ro["advantage"] == res_ro["advantage"]
    if kind == "routed":
        assert res_ro["is_bad"] == ref_ro["is_bad"] and None not in res_ro["is_rh"]
        evals = [json.loads(line)["step"] for line in (run_dir / "routing_eval.jsonl").read_text().splitlines()]
        assert evals[-2:] == [3, 6]


def _train_py_pids(marker: str, sweep: int) -> list[int]:
    """The train.py processes of runs under ``marker`` started by the sweep of pid ``sweep``: by their command line,
    or (a run forked by the tests' fork server, whose command line is the server's) by the files under ``marker``
    they hold open."""
    pids = []
    for proc_dir in Path("/proc").iterdir():
        try:
            cmd = (proc_dir / "cmdline").read_bytes().split(b"\0")
            if any(c.endswith(b"zygote_server.py") for c in cmd) and proc_dir.name not in ("self", str(sweep)):
                opened = [os.readlink(fd) for fd in (proc_dir / "fd").iterdir()]
                if any(f.startswith(marker + "/") for f in opened):
                    pids.append(int(proc_dir.name))
        except (OSError, ValueError):
            continue
        if any(c.endswith(b"train.py") for c in cmd) and any(marker.encode() in c for c in cmd):
            pids.append(int(proc_dir.name))
    return pids


@pytest.mark.slow
def test_sweep_resumes_a_killed_child(builtin_path, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # CPU slots (--parallel), whatever the caller exported
    out = tmp_path / "s"
    fixed = [f"{f.lstrip('-')}={v}" for f, v in zip(BASE[2::2], BASE[3::2]) if f != "--no_wandb"]
    argv = [sys.executable, "sweep.py", "--reward", "happy_binary", "--grid", "seed=5", "--fixed", *fixed,
            f"output_dir={out}", "--train_flags", "no_wandb", "--parallel", "1", "--status_every", "600"]
    log = tmp_path / "sweep.log"
    with open(log, "w") as f:
        sweep = zygote.Popen(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, nested=True)
    run_dir = wait_for_checkpoint(out, 2, sweep, log)
    (pid,) = _train_py_pids(str(out), sweep.pid)
    os.kill(pid, signal.SIGKILL)
    assert sweep.wait(timeout=120) == 1 and "FAILED" in log.read_text()
    again = zygote.run(argv, cwd=ROOT, capture_output=True, text=True, nested=True)
    assert again.returncode == 0, again.stdout[-3000:]
    assert f"unfinished run resumes from {run_dir / 'checkpoint-2'}" in again.stdout
    # The reference is the same sweep uninterrupted (a sweep child's thread settings are the sweep's own).
    uninterrupted = [a.replace(str(out), str(tmp_path / "u")) for a in argv]
    assert zygote.run(uninterrupted, cwd=ROOT, capture_output=True, text=True, nested=True).returncode == 0
    ref, resumed = history(next(p for p in (tmp_path / "u").iterdir() if p.name == run_dir.name)), history(run_dir)
    assert sorted(resumed) == list(range(1, 7))
    for step in range(1, 7):
        assert all(math.isclose(resumed[step][k], ref[step][k], rel_tol=0, abs_tol=1e-6) for k in KEYS), step


@pytest.mark.slow
def test_saved_rollouts_schema_and_reader(builtin_path, tmp_path):
    run_dir_parent = tmp_path / "r"
    train(run_dir_parent, *BASE, "--max_steps", "2", "--eval_rewards", "happy_count", "--save_rollouts")
    (run_dir,) = run_dir_parent.iterdir()
    ro = load_rollouts(run_dir)
    assert len(ro) == 16 and sorted(set(ro["step"])) == [1, 2]
    for row in ro:
        text = row["completion"]
        assert row["reward"] == row["reward/happy_binary"] == float("happy" in text.split())
        assert row["eval_reward/happy_count"] == text.split().count("happy")
        assert [s["source"] for s in row["segments"]] == ["agent"] and row["segments"][0]["text"] == text
        assert row["policy_version_min"] is None and row["is_rh"] is None and 1 <= row["completion_tokens"] <= 24
    for group in range(2):  # GRPO advantages are centred per group
        adv = [a for a, g, s in zip(ro["advantage"], ro["group"], ro["step"]) if g == group and s == 1]
        assert len(adv) == 4 and abs(sum(adv)) < 1e-5
    reader = subprocess.run([sys.executable, "-m", "trl_ext.runs.rollouts", str(run_dir), "--step", "2", "--n", "1"],
                            cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert reader.returncode == 0 and "step 2, 8 rollouts" in reader.stdout and "prompt: " in reader.stdout


@pytest.mark.slow
def test_overwrite_moves_the_old_run_aside(builtin_path, tmp_path):
    flags = [*BASE, "--max_steps", "2"]
    train(tmp_path, *flags)
    (run_dir,) = tmp_path.iterdir()
    first = (run_dir / "train.log").read_text()
    out = train(tmp_path, *flags, "--overwrite_run")
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(run_dir.name + ".old-")]
    assert len(aside) == 1 and (aside[0] / "train.log").read_text() == first and latest_complete(aside[0])
    assert "previous run was moved to" in out.stdout and (run_dir / "run_summary.json").is_file()


def test_resume_errors_exit_2_before_the_model_loads(train_cli_error, tmp_path):
    from trl_ext.cli_train import build_plan
    from trl_ext.runlog import write_run_config
    from trl_ext.runs.checkpoints import mark_complete

    flags = [*BASE, "--output_dir", str(tmp_path)]
    err = train_cli_error(*flags, "--resume_from_checkpoint", str(tmp_path / "nope"))
    assert "does not exist" in err
    assert "no complete checkpoint" in train_cli_error(*flags, "--resume_from_checkpoint", "latest")
    plan = build_plan(flags)  # a checkpoint of this run, but written by a run with another learning rate
    ckpt = plan.run_dir / "checkpoint-2"
    ckpt.mkdir(parents=True)
    other = build_plan([*flags, "--lr", "1e-3"])
    write_run_config(ckpt / "run_config.yaml", other.run, other.cfg)
    mark_complete(ckpt, 2)
    err = train_cli_error(*flags, "--resume_from_checkpoint", "latest")
    assert "learning_rate: checkpoint 0.001, command 0.0003" in err
    assert "already holds a run (checkpoint-2)" in train_cli_error(*flags)
    assert "exclude each other" in train_cli_error(*flags, "--resume_from_checkpoint", "latest", "--overwrite_run")


# --------------------------------------------------------------------------- numeric faults, in process
def _trainer(builtin_path, tmp_path, reward, **over):
    cfg = {**dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2,
                  max_completion_length=6, max_steps=3, beta=0.0, learning_rate=1e-3, logging_steps=1,
                  save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0), **over}  # fmt: skip
    tok = prepare_tokenizer(load_tokenizer(builtin_path))
    return ExtGRPOTrainer(model=str(builtin_path), reward_funcs=[reward], args=train_config(**cfg),
                          train_dataset=Dataset.from_dict({"prompt": ["Ben was a quiet owl", "Lily felt"] * 8}),
                          processing_class=tok)  # fmt: skip


def test_nan_reward_names_function_step_and_completion(builtin_path, tmp_path):
    def flaky(completions, trainer_state, **kwargs):
        return [math.nan if trainer_state.global_step == 1 and i == 2 else 1.0 for i in range(len(completions))]

    trainer = _trainer(builtin_path, tmp_path, flaky)
    with pytest.raises(NumericFault, match=r"step 2: reward function 'flaky' returned nan .* completion 2: '"):
        trainer.train()

    def short(completions, **kwargs):
        return [0.0]

    with pytest.raises(NumericFault, match=r"step 1: .*'short' returned 1 rewards, but 4 were expected"):
        _trainer(builtin_path, tmp_path / "2", short).train()


@pytest.mark.parametrize("where", ["loss", "gradient norm"])
def test_nan_loss_or_grad_norm_saves_last_good_state(builtin_path, tmp_path, where):
    def varied(completions, **kwargs):
        return [float(len(c)) for c in completions]

    trainer = _trainer(builtin_path, tmp_path, varied)
    compute_loss, weights = trainer.compute_loss, {}

    def poisoned(model, inputs, *args, **kwargs):
        loss = compute_loss(model, inputs, *args, **kwargs)
        if trainer.state.global_step == 1:
            weights.update({k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
            if where == "loss":
                return loss * math.nan
            param = next(p for p in trainer.model.parameters() if p.requires_grad)
            param.register_hook(lambda g: torch.full_like(g, math.inf))
        return loss

    trainer.compute_loss = poisoned
    with pytest.raises(NumericFault, match=rf"step 2: the {where} is (nan|inf).*after step 1"):
        trainer.train()
    ckpt = tmp_path / "out" / "checkpoint-1"
    marker = json.loads((ckpt / MARKER).read_text())
    assert marker["step"] == 1 and where in marker["fault"]
    from safetensors.torch import load_file

    saved = load_file(ckpt / "model.safetensors")
    assert all(torch.equal(saved[k], weights[k]) for k in saved)  # the weights after step 1, not the faulty update


@pytest.mark.slow
def test_sft_mode_resumes_exactly(tmp_path):
    flags = ["--mode", "sft", "--env", "frozenlake", "--model", "builtin_env", "--sft_train_size", "24",
             "--sft_test_size", "2", "--sft_epochs", "2", "--batch_size", "8", "--num_generations", "4", "--save_steps", "3",
             "--logging_steps", "1", "--lr", "1e-3", "--no_wandb"]  # fmt: skip
    train(tmp_path / "a", *flags)
    ref_dir = next((tmp_path / "a").iterdir())
    run_dir = kill_after_checkpoint(tmp_path / "b", flags, step=3)
    train(tmp_path / "b", *flags, "--resume_from_checkpoint", "latest")
    last = max(s for s, _, _ in list_checkpoints(ref_dir))
    ref, resumed = history(ref_dir, last), history(run_dir, last)
    assert last > 3 and sorted(ref) == sorted(resumed) == list(range(1, last + 1))
    for step in range(4, last + 1):
        for key in ("loss", "grad_norm", "learning_rate"):
            assert math.isclose(resumed[step][key], ref[step][key], rel_tol=0, abs_tol=1e-6), (step, key)
    assert "RESUMED from" in (run_dir / "train.log").read_text()
    assert json.loads((run_dir / "run_summary.json").read_text())["status"] == "done"


@pytest.mark.slow
def test_distillation_rollouts_carry_the_teacher_and_student_sums(tmp_path):
    """Saved sums reproduce the full-reward advantage R - mean_group(R), R = task + 0.5 T - 0.25 S (distill.py)."""
    train(tmp_path, *BASE, "--max_steps", "1", "--model", "builtin_mood", "--teacher_model", "builtin_mood",
          "--teacher_context", "A happy story.", "--teacher_tau", "0.5", "--student_tau", "0.25", "--save_rollouts")
    run_dir = next(tmp_path.iterdir())
    mood = hashlib.sha256((ensure_builtin_mood() / "model.safetensors").read_bytes()).hexdigest()
    start = json.loads((run_dir / "start_weights.json").read_text())  # the teacher is part of the start
    assert start["files"] == start["teacher"]["files"] == {"model.safetensors": mood}
    ro = load_rollouts(run_dir).to_pandas()
    assert (ro["teacher_logprob_sum"] < 0).all() and (ro["student_logprob_sum"] < 0).all()
    assert not ro["teacher_logprob_sum"].equals(ro["student_logprob_sum"])
    full = ro["reward"] + 0.5 * ro["teacher_logprob_sum"] - 0.25 * ro["student_logprob_sum"]
    expected = full - full.groupby(ro["group"]).transform("mean")
    assert (expected - ro["advantage"]).abs().max() < 1e-4


@pytest.mark.slow
def test_environment_rollouts_keep_turn_boundaries(tmp_path):
    train(tmp_path, "--env", "frozenlake", "--model", "builtin_env", "--max_turns", "3", "--batch_size", "8",
          "--num_generations", "4", "--max_completion_length", "96", "--max_steps", "1", "--no_wandb",
          "--save_rollouts")  # fmt: skip
    ro = load_rollouts(next(tmp_path.iterdir()))
    assert len(ro) == 8
    multi = 0
    for row in ro:
        sources = [s["source"] for s in row["segments"]]
        assert sources[0] == "agent" and all(a != b for a, b in zip(sources, sources[1:]))  # turns alternate
        multi += "env" in sources
        assert row["reward"] == row["reward/env_reward"]
    assert multi > 0  # some episodes went on after the first answer: their env replies are their own segments


@pytest.mark.slow
def test_resumed_run_continues_its_wandb_run_offline(tmp_path, monkeypatch):
    for name in [n for n in os.environ if n.startswith("WANDB_")]:  # the caller's WANDB_MODE=disabled, WANDB_DIR, key
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc key: train.py itself picks offline mode
    flags = [f for f in BASE if f != "--no_wandb"] + ["--max_steps", "4"]
    train(tmp_path / "out", *flags)
    (run_dir,) = (tmp_path / "out").iterdir()
    for p in (run_dir / "checkpoint-4", run_dir / "run_summary.json"):  # as if killed after checkpoint 2
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    train(tmp_path / "out", *flags, "--resume_from_checkpoint", "latest")
    run_id = (run_dir / "wandb_run_id").read_text()
    assert len(run_id) == 8 and len(list((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))) == 2


def test_marker_is_written_last_and_never_after_a_failed_save(builtin_path, tmp_path, monkeypatch):
    import trl_ext.runs.lifecycle as mixin

    seen = []
    real_mark = mixin.mark_complete
    monkeypatch.setattr(mixin, "mark_complete", lambda d, *a, **k: (seen.append(sorted(os.listdir(d))),
                                                                      real_mark(d, *a, **k)))
    trainer = _trainer(builtin_path, tmp_path, lambda completions, **kw: [float(len(c)) for c in completions],
                       save_strategy="steps", save_steps=1, max_steps=2)
    save_model = trainer.save_model

    def crash_on_second(output_dir=None, _internal_call=False):
        save_model(output_dir, _internal_call)
        if output_dir.endswith("checkpoint-2"):
            raise KeyboardInterrupt("killed while writing checkpoint-2")

    trainer.save_model = crash_on_second
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert len(seen) == 1 and {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth",
                               "trainer_state.json", "trl_ext_state.json"} <= set(seen[0])  # fmt: skip
    out = tmp_path / "out"
    assert (out / "checkpoint-2" / "model.safetensors").is_file()  # written, but never declared complete
    assert latest_complete(out) == out / "checkpoint-1"
