"""The builtin_env model against the environments' RAGEN prompts: tokenizer coverage, cache version, and
end-to-end runs (bandit GRPO with named arms, FrozenLake SFT on slippery ice)."""

import json
import sys
from pathlib import Path

import pytest
import zygote

from environments.base import ENVIRONMENTS, answer_text, env_class, make_env, run_episode
from trl_ext.models import builtin_env as builtin_env_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def env_model(builtin_cache):
    return builtin_env_model.ensure_builtin_env()


def test_cache_name_carries_the_version():
    """A model pretrained on the pre-RAGEN prompts (v2) is never picked up."""
    assert builtin_env_model.builtin_env_dir().name == f"builtin-env-{builtin_env_model.VERSION}"
    assert builtin_env_model.VERSION not in ("v1", "v2", "v3")


def _texts():
    """Every kind of text the environments write (start, prefill, valid and invalid feedback, the bandit's
    two name orders) and the answers in action words and RAGEN's digits."""
    env_class("sokoban")  # registers every builtin environment
    texts = []
    for name in ENVIRONMENTS.names():
        for strict in (False, True):
            env = make_env(name, strict=strict)
            for seed in range(4):
                words = env.action_words if name != "arithmetic" else ("7",)
                answers = iter([answer_text(words[0]), "<answer>4</answer>", answer_text(words[-1]), "x"] * 3)
                traj = run_episode(env, lambda h: next(answers), seed=seed, max_turns=4)
                texts += [text + "\n" + traj.prefill for role, text in traj.segments() if role == "env"]
                texts += [answer_text(w) for w in (*words, "1", "2", "3", "4")]
    return texts


def test_tokenizer_covers_every_prompt(env_model):
    from trl_ext.models import load_tokenizer
    tok = load_tokenizer(env_model)
    texts = _texts()
    assert any("named dragon and phoenix" in t for t in texts) and any("named phoenix and dragon" in t for t in texts)
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids, [t for t, i in zip(tok.convert_ids_to_tokens(ids), ids) if i == tok.unk_token_id]


def _train(tmp_path, *flags):
    cmd = [sys.executable, "train.py", *flags, "--model", "builtin_env", "--no_wandb", "--output_dir", str(tmp_path)]
    proc = zygote.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    return run_dir, json.loads((run_dir / "run_summary.json").read_text())


@pytest.mark.slow
def test_bandit_grpo_with_named_arms(env_model, tmp_path):
    run_dir, summary = _train(tmp_path, "--env", "two_armed_bandit", "--max_steps", "2", "--batch_size", "8",
                              "--n_rollout", "4", "--adv_estimator", "brpo", "--max_completion_length", "16",
                              "--logging_steps", "1", "--save_steps", "2")  # fmt: skip
    assert summary["status"] == "done" and summary["steps"] == 2
    state = json.loads((run_dir / "checkpoint-2" / "trainer_state.json").read_text())
    logged = [h for h in state["log_history"] if "env/invalid_frac" in h]
    assert len(logged) == 2 and all("env/first_action/dragon" in h and "env/first_action/phoenix" in h for h in logged)


@pytest.mark.slow
def test_frozenlake_sft_on_slippery_ice(env_model, tmp_path):
    """SFT records are the non-slippery BFS paths; validation plays the slippery (default) ice."""
    _, summary = _train(tmp_path, "--env", "frozenlake", "--mode", "sft", "--sft_train_size", "6",
                        "--sft_test_size", "4", "--sft_epochs", "1", "--batch_size", "16", "--max_completion_length", "16",
                        "--logging_steps", "1")  # fmt: skip
    from environments.solvers import sft_pairs

    assert summary["status"] == "done" and summary["records"] == len(sft_pairs("frozenlake", 6, 0, slippery=False))
    assert summary["validation_after"]["levels"] == 4
