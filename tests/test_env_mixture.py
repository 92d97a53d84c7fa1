"""Task mixtures (``--env frozenlake:3,arithmetic``): parsing, per-environment parameters, the prompts' shares, the
episode loop over mixed rows, per-environment metrics, refusals, and end-to-end runs (synchronous and k = 1) whose
saved training batches show groups that never mix environments."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from types import SimpleNamespace

import pytest

from environments.base import SEPARATOR, make_env, run_episodes
from trl_ext.env.args import EnvArgs
from trl_ext.env.episodes import env_dataset, log_episodes, log_words, mixture_dataset, play_episodes
from trl_ext.env.mixture import (Component, env_tag, mixture_counts, mixture_order, parse_env_spec,
                                 split_env_params)  # fmt: skip
from trl_ext.registry import ConfigError
from trl_ext.runs.rollouts import load_rollouts
from reference import word_tokenizer

PLAIN = SimpleNamespace(chat_template=None)  # env_prompt's plain-text prompts (no tokenizer call)


# ---------------------------------------------------------------------------------------------------- parsing
def test_env_spec_weights():
    assert parse_env_spec("frozenlake") == [Component("frozenlake", 1)]
    assert parse_env_spec("frozenlake,sokoban") == [Component("frozenlake", 1), Component("sokoban", 1)]
    assert parse_env_spec(" frozenlake:2, sokoban ,arithmetic:1") == [
        Component("frozenlake", 2), Component("sokoban", 1), Component("arithmetic", 1)]  # fmt: skip
    assert EnvArgs(env="frozenlake:3,arithmetic").env_names == ["frozenlake", "arithmetic"]


@pytest.mark.parametrize("spec, message", [
    ("frozenlake,,sokoban", "expected name or name:weight"), ("frozenlake,", "expected name or name:weight"),
    ("frozenlake:0,sokoban", "integer >= 1"), ("frozenlake:1.5,sokoban", "integer >= 1"),
    ("frozenlake:-1,sokoban", "integer >= 1"), ("frozenlake:,sokoban", "integer >= 1"),
    ("frozenlake,frozenlake:2", "given twice"), ("frozenlake:2", "single environment takes no weight"),
    ("frozenlake,nope", "unknown environment 'nope'"), ("frozenlake sokoban", "expected name or name:weight"),
])  # fmt: skip
def test_env_spec_errors(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_env_spec(spec)


def test_env_params_address_one_environment():
    names = ["frozenlake", "sokoban"]
    assert split_env_params("frozenlake.size=5,sokoban.size=6,strict=true", names) == {
        "frozenlake": {"size": 5, "strict": True}, "sokoban": {"size": 6, "strict": True}}  # fmt: skip
    assert split_env_params("size=5", names) == {"frozenlake": {"size": 5}, "sokoban": {"size": 5}}  # both have it
    assert split_env_params("frozenlake.size=5", ["frozenlake"]) == split_env_params("size=5", ["frozenlake"])
    args = EnvArgs(env="frozenlake,sokoban", env_params="frozenlake.size=5,sokoban.size=7")
    assert (args.build_env("frozenlake").size, args.build_env("sokoban").size) == (5, 7)
    with pytest.raises(ValueError, match="mixture"):
        args.build_env()
    with pytest.raises(ValueError, match="not in --env"):
        args.build_env("arithmetic")


@pytest.mark.parametrize("params, message", [
    ("size=5", "ambiguous in a mixture \\(arithmetic has no 'size'\\)"),
    ("nope=1", "no environment of --env \\(frozenlake, arithmetic\\) accepts 'nope'"),
    ("sokoban.size=5", "'sokoban' is not an environment of --env"),
    ("frozenlake.size=5,frozenlake.size=6", "frozenlake.size given twice"),
    ("strict=true,arithmetic.strict=false", "strict given for arithmetic twice"),
    ("frozenlake.=5", "expected name.key=value"), ("frozenlake.size", "expected name.key=value"),
])  # fmt: skip
def test_env_params_errors(params, message):
    with pytest.raises(ConfigError, match=message):
        split_env_params(params, ["frozenlake", "arithmetic"])


@pytest.mark.parametrize("argv, message", [
    (["--env", "frozenlake:2"], "single environment takes no weight"),
    (["--env", "frozenlake,sokoban:x"], "integer >= 1"),
    (["--env", "frozenlake,arithmetic", "--env_params", "size=5"], "ambiguous in a mixture"),
    (["--env", "frozenlake,arithmetic", "--env_params", "frozenlake.nope=1"], "bad parameters \\['nope'\\]"),
    (["--env", "frozenlake,arithmetic", "--mode", "sft"], "does not support --mode sft"),
    (["--env", "frozenlake,arithmetic", "--rh_detector", "x"], "does not support gradient routing"),
    (["--env", "frozenlake,arithmetic", "--retain_rank", "4", "--forget_rank", "4"],
     "does not support gradient routing"),
])  # fmt: skip
def test_train_refuses_at_parse_time(train_cli_error, tmp_path, argv, message):
    import re

    err = train_cli_error(*argv, "--model", "builtin_env", "--output_dir", str(tmp_path), "--no_wandb")
    assert re.search(message, err), err


def test_run_name_tag():
    assert env_tag("frozenlake") == "frozenlake"
    assert env_tag("frozenlake,sokoban") == env_tag("frozenlake:2,sokoban:2") == "frozenlake+sokoban"
    assert env_tag("frozenlake:4,sokoban:2,arithmetic:2") == "frozenlake2+sokoban1+arithmetic1"


# ---------------------------------------------------------------------------------------------------- prompts
def test_counts_are_the_weights_exactly_and_largest_remainder_otherwise():
    assert mixture_counts([2, 1, 1], 8) == [4, 2, 2] and mixture_counts([2, 1, 1], 2048) == [1024, 512, 512]
    assert mixture_counts([1, 1, 1], 8) == [3, 3, 2]  # remainders 2/3 each: ties to the earlier environments
    assert mixture_counts([3, 1], 5) == [4, 1]  # 3.75 and 1.25: the larger remainder gets the row
    assert mixture_counts([1, 5], 3) == [1, 2]  # 0.5 and 2.5: equal remainders, the earlier environment gets it
    assert sum(mixture_counts([7, 3, 2], 101)) == 101


def test_order_interleaves_and_keeps_every_prefix_near_its_share():
    counts = [4, 2, 2]
    order = mixture_order(counts)
    assert order == [0, 1, 2, 0, 0, 1, 2, 0]
    counts = [5, 3, 1]
    order = mixture_order(counts)
    assert Counter(order) == {0: 5, 1: 3, 2: 1}
    for k in range(1, len(order) + 1):
        for env, c in enumerate(counts):
            assert abs(order[:k].count(env) - k * c / sum(counts)) <= 1


def test_mixture_dataset_rows_carry_their_environment_and_level():
    args = EnvArgs(env="frozenlake:2,sokoban,arithmetic")
    ds = mixture_dataset(args, 12, PLAIN, start=10)
    assert Counter(ds["env"]) == {"frozenlake": 6, "sokoban": 3, "arithmetic": 3}
    assert ds["env"][:4] == ["frozenlake", "sokoban", "arithmetic", "frozenlake"]
    for name in ("frozenlake", "sokoban", "arithmetic"):
        mine = [i for i, e in enumerate(ds["env"]) if e == name]
        single = env_dataset(make_env(name), len(mine), PLAIN, start=10)  # the single-environment run's levels
        assert [ds["env_seed"][i] for i in mine] == single["env_seed"] == list(range(10, 10 + len(mine)))
        assert [ds["prompt"][i] for i in mine] == single["prompt"]
    one = mixture_dataset(EnvArgs(env="frozenlake"), 3, PLAIN)
    assert one.to_dict() == env_dataset(make_env("frozenlake"), 3, PLAIN).to_dict()
    assert one["env"] == ["frozenlake"] * 3


# ---------------------------------------------------------------------------------------------------- episodes
WORDS = ("[UNK] [EOS] < > / answer think left right up down cooperate defect reward : - 1 0 . done false true "
         "invalid").split()  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer(" ".join(WORDS))


def test_one_batch_plays_each_row_in_its_environment_with_its_turn_limit(tok):
    """frozenlake and prisoners_dilemma (5 turns each) and arithmetic (one step) in one batch; an invalid answer
    keeps the multi-turn episodes going until their limit."""
    args = EnvArgs(env="frozenlake,prisoners_dilemma,arithmetic")
    names = ["frozenlake", "arithmetic", "prisoners_dilemma", "frozenlake"]
    envs = [args.build_env(n) for n in names]
    seeds = [3, 4, 5, 6]
    prompts = [e.reset(s) + SEPARATOR + e.prefill for e, s in zip(envs, seeds, strict=True)]
    answer = tok("< answer > jump < / answer >", add_special_tokens=False)["input_ids"]
    calls = []

    def sample(contexts):
        calls.append(len(contexts))
        return [list(answer) for _ in contexts], None, None

    out = play_episodes(prompts, seeds, args, tok, sample, names)
    trajs = out["trajectories"]
    limits = [args.env_turns(n) for n in names]
    assert limits == [5, 1, 5, 5]  # the environments' own limits (arithmetic: one step)
    assert [t.env for t in trajs] == names and [t.seed for t in trajs] == seeds
    assert [len(t.turns) for t in trajs] == limits
    assert calls == [sum(k > t for k in limits) for t in range(max(limits))]  # finished rows leave the batch
    assert trajs[0].observation == make_env("frozenlake").reset(3)
    assert trajs[2].observation == make_env("prisoners_dilemma").reset(5)
    capped = play_episodes(prompts, seeds, EnvArgs(env=args.env, max_turns=2), tok, sample, names)
    assert [len(t.turns) for t in capped["trajectories"]] == [2, 1, 2, 2]  # --max_turns caps every environment


def test_lockstep_keeps_calling_generation_while_another_process_plays(tok):
    """FSDP2 (`play_episodes(lockstep=...)`): a process whose episodes ended (arithmetic: one turn) keeps making idle
    generation calls, on one context, while another process still plays (here: for 3 more turns), then stops when
    none plays; its episodes are as without lockstep, the idle samples discarded."""
    args = EnvArgs(env="arithmetic")
    envs, seeds = [args.build_env() for _ in range(2)], [1, 2]
    prompts = [e.reset(s) + SEPARATOR + e.prefill for e, s in zip(envs, seeds, strict=True)]
    answer = tok("< answer > jump < / answer >", add_special_tokens=False)["input_ids"]
    calls, asked = [], []

    def sample(contexts):
        calls.append(len(contexts))
        return [list(answer) for _ in contexts], None, None

    def lockstep(local: bool) -> bool:  # the other process plays 4 turns
        asked.append(local)
        return local or len(asked) < 4

    out = play_episodes(prompts, seeds, args, tok, sample, lockstep=lockstep)
    alone = play_episodes(prompts, seeds, args, tok, sample)
    assert calls[:4] == [2, 1, 1, 1] and asked == [False] * 4  # one real turn, three idle calls
    assert out["completion_ids"] == alone["completion_ids"] and out["env_return"] == alone["env_return"]
    assert [len(t.turns) for t in out["trajectories"]] == [1, 1]


def test_each_row_keeps_its_environments_prefill(tok):
    """``sokoban.strict=true``: sokoban's prompts and replies end without the ``<think>`` prefill, frozenlake's with."""
    args = EnvArgs(env="frozenlake,sokoban", env_params="sokoban.strict=true")
    ds = mixture_dataset(args, 2, PLAIN)
    assert ds["env"] == ["frozenlake", "sokoban"]
    assert ds["prompt"][0].endswith("\n<think>") and not ds["prompt"][1].endswith("<think>")
    answer = tok("< answer > up < / answer >", add_special_tokens=False)["input_ids"]
    out = play_episodes(ds["prompt"], ds["env_seed"], args, tok,
                        lambda contexts: ([list(answer) for _ in contexts], None, None), ds["env"])  # fmt: skip
    think = tok("<think>", add_special_tokens=False)["input_ids"]
    for i, prefilled in enumerate([True, False]):
        ids, mask = out["completion_ids"][i], out["env_mask"][i]
        first_reply = ids[len(answer) : mask.index(1, len(answer))]  # the environment turn after the first answer
        assert (first_reply[-len(think) :] == think) is prefilled
    assert [t.prefill for t in out["trajectories"]] == ["<think>", ""]


def test_per_environment_metrics():
    fl, ar = [make_env("frozenlake", slippery=False) for _ in range(2)], [make_env("arithmetic") for _ in range(2)]
    trajs = run_episodes(fl, lambda ts: ["<answer>left</answer>"] * len(ts), [3, 4], max_turns=2)
    trajs += run_episodes(ar, lambda ts: ["<answer>nope</answer>"] * len(ts), [1, 2], max_turns=1)
    for t, name in zip(trajs, ["frozenlake", "frozenlake", "arithmetic", "arithmetic"], strict=True):
        t.env = name
    metrics = defaultdict(list)
    trainer = SimpleNamespace(_metrics={"train": metrics}, model=SimpleNamespace(training=True),
                              accelerator=SimpleNamespace(num_processes=1))
    log_episodes(trainer, trajs, *log_words(EnvArgs(env="frozenlake,arithmetic")))
    log_episodes(trainer, trajs[:2], *log_words(EnvArgs(env="frozenlake,arithmetic")))  # no arithmetic episode
    assert metrics["env/arithmetic/share"] == [0.5, 0.0] and len(metrics["env/arithmetic/return"]) == 1
    for values in metrics.values():
        del values[1:]  # the first call's values below
    fl_turns = [len(t.turns) for t in trajs[:2]]
    assert metrics["env/arithmetic/share"] == [0.5] and metrics["env/frozenlake/share"] == [0.5]
    assert metrics["env/arithmetic/return"] == [sum(t.total_reward for t in trajs[2:]) / 2]
    assert metrics["env/arithmetic/invalid_frac"] == [1.0] and metrics["env/arithmetic/success"] == [0.0]
    assert metrics["env/frozenlake/invalid_frac"] == [0.0] and metrics["env/frozenlake/turns"] == [sum(fl_turns) / 2]
    assert metrics["env/frozenlake/first_action/left"] == [1.0] and metrics["env/frozenlake/first_action/up"] == [0.0]
    assert metrics["env/turns"] == [(sum(fl_turns) + 2) / 4]
    assert metrics["env/invalid_frac"] == [2 / (sum(fl_turns) + 2)]
    assert not any(k.startswith(("env/first_action", "env/arithmetic/first_action")) for k in metrics)
    single = defaultdict(list)
    log_episodes(SimpleNamespace(_metrics={"train": single}, model=SimpleNamespace(training=True),
                                 accelerator=SimpleNamespace(num_processes=1)), trajs[:2],
                 *log_words(EnvArgs(env="frozenlake")))  # fmt: skip
    assert single["env/first_action/left"] == [1.0] and not any(k.startswith("env/frozenlake/") for k in single)


# ---------------------------------------------------------------------------------------------------- end to end
def _train(tmp_path, *flags: str):
    from trl_ext.cli_train import main

    out = tmp_path / "out"
    argv = ["--env", "frozenlake:3,arithmetic", "--model", "builtin_env", "--num_prompts", "4", "--batch_size", "8",
            "--num_generations", "4", "--max_completion_length", "32", "--max_turns", "2", "--max_steps", "2",
            "--logging_steps", "1", "--save_steps", "2", "--save_rollouts", "--no_wandb", "--output_dir", str(out),
            *flags]  # fmt: skip
    assert main(argv) == 0
    (run_dir,) = out.iterdir()
    assert run_dir.name.startswith("rl-frozenlake3+arithmetic1_builtin-env_")
    return run_dir


def _check_batches(run_dir):
    """Groups never mix environments (nor levels); over the 4 prompts of the 2 steps (one epoch of
    --num_prompts 4) the groups per environment are the weights 3:1 exactly; per-environment metrics logged."""
    ro = load_rollouts(run_dir)
    assert len(ro) == 16 and set(ro["step"]) == {1, 2}
    groups = defaultdict(set)
    for row in ro:
        groups[(row["step"], row["group"])].add((row["env"], row["env_seed"]))
        if row["env"] == "arithmetic":
            assert len([s for s in row["segments"] if s["source"] == "agent"]) == 1  # a single-step environment
    assert all(len(members) == 1 for members in groups.values()), groups
    per_env = Counter(env for members in groups.values() for env, _ in members)
    assert per_env == {"frozenlake": 3, "arithmetic": 1}
    assert sorted(s for m in groups.values() for e, s in m if e == "frozenlake") == [0, 1, 2]
    state = json.loads((run_dir / "checkpoint-2" / "trainer_state.json").read_text())
    logs = [r for r in state["log_history"] if "loss" in r]
    assert len(logs) == 2
    for name in ("frozenlake", "arithmetic"):
        steps = [r for r in logs if r[f"env/{name}/share"] > 0]
        assert steps and all({f"env/{name}/return", f"env/{name}/success", f"env/{name}/turns"} <= set(r)
                              for r in steps)  # fmt: skip
    assert sum(r["env/frozenlake/share"] for r in logs) == 1.5  # 3 of the 4 groups, logged every step
    assert all(r["env/frozenlake/share"] + r["env/arithmetic/share"] == 1 for r in logs)
    return ro


@pytest.mark.slow
def test_mixture_run_groups_never_mix_environments(tmp_path):
    _check_batches(_train(tmp_path))


@pytest.mark.slow
def test_mixture_run_offpolicy_generator(tmp_path):
    ro = _check_batches(_train(tmp_path, "--max_async_level", "1", "--disable_dropout"))
    assert all(row["policy_version_max"] is not None for row in ro)


@pytest.mark.slow
def test_mixture_run_distillation(tmp_path):
    """Pure distillation on a mixture (one --teacher_context for every environment): teacher scores on every row."""
    ro = _check_batches(_train(tmp_path, "--teacher_context", "Walk to the goal.", "--teacher_tau", "1",
                               "--student_tau", "1", "--adv_tau", "0", "--skip_verification", "--lora_rank", "4"))
    assert all(row["teacher_logprob_sum"] < 0 for row in ro)
