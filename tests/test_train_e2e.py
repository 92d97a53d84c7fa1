"""End-to-end: train.py on the builtin model for a few steps, then check what the run leaves behind."""

import json
import os
import re
import sys
from pathlib import Path

import pytest
import zygote
import yaml

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_train_few_steps_on_builtin(builtin_path, tmp_path):
    flags = [
        "--reward", "happy_binary", "--model", "builtin", "--lr", "3e-4", "--max_steps", "4",
        "--batch_size", "8", "--num_generations", "4", "--max_completion_length", "16",
        "--logging_steps", "2", "--save_steps", "4", "--eval_rewards", "happy_count,sentence_length_5",
        "--zero_signal_patience", "1", "--no_wandb", "--output_dir", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = zygote.run([sys.executable, "train.py", *flags], cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]

    name = "happy_binary_builtin_lr3e-4_b0.02_bs8_ng4_full_st4_s42_max_completion_length16"
    run_dir = tmp_path / name
    assert [p.name for p in tmp_path.iterdir()] == [name]

    log = (run_dir / "train.log").read_text()
    samples = re.findall(r"\[Sample @ step (\d+)\] (.+?) \|\|\| (.*)", log)  # what `grep "\[Sample @"` finds
    assert [int(step) for step, _, _ in samples] == [2, 4]
    assert all(prompt.strip() for _, prompt, _ in samples)
    assert "[Sample @ step 4]" in proc.stdout  # the tee also writes to the terminal
    # the start policy rarely says "happy": some step has no reward spread in any group -> loud warning
    assert "NO LEARNING SIGNAL: every group had zero reward spread for 1 steps in a row" in log

    state = json.loads((run_dir / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4
    logged = [h for h in state["log_history"] if "reward" in h]
    assert [h["step"] for h in logged] == [2, 4]
    assert any(h["frac_reward_zero_std"] == 1.0 and h["zero_spread_streak"] >= 1 for h in logged)
    for h in logged:
        assert 0.0 <= h["reward"] <= 1.0
        assert "eval_rewards/happy_count" in h and "eval_rewards/sentence_length_5" in h
    assert (run_dir / "checkpoint-4" / "model.safetensors").is_file()

    cfg = yaml.safe_load((run_dir / "run_config.yaml").read_text())
    assert cfg["RunArgs"]["reward"] == "happy_binary"
    assert cfg["ExtGRPOConfig"]["learning_rate"] == 3e-4
    assert cfg["ExtGRPOConfig"]["loss_type"] == "grpo" and cfg["ExtGRPOConfig"]["bf16"] is False
    assert cfg["ExtGRPOConfig"]["output_dir"] == str(run_dir)
    summary = json.loads((run_dir / "run_summary.json").read_text())
    assert summary["status"] == "done" and summary["steps"] == 4


@pytest.mark.slow
def test_train_from_local_path(builtin_path, tmp_path):
    """The from_pretrained path (as for SimpleStories/SimpleStories-1.25M) on a local copy of the builtin model."""
    import shutil

    local = tmp_path / "my_model"
    shutil.copytree(builtin_path, local)
    flags = [
        "--reward", "happy_binary", "--model", str(local), "--prompts", "builtin", "--max_steps", "1",
        "--batch_size", "4", "--num_generations", "2", "--max_completion_length", "8", "--no_wandb",
        "--output_dir", str(tmp_path / "out"),
    ]  # fmt: skip
    proc = zygote.run([sys.executable, "train.py", *flags], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "out").iterdir()
    assert run_dir.name == "happy_binary_my-model_lr1e-5_b0.02_bs4_ng2_full_st1_s42_max_completion_length8_promptsbuiltin"
    cfg = yaml.safe_load((run_dir / "run_config.yaml").read_text())
    assert cfg["RunArgs"]["model"] == str(local) and cfg["RunArgs"]["prompts"] == "builtin"
    assert (run_dir / "checkpoint-1" / "model.safetensors").is_file()
