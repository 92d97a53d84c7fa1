import random

import pytest

from environments.base import (
    ENVIRONMENTS,
    Environment,
    extract_answer,
    make_env,
    no_think_rewrite,
    ragen_answer,
    run_episode,
    run_episodes,
    truncate_after_answer,
)
from trl_ext.registry import ConfigError


class CounterEnv(Environment):
    """Test double: ``inc`` adds 1 (reward 1), ``stop`` ends the episode (reward 0.5)."""

    name = "counter"
    max_turns_default = 3
    action_words = ("inc", "stop")
    instructions = "count"

    def _reset(self, rng: random.Random) -> None:
        self.count = 0

    def _apply(self, action):
        if action == "inc":
            self.count += 1
            return 1.0, False, {}
        return 0.5, True, {"success": True}

    def format_observation(self):
        return f"count {self.count}"


def strict_env():
    env = CounterEnv()
    env.strict = True
    return env


# (text, parse_answer result for CounterEnv's action words) in the strict format
PARSE_CASES = [
    ("<think>go</think><answer>inc</answer>", "inc"),
    ("<answer>inc</answer>", "inc"),
    ("  <think> a\nb </think>\n <answer>  INC </answer>\n", "inc"),
    ("< answer > inc < / answer >", "inc"),  # WordPiece-decoded tags
    ("<THINK>x</THINK><ANSWER>Stop</ANSWER>", "stop"),
    ("<think></think><answer>stop</answer>", "stop"),
    ("inc", None),  # no tags
    ("<answer>inc", None),  # missing close
    ("inc</answer>", None),  # missing open
    ("<think>x</think>", None),  # no answer
    ("<answer></answer>", None),  # empty
    ("<answer>   </answer>", None),  # blank
    ("<answer>inc</answer><answer>stop</answer>", None),  # extra answer
    ("<think>x</think><think>y</think><answer>inc</answer>", None),  # extra think
    ("<think>x<answer>inc</answer></think>", None),  # nested in think
    ("<answer><think>x</think>inc</answer>", None),  # nested in answer
    ("<answer>inc</answer><think>x</think>", None),  # wrong order
    ("<think>x<answer>inc</answer>", None),  # unclosed think
    ("I say <answer>inc</answer>", None),  # text before
    ("<answer>inc</answer> done", None),  # text after
    ("<think>a</think> so <answer>inc</answer>", None),  # text between
    ("<answer>inc stop</answer>", None),  # two words
    ("<answer>jump</answer>", None),  # not an action word
]


@pytest.mark.parametrize("text,expected", PARSE_CASES)
def test_strict_parse_answer_table(text, expected):
    assert strict_env().parse_answer(text) == expected


# RAGEN's postprocess_predictions: text after the first <answer> up to </answer> (or the end), else all.
RAGEN_CASES = [
    ("<think>go</think><answer>inc</answer>", "inc"),
    ("</think><answer>inc</answer>", "inc"),  # after the prefilled <think>
    ("I say <answer>inc</answer>", "inc"),  # text before
    ("<think>a</think> so <answer> Stop </answer>", "stop"),
    ("< answer > inc < / answer >", "inc"),
    ("inc", "inc"),  # bare action
    ("  STOP \n", "stop"),
    ("<answer>inc", "inc"),  # no close: to the end
    ("<answer>inc</answer><answer>stop</answer>", "inc"),  # the first answer
    ("<answer>inc</answer> done", "inc"),
    ("<think>x</think>", None),  # no answer tag: the whole text, not an action
    ("inc</answer>", None),
    ("<answer></answer>", None),
    ("<answer>inc stop</answer>", None),
    ("1", None),  # CounterEnv has no action digits
]


@pytest.mark.parametrize("text,expected", RAGEN_CASES)
def test_ragen_parse_answer_table(text, expected):
    assert CounterEnv().parse_answer(text) == expected


def test_ragen_answer_content():
    assert ragen_answer("a <answer> b c </answer> d") == "b c"
    assert ragen_answer("  plain  ") == "plain"
    assert ragen_answer("<answer> x") == "x"


def test_extract_answer_keeps_case_and_inner_text():
    assert extract_answer("<think>t</think><answer> Two Words </answer>") == "Two Words"


@pytest.mark.parametrize("text,expected", PARSE_CASES + RAGEN_CASES)
def test_no_think_rewrite_preserves_validity(text, expected):
    for env in (strict_env(), CounterEnv()):
        rewritten = no_think_rewrite(text, env)
        assert env.parse_answer(rewritten) == env.parse_answer(text)
        assert "<think>" not in rewritten


def test_no_think_rewrite_values():
    """RAGEN writes the canonical action name, or its invalid action's name ``none``."""
    assert no_think_rewrite("<think>long reasoning</think><answer> Inc </answer>", CounterEnv()) == "<answer>inc</answer>"
    assert no_think_rewrite("no tags at all", CounterEnv()) == "<answer>none</answer>"
    assert no_think_rewrite("inc", CounterEnv()) == "<answer>inc</answer>"
    assert no_think_rewrite("inc", strict_env()) == "<answer>none</answer>"


def test_truncate_after_answer():
    assert truncate_after_answer("<answer>inc</answer> blah <answer>x</answer>") == "<answer>inc</answer>"
    cut = "<think>t</think><answer>a< / answer >"
    assert truncate_after_answer(cut + "tail") == cut
    assert truncate_after_answer("no close") == "no close"


def test_registry_and_errors():
    make_env("sokoban")
    builtin = {"two_armed_bandit", "sokoban", "frozenlake", "arithmetic", "prisoners_dilemma"}
    assert set(ENVIRONMENTS.names()) >= builtin
    with pytest.raises(ConfigError, match="unknown environment 'nope'.*frozenlake.*sokoban"):
        make_env("nope")
    with pytest.raises(ConfigError, match="bad parameters"):
        make_env("frozenlake", slipery=True)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_max_turns_must_be_positive_int(bad):
    with pytest.raises(ConfigError, match="max_turns"):
        run_episode(CounterEnv(), lambda h: "<answer>inc</answer>", seed=0, max_turns=bad)


def test_step_order_errors_and_seed_validation():
    env = CounterEnv()
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("<answer>inc</answer>")
    with pytest.raises(ValueError, match="non-negative"):
        env.reset(-1)
    env.reset(0)
    assert env.step("<answer>stop</answer>").done
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("<answer>inc</answer>")


def scripted(answers):
    calls = []

    def policy(history):
        calls.append(history)
        return answers[len(calls) - 1]

    return policy, calls


def test_run_episode_rewards_invalid_and_history():
    """RAGEN format: prompts end with <think>; an invalid answer costs the penalty but shows reward 0."""
    policy, calls = scripted(["<answer>inc</answer>", "oops", "<answer>stop</answer>"])
    traj = run_episode(CounterEnv(), policy, seed=0, max_turns=5)
    assert traj.step_rewards == [1.0, -1.0, 0.5]
    assert traj.total_reward == 0.5
    assert traj.n_invalid == 1
    assert traj.done and not traj.truncated and traj.success
    assert calls[0] == "count 0\n<think>"
    assert calls[1] == "count 0\n<think><answer>inc</answer>\nreward: 1\ndone: false\ncount 1\n<think>"
    assert calls[2] == calls[1] + "oops\ninvalid answer\nreward: 0\ndone: false\ncount 1\n<think>"
    assert traj.turns[1].info["penalty"] == -1.0 and traj.turns[1].info["shown_reward"] == 0.0
    assert [r for r, _ in traj.segments()] == ["env", "agent", "env", "agent", "env", "agent", "env"]
    assert traj.segments()[-1] == ("env", "reward: 0.5\ndone: true\ncount 1")
    msgs = traj.messages(system="sys")
    assert [m["role"] for m in msgs[:4]] == ["system", "user", "assistant", "user"]
    assert msgs[2]["content"] == "<think><answer>inc</answer>"


def test_strict_run_episode_history():
    policy, calls = scripted(["<answer>inc</answer>", "inc", "<answer>stop</answer>"])
    traj = run_episode(strict_env(), policy, seed=0, max_turns=5)
    assert traj.step_rewards == [1.0, -1.0, 0.5]
    assert calls[1] == "count 0\n<answer>inc</answer>\nreward: 1\ndone: false\ncount 1\n"
    assert calls[2] == calls[1] + "inc\ninvalid answer\nreward: 0\ndone: false\ncount 1\n"
    assert traj.messages()[1]["content"] == "<answer>inc</answer>"


def test_strict_param_of_make_env():
    assert make_env("frozenlake", strict=True).strict and not make_env("frozenlake").strict
    with pytest.raises(ConfigError, match="strict must be true or false"):
        make_env("sokoban", strict="yes")


def test_run_episode_max_turns_cut_off():
    policy, calls = scripted(["<answer>inc</answer>"] * 5)
    traj = run_episode(CounterEnv(), policy, seed=0, max_turns=2)
    assert len(calls) == 2
    assert traj.step_rewards == [1.0, 1.0]
    assert traj.truncated and not traj.done and not traj.success


def test_run_episodes_batches_only_active():
    sizes = []

    def policy(trajs):
        sizes.append(len(trajs))
        # episode of seed 0 stops at once, seed 1 keeps counting
        return ["<answer>stop</answer>" if t.seed == 0 else "<answer>inc</answer>" for t in trajs]

    a, b = run_episodes([CounterEnv(), CounterEnv()], policy, seeds=[0, 1], max_turns=3)
    assert sizes == [2, 1, 1]
    assert a.step_rewards == [0.5] and a.done
    assert b.step_rewards == [1.0, 1.0, 1.0] and b.truncated


def test_parse_env_params_values_and_errors():
    from environments.base import parse_env_params

    assert parse_env_params("") == {}
    assert parse_env_params("slippery=true, size=6,p_frozen=0.9,opponent=random,") == {
        "slippery": True, "size": 6, "p_frozen": 0.9, "opponent": "random"}  # fmt: skip
    for bad, needle in [("size", "key=value"), ("=3", "key=value"), ("a b=1", "key=value"), ("a=1,a=2", "twice")]:
        with pytest.raises(ConfigError, match=needle):
            parse_env_params(bad)
    with pytest.raises(ConfigError, match="environment 'frozenlake': frozenlake: need size >= 2"):
        make_env("frozenlake", size=1)
