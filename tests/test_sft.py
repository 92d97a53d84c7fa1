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
