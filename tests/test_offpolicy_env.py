"""Off-policy RL on environments: the episode loop with a recording sampler (scripted, no model), and end-to-end
runs of the asynchronous generator driving multi-turn FrozenLake on the builtin_env model."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import zygote

from environments.base import make_env
from environments.base import SEPARATOR
from trl_ext.env.episodes import play_episodes
from trl_ext.runs.rollouts import load_rollouts
from reference import word_tokenizer

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("[UNK] [EOS] < > / answer think left right up down reward : - 1 0 . done false true invalid p _ o g x * | "
         "junk").split()  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer(" ".join(WORDS))


def enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def args(turns=3):
    return SimpleNamespace(build_env=lambda: make_env("frozenlake", slippery=False), turns=turns, no_think_rl=False)


def test_episode_loop_records_behaviour_logprobs_and_versions_of_agent_tokens_only(tok):
    env = args().build_env()
    seeds = [3, 4]
    prompts = [env.reset(s) + SEPARATOR + env.prefill for s in seeds]
    answer = enc(tok, "< answer > left < / answer > junk junk")  # sampled past the closing tag: cut there
    contexts_seen = []

    def sample_turn(contexts):
        turn = len(contexts_seen)
        contexts_seen.append([list(c) for c in contexts])
        lps = [[-(turn + 1) - 0.01 * t for t in range(len(answer))] for _ in contexts]
        return [list(answer) for _ in contexts], lps, [[10 + turn] * len(answer) for _ in contexts]

    out = play_episodes(prompts, seeds, args(), tok, sample_turn)
    n_agent = len(answer) - 2
    for i in range(2):
        ids, mask, lp, ver = (out[k][i] for k in ("completion_ids", "env_mask", "logprobs", "versions"))
        assert len(ids) == len(mask) == len(lp) == len(ver)
        agent_turns, pos = 0, 0
        while pos < len(ids):
            if mask[pos] == 1:  # an agent turn: the sampler's own log-probs and versions, cut with the ids
                turn = agent_turns
                assert ids[pos : pos + n_agent] == answer[:n_agent]
                assert lp[pos : pos + n_agent] == [-(turn + 1) - 0.01 * t for t in range(n_agent)]
                assert ver[pos : pos + n_agent] == [10 + turn] * n_agent
                agent_turns += 1
                pos += n_agent
            else:  # environment tokens (and the closing EOS): log-prob 0, the previous turn's version, not trained
                assert lp[pos] == 0.0 and ver[pos] == 10 + agent_turns - 1
                pos += 1
        assert agent_turns == len(out["trajectories"][i].turns)
    # each later turn's context is the prompt plus everything so far, environment tokens included
    first_done = [len(out["trajectories"][i].turns) for i in range(2)]
    if min(first_done) > 1:
        assert contexts_seen[1][0][: len(out["prompt_ids"][0])] == out["prompt_ids"][0]
        assert len(contexts_seen[1][0]) > len(out["prompt_ids"][0]) + n_agent


def test_synchronous_sampler_records_nothing(tok):
    env = args().build_env()
    answer = enc(tok, "< answer > up < / answer >")
    out = play_episodes([env.reset(1) + SEPARATOR + env.prefill], [1], args(turns=1), tok,
                        lambda contexts: ([list(answer) for _ in contexts], None, None))  # fmt: skip
    assert out["logprobs"] is None and out["versions"] is None and out["env_mask"][0][: len(answer)] == [1] * len(answer)


def run(out: Path, *flags: str) -> Path:
    cmd = [sys.executable, "train.py", "--env", "frozenlake", "--model", "builtin_env", "--max_turns", "3",
           "--batch_size", "8", "--num_generations", "4", "--max_completion_length", "96", "--max_steps", "4",
           "--logging_steps", "1", "--save_steps", "4", "--no_wandb", "--lr", "1e-4", "--save_rollouts",
           "--output_dir", str(out), *flags]  # fmt: skip
    proc = zygote.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (run_dir,) = out.iterdir()
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["strict", "inflight"])
def test_offpolicy_multi_turn_environment(tmp_path, mode):
    flags = ["--max_async_level", "1"] + (["--strict_async_level"] if mode == "strict" else [])
    run_dir = run(tmp_path, *flags)
    state = json.loads((run_dir / "checkpoint-4" / "trainer_state.json").read_text())
    logs = [r for r in state["log_history"] if "loss" in r]
    assert [r["step"] for r in logs] == [1, 2, 3, 4]
    assert logs[0]["offpolicy/abs_log_ratio_mean"] < 1e-4  # step 1: the sampler's policy is the trainer's
    assert all(r["offpolicy/policy_lag_max"] <= 1 and "env/success" in r and r["env/turns"] >= 1 for r in logs)
    ro = load_rollouts(run_dir)
    for row in ro:
        need = max(row["step"] - 2, 0)  # batch of step n (1-based) sampled by policy >= max(n - 1 - k, 0)
        assert need <= row["policy_version_min"] <= row["policy_version_max"] <= row["step"] - 1
        if mode == "strict":
            assert row["policy_version_min"] == row["policy_version_max"] == need
        assert row["segments"][0]["source"] == "agent"
    assert any(len(row["segments"]) > 1 for row in ro)  # multi-turn episodes: env replies between agent turns
