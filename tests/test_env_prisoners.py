import math

import pytest

from environments.base import make_env, run_episode
from trl_ext.registry import ConfigError

C, D = "<answer>cooperate</answer>", "<answer>defect</answer>"


def play(env, answers, seed=0):
    env.reset(seed)
    return [env.step(a) for a in answers]


def test_tit_for_tat_payoffs():
    # opponent: C first, then the agent's previous move -> C, C, D, D, C
    # agent C,D,D,C,C -> (C,C)=3, (D,C)=5, (D,D)=1, (C,D)=0, (C,C)=3
    env = make_env("prisoners_dilemma", opponent="tit_for_tat", n_rounds=5)
    res = play(env, [C, D, D, C, C])
    assert [r.info["opponent_move"] for r in res] == ["cooperate", "cooperate", "defect", "defect", "cooperate"]
    assert [r.reward for r in res] == [3.0, 5.0, 1.0, 0.0, 3.0]
    assert [r.done for r in res] == [False] * 4 + [True]
    assert env.scores == [12.0, 3.0 + 0.0 + 1.0 + 5.0 + 3.0]
    assert res[-1].observation.endswith("the game is over.")


def test_first_round_observation():
    env = make_env("prisoners_dilemma")
    (r,) = play(env, [C])
    assert r.observation == (
        "last round: you cooperate, opponent cooperate.\nyour points 3, opponent points 3.\n"
        "round 2 of 5. cooperate or defect?"
    )


def test_always_defect():
    env = make_env("prisoners_dilemma", opponent="always_defect", n_rounds=3)
    assert [r.reward for r in play(env, [C, D, C])] == [0.0, 1.0, 0.0]


def test_invalid_answer_does_not_play_a_round():
    env = make_env("prisoners_dilemma", n_rounds=2)
    res = play(env, ["<answer>betray</answer>", C, C])
    assert [r.reward for r in res] == [-1.0, 3.0, 3.0]
    assert [r.done for r in res] == [False, False, True]


def test_random_opponent_seeded_and_fair():
    env = make_env("prisoners_dilemma", opponent="random", n_rounds=3)
    first = [play(env, [C], seed)[0].info["opponent_move"] for seed in range(2000)]
    assert first == [play(env, [C], seed)[0].info["opponent_move"] for seed in range(2000)]
    share = first.count("cooperate") / 2000
    assert abs(share - 0.5) < 4 * math.sqrt(0.25 / 2000)


def test_rounds_and_max_turns_cut_off():
    traj = run_episode(make_env("prisoners_dilemma", n_rounds=4), lambda h: D, seed=0, max_turns=2)
    # tit-for-tat: C then D -> agent D gets T=5 then P=1
    assert traj.step_rewards == [5.0, 1.0] and traj.truncated


def test_bad_config():
    with pytest.raises(ConfigError, match="unknown prisoner's dilemma opponent 'grudger'.*tit_for_tat"):
        make_env("prisoners_dilemma", opponent="grudger")
    with pytest.raises(ValueError, match="n_rounds"):
        make_env("prisoners_dilemma", n_rounds=0)
