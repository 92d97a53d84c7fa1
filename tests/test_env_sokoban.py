import pytest

from environments.base import make_env, run_episode
from environments.sokoban import parse_level, step_reward
from environments.solvers import shortest_actions


def ans(action):
    return f"<answer>{action}</answer>"


# player (1,1), box (2,2), target (4,4). The box needs 2 pushes right and 2 down; reaching the first
# push position costs 1 move and turning the push direction costs 2 more: 1 + 4 + 2 = 7 moves.
LEVEL = """
# # # # # #
# P _ _ _ #
# _ X _ _ #
# _ _ _ _ #
# _ _ _ O #
# # # # # #
"""
PATH = ["down", "right", "right", "up", "right", "down", "down"]


def test_step_reward_rules():
    assert step_reward(False, False) == pytest.approx(-0.1)
    assert step_reward(False, True) == pytest.approx(-0.1 + 1 + 10)
    assert step_reward(True, False) == pytest.approx(-0.1 - 1)


def test_scripted_walls_invalid_and_solve():
    env = make_env("sokoban")
    start = env.load(LEVEL)
    assert start == LEVEL.strip()
    r = env.step(ans("up"))  # wall: valid, nothing moves
    assert (r.reward, r.done, r.info["valid"], r.observation) == (pytest.approx(-0.1), False, True, start)
    r = env.step("up")  # no tags: invalid
    assert (r.reward, r.done, r.info["valid"], r.observation) == (-1.0, False, False, start)
    rewards = [env.step(ans(a)).reward for a in PATH[:2]]
    assert env.format_observation() == "\n".join(
        ["# # # # # #", "# _ _ _ _ #", "# _ P X _ #", "# _ _ _ _ #", "# _ _ _ O #", "# # # # # #"]
    )
    results = [env.step(ans(a)) for a in PATH[2:]]
    rewards += [r.reward for r in results]
    assert rewards == pytest.approx([-0.1] * 6 + [10.9])
    assert [r.done for r in results] == [False] * 4 + [True]
    assert results[-1].info["success"]
    assert results[-1].observation.splitlines()[4] == "# _ _ _ * #"
    with pytest.raises(RuntimeError):
        env.step(ans("up"))


def test_push_into_wall_does_nothing():
    env = make_env("sokoban")
    start = env.load("# # # # #\n# _ P X #\n# _ _ _ #\n# O _ _ #\n# # # # #")
    r = env.step(ans("right"))
    assert r.observation == start and r.reward == pytest.approx(-0.1) and r.info["valid"]


def test_solver_on_hand_made_level():
    env = make_env("sokoban")
    env.load(LEVEL)
    path = shortest_actions(env)
    assert len(path) == 7
    assert [env.step(ans(a)).reward for a in path][-1] == pytest.approx(10.9)
    assert env.done


def test_unsolvable_level_raises():
    env = make_env("sokoban")
    env.load("# # # # #\n# P _ _ #\n# _ _ X #\n# O _ _ #\n# # # # #")  # box in a corner
    with pytest.raises(ValueError, match="no action path"):
        shortest_actions(env)


def test_parse_level_rejects_bad_levels():
    with pytest.raises(ValueError, match="exactly one"):
        parse_level("# # # #\n# P X #\n# X O #\n# # # #")
    with pytest.raises(ValueError, match="symbol"):
        parse_level("# # # #\n# P X #\n# ? O #\n# # # #")


def test_levels_deterministic_solvable_and_varied():
    a, b = make_env("sokoban"), make_env("sokoban")
    seen = set()
    for seed in range(150):
        obs = a.reset(seed)
        assert obs == b.reset(seed)
        seen.add(obs)
        rows = [row.split() for row in obs.splitlines()]
        assert len(rows) == 6 and all(len(row) == 6 for row in rows)
        assert rows[0] == ["#"] * 6 and rows[-1] == ["#"] * 6 and all(r[0] == r[-1] == "#" for r in rows)
        flat = sum(rows, [])
        assert flat.count("X") == 1 and flat.count("O") + flat.count("S") == 1 and "*" not in flat
        path = shortest_actions(a)
        assert len(path) >= 1
        results = [a.step(ans(m)) for m in path]
        assert results[-1].done and results[-1].info["success"]
        assert sum(r.reward for r in results) == pytest.approx(-0.1 * len(path) + 11)
    assert len(seen) > 100


def test_max_turns_cut_off_on_generated_level():
    seed = next(s for s in range(100) if len(shortest_actions(_reset(s))) >= 3)
    path = shortest_actions(_reset(seed))
    moves = iter(path)
    traj = run_episode(make_env("sokoban"), lambda h: ans(next(moves)), seed=seed, max_turns=len(path) - 1)
    assert traj.truncated and not traj.done and not traj.success
    assert traj.total_reward == pytest.approx(-0.1 * (len(path) - 1))


def _reset(seed):
    env = make_env("sokoban")
    env.reset(seed)
    return env
