import math

import pytest

from environments.base import feedback_text, make_env, run_episode
from environments.frozenlake import parse_map
from environments.solvers import shortest_actions


def ans(action):
    return f"<answer>{action}</answer>"


# start (0,0), goal (3,3): Manhattan distance 6 and a hole-free 6-move path exists (down, down,
# right, right, down, right), so the shortest path has 6 moves.
LAKE = """
P _ _ _
_ O _ O
_ _ _ O
O _ _ G
"""


def test_scripted_edges_invalid_and_hole():
    env = make_env("frozenlake", slippery=False)
    start = env.load(LAKE, seed=0)
    assert start == LAKE.strip()
    for a in ("up", "left"):  # off the grid: stay
        r = env.step(ans(a))
        assert (r.observation, r.reward, r.done, r.info["valid"]) == (start, 0.0, False, True)
    r = env.step("<answer>fly</answer>")  # RAGEN: a no-op step (0) plus the penalty (-1); shown 0
    assert (r.observation, r.reward, r.done, r.info["valid"]) == (start, -1.0, False, False)
    assert feedback_text(r).splitlines()[:3] == ["invalid answer", "reward: 0", "done: false"]
    r = env.step(ans("right"))
    assert r.observation.splitlines()[0] == "_ P _ _" and not r.done
    r = env.step(ans("down"))  # into the hole at (1,1)
    assert (r.reward, r.done, r.info["success"]) == (0.0, True, False)
    assert r.observation.splitlines()[1] == "_ X _ O"


def test_goal_reward_and_solver_length():
    env = make_env("frozenlake", slippery=False)
    env.load(LAKE, seed=0)
    path = shortest_actions(env)
    assert len(path) == 6
    results = [env.step(ans(a)) for a in path]
    assert [r.reward for r in results] == [0.0] * 5 + [1.0]
    assert results[-1].done and results[-1].info["success"]
    assert results[-1].observation.splitlines()[3] == "O _ _ *"


def test_slippery_direction_frequencies():
    # From the centre, "left" moves up, left or down w.p. 1/3 each (Gymnasium), never right.
    env = make_env("frozenlake", slippery=True)
    n = 3000
    counts = {"up": 0, "left": 0, "down": 0}
    for seed in range(n):
        env.load("_ _ _\n_ P _\n_ _ G", seed=seed)
        counts[env.step(ans("left")).info["moved"]] += 1
    tol = 4 * math.sqrt((1 / 3) * (2 / 3) / n)
    assert sum(counts.values()) == n
    for k, c in counts.items():
        assert abs(c / n - 1 / 3) < tol, (k, c)


def test_non_slippery_moves_as_told():
    env = make_env("frozenlake", slippery=False)
    for seed in range(20):
        env.load("_ _ _\n_ P _\n_ _ G", seed=seed)
        assert env.step(ans("left")).observation == "_ _ _\nP _ _\n_ _ G"


def test_maps_deterministic_and_solvable():
    """Slippery (the default) and non-slippery ice give the same map per seed (slips draw afterwards)."""
    a, b = make_env("frozenlake", slippery=False), make_env("frozenlake")
    assert b.slippery
    seen = set()
    for seed in range(200):
        obs = a.reset(seed)
        assert obs == b.reset(seed)
        seen.add(obs)
        cells = obs.split()
        assert len(cells) == 16 and cells.count("P") == 1 and cells.count("G") == 1
        results = [a.step(ans(m)) for m in shortest_actions(a)]
        assert results[-1].info["success"] and sum(r.reward for r in results) == 1.0
    assert len(seen) > 150


def test_max_turns_cut_off():
    probe = make_env("frozenlake", slippery=False)
    seed = next(s for s in range(100) if probe.reset(s) and len(shortest_actions(probe)) >= 3)
    probe.reset(seed)
    path = shortest_actions(probe)
    moves = iter(path)
    traj = run_episode(make_env("frozenlake", slippery=False), lambda h: ans(next(moves)), seed=seed,
                       max_turns=len(path) - 1)
    assert len(traj.turns) == len(path) - 1
    assert traj.truncated and not traj.done and traj.total_reward == 0.0
    moves = iter(path)
    traj = run_episode(make_env("frozenlake", slippery=False), lambda h: ans(next(moves)), seed=seed,
                       max_turns=len(path))
    assert traj.done and not traj.truncated and traj.total_reward == 1.0


def test_solver_on_slippery_ice_plans_non_slippery_moves():
    """The BFS path of a slippery level is the non-slippery one (the intended moves)."""
    env, flat = make_env("frozenlake"), make_env("frozenlake", slippery=False)
    for seed in range(30):
        env.reset(seed), flat.reset(seed)
        assert shortest_actions(env) == shortest_actions(flat)


@pytest.mark.parametrize("text,action", [
    ("1", "left"), ("2", "down"), ("3", "right"), ("4", "up"), ("<answer>4 (up)</answer>", "up"),
    ("3 (Left)", "right"), ("<think>hm</think> <answer> Down </answer>", "down"), ("5", None), ("north", None),
])  # fmt: skip
def test_ragen_answers(text, action):
    """RAGEN's FrozenLake extract_action: 1 left, 2 down, 3 right, 4 up; the digit decides."""
    assert make_env("frozenlake").parse_answer(text) == action


def test_parse_map_errors():
    with pytest.raises(ValueError, match="one P and one G"):
        parse_map("P _\n_ _")
    with pytest.raises(ValueError, match="square"):
        parse_map("P _ G\n_ _")
