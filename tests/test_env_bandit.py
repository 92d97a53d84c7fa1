import math
import random
import statistics

import pytest

from environments.base import make_env, run_episode
from trl_ext.registry import ConfigError

N = 10_000


def draws(arm):
    env = make_env("two_armed_bandit")
    out = []
    for seed in range(N):
        env.reset(seed)
        out.append(env.step(f"<answer>{arm}</answer>").reward)
    return out


def test_low_arm_mean_and_std():
    # N(0.2, 0.1): the sample mean has std 0.1 / sqrt(N); the sample std about 0.1 / sqrt(2N).
    r = draws("phoenix")
    assert abs(statistics.fmean(r) - 0.2) < 4 * 0.1 / math.sqrt(N)
    assert abs(statistics.stdev(r) - 0.1) < 4 * 0.1 / math.sqrt(2 * N)


def test_high_arm_mean_and_jackpot_rate():
    # 0.75 N(0.1, 0.1) + 0.25 N(1, 0.1): mean 0.075 + 0.25 = 0.325;
    # E[X^2] = 0.75 (0.01 + 0.01) + 0.25 (0.01 + 1) = 0.2675, var = 0.2675 - 0.325^2 = 0.161875.
    r = draws("dragon")
    assert abs(statistics.fmean(r) - 0.325) < 4 * math.sqrt(0.161875 / N)
    # 0.55 is 4.5 std from both components, so P(X > 0.55) = 0.25 up to ~1e-5.
    jackpots = sum(x > 0.55 for x in r) / N
    assert abs(jackpots - 0.25) < 4 * math.sqrt(0.25 * 0.75 / N)


def test_single_step_reproducible_and_case_insensitive():
    env = make_env("two_armed_bandit")
    env.reset(7)
    r1 = env.step("<think>a dragon is risky</think><answer>DRAGON</answer>")
    assert r1.done and r1.info["valid"] and r1.info["action"] == "dragon" and r1.info["risk"] == "high"
    assert r1.observation == "You pulled machine dragon."
    with pytest.raises(RuntimeError):
        env.step("<answer>phoenix</answer>")
    env.reset(7)
    assert env.step("<answer>dragon</answer>").reward == r1.reward
    env.reset(8)
    assert env.step("<answer>dragon</answer>").reward != r1.reward


def _names_line(obs):
    return obs.split(". ")[1]


def test_arm_names_shuffled_per_seed_as_ragen():
    """RAGEN: names = [low, high]; random.Random(seed).shuffle(names); the prompt lists names[0], names[1]."""
    env, orders = make_env("two_armed_bandit"), set()
    for seed in range(40):
        obs = env.reset(seed)
        names = ["phoenix", "dragon"]
        random.Random(seed).shuffle(names)
        assert _names_line(obs) == f"There are 2 arms, named {names[0]} and {names[1]}"
        assert obs.endswith(f"Choose between {names[0]} and {names[1]}.")
        assert "related to their names" in obs and "symbolic meaning" in obs
        assert "low" not in obs.split() and "high" not in obs.split()
        orders.add(tuple(names))
    assert orders == {("phoenix", "dragon"), ("dragon", "phoenix")}
    # seed 0: shuffle draws j = getrandbits(1), the top bit of the first output word, which is 1 since
    # Random(0).random() = 0.844 >= 0.5: no swap. Seed 2: Random(2).random() = 0.956 -> no swap either;
    # seed 1: 0.134 < 0.5 -> swap.
    assert random.Random(0).random() > 0.5 and random.Random(1).random() < 0.5
    assert _names_line(env.reset(0)).endswith("named phoenix and dragon")
    assert _names_line(env.reset(1)).endswith("named dragon and phoenix")


def test_custom_names_and_digits():
    env = make_env("two_armed_bandit", low_risk_name="teddy", high_risk_name="tiger")
    env.reset(3)
    assert env.step("<answer>2</answer>").info["action"] == "tiger"  # RAGEN: 2 = the high-risk arm
    for text, action in [("1", "teddy"), ("<answer> 01 </answer>", "teddy"), ("Teddy", "teddy"), ("3", None),
                         ("<answer>phoenix</answer>", None), ("0", None)]:  # fmt: skip
        env.reset(3)
        assert env.step(text).info["action"] == action, text
    env = make_env("two_armed_bandit", strict=True)
    env.reset(0)
    assert env.step("<answer>2</answer>").info["valid"] is False
    with pytest.raises(ConfigError, match="different names"):
        make_env("two_armed_bandit", low_risk_name="a", high_risk_name="a")
    with pytest.raises(ConfigError, match="lower-case words"):
        make_env("two_armed_bandit", low_risk_name="Big cat")


def test_invalid_answer_ends_with_ragen_zero():
    """RAGEN's TwoArmedBanditEnv: PENALTY_FOR_INVALID = 0, the invalid step returns 0 and ends."""
    env = make_env("two_armed_bandit")
    env.reset(0)
    r = env.step("<answer>middle</answer>")
    assert (r.reward, r.done, r.info["valid"]) == (0.0, True, False)
    env = make_env("two_armed_bandit", invalid_penalty=-1.0)
    env.reset(0)
    assert env.step("pull dragon").reward == -1.0


def test_episode_is_one_turn_even_with_more_turns_allowed():
    traj = run_episode(make_env("two_armed_bandit"), lambda h: "<answer>phoenix</answer>", seed=1, max_turns=5)
    assert len(traj.turns) == 1 and traj.done and not traj.truncated
