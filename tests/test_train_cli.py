"""train.py's bad inputs: each is a one-line error naming the problem, exit code 2, and nothing
heavy happens (run_training, which loads the model, is never reached)."""

import subprocess
import sys
from pathlib import Path

import pytest
import zygote

import trl_ext.cli_train as cli

ROOT = Path(__file__).resolve().parents[1]


def _yaml(tmp_path, text) -> str:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return str(path)


def test_unknown_reward_lists_names(train_cli_error):
    err = train_cli_error("--reward", "nope")
    assert "nope" in err and "happy_binary" in err and "sentence_length_5" in err


def test_unknown_eval_reward(train_cli_error):
    err = train_cli_error("--reward", "happy_binary", "--eval_rewards", "happy_count,nope")
    assert "nope" in err


def test_unknown_reward_function_in_yaml(train_cli_error, tmp_path):
    cfg = _yaml(tmp_path, "rewards:\n  r:\n    fn: no_such_fn\n")
    err = train_cli_error("--reward", "r", "--config", cfg)
    assert "no_such_fn" in err and "happy_binary" in err


def test_unknown_detector_in_yaml(train_cli_error, tmp_path):
    cfg = _yaml(tmp_path, "rewards:\n  r:\n    fn: happy_binary\ndetectors:\n  d:\n    fn: no_such_detector\n")
    err = train_cli_error("--reward", "r", "--config", cfg)
    assert "no_such_detector" in err


def test_unknown_param(train_cli_error, tmp_path):
    cfg = _yaml(tmp_path, "rewards:\n  r:\n    fn: sentence_length\n    params: {target: 5, colour: red}\n")
    err = train_cli_error("--reward", "r", "--config", cfg)
    assert "colour" in err


def test_malformed_yaml(train_cli_error, tmp_path):
    cfg = _yaml(tmp_path, "rewards:\n  r: [unclosed\n")
    err = train_cli_error("--reward", "r", "--config", cfg)
    assert "bad.yaml" in err


def test_missing_config_file(train_cli_error, tmp_path):
    err = train_cli_error("--reward", "happy_binary", "--config", str(tmp_path / "none.yaml"))
    assert "none.yaml" in err


def test_batch_not_divisible(train_cli_error):
    err = train_cli_error("--reward", "happy_binary", "--batch_size", "30", "--num_generations", "16")
    assert "30" in err and "16" in err and "divisible" in err


def test_num_generations_below_two(train_cli_error):
    err = train_cli_error("--reward", "happy_binary", "--num_generations", "1", "--batch_size", "4")
    assert "num_generations" in err


@pytest.mark.parametrize("lr", ["0", "-1e-4"])
def test_non_positive_lr(train_cli_error, lr):
    err = train_cli_error("--reward", "happy_binary", f"--lr={lr}")
    assert "--lr" in err


def test_model_path_missing(train_cli_error, tmp_path):
    err = train_cli_error("--reward", "happy_binary", "--model", str(tmp_path / "no_model"))
    assert "no_model" in err


def test_subprocess_exit_code_and_unknown_flag():
    """The real CLI: exit code 2 for a config error (a real interpreter start) and for an unknown flag (argparse; a
    process forked by the tests' fork server)."""
    bad = subprocess.run([sys.executable, "train.py", "--reward", "nope"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("train.py: error: unknown reward")
    flag = zygote.run([sys.executable, "train.py", "--reward", "happy_binary", "--no_such_flag", "1"], cwd=ROOT,
                      capture_output=True, text=True)  # fmt: skip
    assert flag.returncode == 2 and flag.stderr.strip() == (
        "train.py: error: unknown arguments: --no_such_flag 1 (see train.py --help)"
    )


def test_valid_plan_resolves_run_dir(tmp_path):
    plan = cli.build_plan(["--reward", "happy_binary", "--output_dir", str(tmp_path), "--lr", "3e-4"])
    assert plan.run_dir == tmp_path / "happy_binary_builtin_lr3e-4_b0.02_bs32_ng16_full_st2000_s42"
    assert plan.cfg.output_dir == str(plan.run_dir) and plan.cfg.loss_type == "grpo"
    assert plan.cfg.bf16 is False and plan.cfg.gradient_checkpointing is False


def test_own_model_default_prompts_offline(train_cli_error, tmp_path):
    """A model of one's own without --prompts or --dataset takes the hub's SimpleStories; offline (conftest sets
    HF_HUB_OFFLINE) that is exit 2 naming the ways on, not a ConnectionError on every rank after the model loads."""
    from trl_ext.models import model_source

    own = ["--reward", "happy_binary", "--model", model_source("builtin"), "--output_dir", str(tmp_path)]
    err = train_cli_error(*own)
    assert "takes its prompts from the hub's SimpleStories/SimpleStories" in err
    assert "pass --prompts builtin" in err and "--dataset" in err
    assert "simplestories" in train_cli_error(*own, "--prompts", "simplestories")
    assert cli.build_plan([*own, "--prompts", "builtin"]).run.prompts == "builtin"  # the builtin stories parse
