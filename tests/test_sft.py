"""SFT mode: BFS records, chat form, flag validation (exit 2 before any model is loaded)."""

import pytest

import trl_ext.cli_train as cli
from environments.base import make_env
from environments.solvers import sft_pairs
from trl_ext.sft import sft_records


@pytest.fixture
def no_training(monkeypatch):
    monkeypatch.setattr(cli, "run_training", lambda plan: pytest.fail("validation should have failed first"))


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--mode", "sft", "--env", "two_armed_bandit"], "environments with one: arithmetic, frozenlake, search, sokoban"),
        (["--mode", "sft", "--env", "prisoners_dilemma"], "no solver (BFS or scripted)"),
        (["--mode", "sft", "--reward", "happy_binary"], "--mode sft needs --env"),
        (["--mode", "distill", "--env", "frozenlake"], "--mode must be one of rl, sft"),
        (["--mode", "sft", "--env", "frozenlake", "--sft_train_size", "0"], "--sft_train_size"),
        (["--mode", "sft", "--env", "frozenlake", "--sft_test_size", "0"], "--sft_test_size"),
    ],
)
def test_bad_sft_flags_exit_2(capsys, no_training, argv, needle):
    model = [] if "--reward" in argv else ["--model", "builtin_env"]
    assert cli.main([*argv, *model]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("train.py: error: ") and err.count("\n") == 0 and needle in err


def test_plain_records_match_the_solver_pairs():
    assert sft_records("frozenlake", 3, 7, chat=False) == sft_pairs("frozenlake", 3, 7)


def test_chat_records_are_conversations():
    records = sft_records("frozenlake", 1, 0, chat=True)  # slippery ice: the non-slippery path
    env = make_env("frozenlake", slippery=False)
    first = records[0]["prompt"]
    assert first == [{"role": "system", "content": env.instructions}, {"role": "user", "content": env.reset(0)}]
    assert all(r["completion"][0]["role"] == "assistant" for r in records)
    assert all(r["completion"][0]["content"].startswith("<think><answer>") for r in records)
    # record k's prompt: system, the first observation, then (assistant answer, user reply) per earlier step
    assert [len(r["prompt"]) for r in records] == [2 + 2 * k for k in range(len(records))]
    last = records[-1]
    env.reset(0)
    for msg in last["prompt"][2::2]:
        env.step(msg["content"])
    assert env.step(last["completion"][0]["content"]).info["success"]


@pytest.mark.slow
def test_a_given_max_steps_ends_an_sft_run(tmp_path):
    """SFT trains by --sft_epochs (5 epochs of 24 levels at batch 8: over 15 steps); a given --max_steps ends it there
    (it used to be ignored)."""
    import json
    import sys
    from pathlib import Path

    import zygote

    out = tmp_path / "out"
    proc = zygote.run([sys.executable, "train.py", "--mode", "sft", "--env", "frozenlake", "--model", "builtin_env",
                       "--sft_train_size", "24", "--sft_test_size", "2", "--batch_size", "8", "--num_generations", "4",
                       "--max_steps", "2", "--no_wandb", "--output_dir", str(out)],
                      cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = out.iterdir()
    assert json.loads((run_dir / "run_summary.json").read_text())["steps"] == 2
