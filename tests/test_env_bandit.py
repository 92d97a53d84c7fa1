import math
import statistics

import pytest

from environments.base import make_env, run_episode

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
    r = draws("low")
    assert abs(statistics.fmean(r) - 0.2) < 4 * 0.1 / math.sqrt(N)
    assert abs(statistics.stdev(r) - 0.1) < 4 * 0.1 / math.sqrt(2 * N)


def test_high_arm_mean_and_jackpot_rate():
    # 0.75 N(0.1, 0.1) + 0.25 N(1, 0.1): mean 0.075 + 0.25 = 0.325;
    # E[X^2] = 0.75 (0.01 + 0.01) + 0.25 (0.01 + 1) = 0.2675, var = 0.2675 - 0.325^2 = 0.161875.
    r = draws("high")
    assert abs(statistics.fmean(r) - 0.325) < 4 * math.sqrt(0.161875 / N)
    # 0.55 is 4.5 std from both components, so P(X > 0.55) = 0.25 up to ~1e-5.
    jackpots = sum(x > 0.55 for x in r) / N
    assert abs(jackpots - 0.25) < 4 * math.sqrt(0.25 * 0.75 / N)


def test_single_step_reproducible_and_case_insensitive():
    env = make_env("two_armed_bandit")
    assert env.reset(7) == "two arms: low and high. which arm do you pull?"
    r1 = env.step("<think>the high arm pays more on average</think><answer>HIGH</answer>")
    assert r1.done and r1.info["valid"] and r1.info["action"] == "high"
    assert r1.observation == "you pulled high."
    with pytest.raises(RuntimeError):
        env.step("<answer>low</answer>")
    env.reset(7)
    assert env.step("<answer>high</answer>").reward == r1.reward
    env.reset(8)
    assert env.step("<answer>high</answer>").reward != r1.reward


def test_invalid_answer_ends_with_penalty():
    env = make_env("two_armed_bandit")
    env.reset(0)
    r = env.step("<answer>middle</answer>")
    assert (r.reward, r.done, r.info["valid"]) == (-1.0, True, False)
    env = make_env("two_armed_bandit", invalid_penalty=0.0)  # RAGEN's value
    env.reset(0)
    assert env.step("pull high").reward == 0.0


def test_episode_is_one_turn_even_with_more_turns_allowed():
    traj = run_episode(make_env("two_armed_bandit"), lambda h: "<answer>low</answer>", seed=1, max_turns=5)
    assert len(traj.turns) == 1 and traj.done and not traj.truncated
