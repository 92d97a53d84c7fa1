import random

import numpy as np
import pytest

from environments.base import feedback_text, make_env, run_episode
from environments.sokoban import Level, generate_level, parse_level, reverse_search, step_reward
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
    r = env.step("<answer>jump</answer>")  # invalid: gym-sokoban's no-op (-0.1) plus the penalty (-1)
    assert (r.reward, r.done, r.info["valid"], r.observation) == (pytest.approx(-1.1), False, False, start)
    assert feedback_text(r).splitlines()[:3] == ["invalid answer", "reward: -0.1", "done: false"]
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
        assert flat.count("X") == 1 and flat.count("O") == 1 and "S" not in flat and "*" not in flat
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


@pytest.mark.parametrize("text,action", [
    ("<answer>up</answer>", "up"), ("I think so. <answer> Right </answer>", "right"), ("left", "left"),
    ("4", "right"), ("<answer>4 (right)</answer>", "right"), ("1 (down)", "up"), ("2", "down"), ("3", "left"),
    ("5", None), ("0", None), ("up left", None), ("<answer>jump</answer>", None),
])  # fmt: skip
def test_ragen_answers(text, action):
    """RAGEN's extract_action: words, digits 1-4 = up, down, left, right, ``N (word)`` (the digit decides)."""
    assert make_env("sokoban").parse_answer(text) == action


def test_strict_answers():
    env = make_env("sokoban", strict=True)
    assert env.prefill == "" and make_env("sokoban").prefill == "<think>"
    assert env.parse_answer("<answer>up</answer>") == "up"
    assert [env.parse_answer(t) for t in ("up", "4", "<answer>4</answer>", "so <answer>up</answer>")] == [None] * 4


def test_reverse_search_by_hand():
    """A corridor (1,1)..(1,4): box on the target (1,2), player (1,3). Up/down are walls, left is the box;
    right walks to (1,4) pulling the box to (1,3): distance 1, target uncovered; from there nothing moves."""
    floor = frozenset((1, c) for c in range(1, 5))
    assert reverse_search(floor, (1, 2), (1, 3), 30) == (1, (1, 4), (1, 3))
    # player (1,4) right of the box: no move pulls; only the start state (score 0) is visited.
    assert reverse_search(floor, (1, 3), (1, 4), 30) == (0, (1, 4), (1, 3))
    # depth: search_depth 2 scores only the start state (RAGEN's ttl counts down before scoring)
    assert reverse_search(floor, (1, 2), (1, 3), 2) == (0, (1, 3), (1, 2))
    assert reverse_search(floor, (1, 2), (1, 3), 3) == (1, (1, 4), (1, 3))


def test_reverse_search_pulls_along_a_corridor():
    """Corridor (1,1)..(1,4), box on the target (1,1), player (1,2): right, right pulls the box to (1,3)
    (distance 2) with the player at (1,4); the first state of distance 1 is kept only until then."""
    floor = frozenset((1, c) for c in range(1, 5))
    assert reverse_search(floor, (1, 1), (1, 2), 30) == (2, (1, 4), (1, 3))
    assert reverse_search(floor, (1, 1), (1, 2), 3) == (1, (1, 3), (1, 2))


# ---- a faithful numpy reimplementation of RAGEN's generator (ragen/env/sokoban/room_utils.py at commit
# 381b659, with ``set_seed``: random.seed / np.random.seed), for comparison with ours.

_MASKS = [[[0, 0, 0], [1, 1, 1], [0, 0, 0]], [[0, 1, 0], [0, 1, 0], [0, 1, 0]], [[0, 0, 0], [1, 1, 0], [0, 1, 0]],
          [[0, 0, 0], [1, 1, 0], [1, 1, 0]], [[0, 0, 0], [0, 1, 1], [0, 1, 0]]]  # fmt: skip
_CHANGE = {0: (-1, 0), 1: (1, 0), 2: (0, -1), 3: (0, 1)}


def _ragen_generate_room(seed, dim=6, num_steps=20, search_depth=30, tries=4):
    py, npr = random.Random(seed), np.random.RandomState(seed)
    for _ in range(tries):
        direction = py.sample([(1, 0), (0, 1), (-1, 0), (0, -1)], 1)[0]
        position = np.array([py.randint(1, dim - 1), py.randint(1, dim - 1)])
        level = np.zeros((dim, dim), dtype=int)
        for _ in range(num_steps):
            if py.random() < 0.35:
                direction = py.sample([(1, 0), (0, 1), (-1, 0), (0, -1)], 1)[0]
            position = position + direction
            position[0] = max(min(position[0], dim - 2), 1)
            position[1] = max(min(position[1], dim - 2), 1)
            mask = py.sample(_MASKS, 1)[0]
            start = position - 1
            level[start[0] : start[0] + 3, start[1] : start[1] + 3] += mask
        level[level > 0] = 1
        level[:, [0, dim - 1]] = 0
        level[[0, dim - 1], :] = 0
        possible = np.where(level == 1)
        if possible[0].shape[0] <= 2:
            raise RuntimeError("not enough free spots")  # RAGEN re-seeds with hash(str(seed))
        ind = npr.randint(possible[0].shape[0])
        level[possible[0][ind], possible[1][ind]] = 5
        possible = np.where(level == 1)
        ind = npr.randint(possible[0].shape[0])
        level[possible[0][ind], possible[1][ind]] = 2
        structure = level.copy()
        structure[structure == 5] = 1
        state = level.copy()
        state[state == 2] = 4
        target = tuple(int(v) for v in np.argwhere(structure == 2)[0])
        explored, best = set(), {"score": -1, "state": None, "box": target}

        def dfs(state, box, swaps, last_pull, ttl):
            ttl -= 1
            if ttl <= 0 or len(explored) >= 300000:
                return
            key = state.tobytes()
            if key in explored:
                return
            score = swaps * (abs(box[0] - target[0]) + abs(box[1] - target[1]))
            if np.where(state == 2)[0].shape[0] != 1:
                score = 0
            if score > best["score"]:
                best.update(score=score, state=state.copy(), box=box)
            explored.add(key)
            for action in range(4):
                nxt, nbox, nlast = state.copy(), box, last_pull
                player = np.argwhere(nxt == 5)[0]
                change = np.array(_CHANGE[action])
                new = player + change
                if nxt[new[0], new[1]] in (1, 2):
                    nxt[player[0], player[1]] = structure[player[0], player[1]]
                    nxt[new[0], new[1]] = 5
                    behind = player - change
                    if nxt[behind[0], behind[1]] in (3, 4):
                        nxt[player[0], player[1]] = 3
                        nxt[behind[0], behind[1]] = structure[behind[0], behind[1]]
                        nbox, nlast = (int(player[0]), int(player[1])), target
                dfs(nxt, nbox, swaps + (nlast != last_pull), nlast, ttl)

        dfs(state, target, 0, (-1, -1), search_depth)
        if best["score"] > 0:
            state = best["state"]
            cells = lambda v: [tuple(int(x) for x in c) for c in np.argwhere(state == v)]  # noqa: E731
            floor = frozenset(tuple(int(x) for x in c) for c in np.argwhere(structure > 0))
            return Level(floor, dim, target, (cells(3) + cells(4))[0], cells(5)[0])
    raise RuntimeWarning("score 0")  # RAGEN re-seeds with hash(str(seed))


def test_levels_match_ragen_generator_per_seed():
    """Our generator gives RAGEN's level for every seed where RAGEN does not re-seed (that re-seed uses
    Python's salted string hash, so it is not reproducible); those seeds are rare."""
    reseeded = 0
    for seed in range(200):
        try:
            expected = _ragen_generate_room(seed)
        except (RuntimeError, RuntimeWarning):
            reseeded += 1
            continue
        assert generate_level(seed, 6, 30) == expected, seed
    assert reseeded <= 10


# Measured with this generator (seeds 0..499); RAGEN-era reference (issue 13): 3.15 moves, 88% within 5.
MEAN_500, WITHIN_5_500 = 3.218, 0.886
COUNTS_500 = {1: 143, 2: 115, 4: 77, 5: 108, 6: 28, 7: 13, 8: 15, 9: 1}


def test_optimal_path_length_distribution():
    """BFS optimal-path lengths of seeds 0..499 (measured once with this generator, which matches RAGEN's
    per seed above): mean and the share solvable within RAGEN's 5 turns."""
    env = make_env("sokoban")
    lengths = [len(shortest_actions(_reset_env(env, s))) for s in range(500)]
    counts = {n: lengths.count(n) for n in sorted(set(lengths))}
    assert min(lengths) >= 1
    assert sum(lengths) / 500 == pytest.approx(MEAN_500, abs=1e-9)
    assert sum(n <= 5 for n in lengths) / 500 == pytest.approx(WITHIN_5_500, abs=1e-9)
    assert counts == COUNTS_500


def _reset_env(env, seed):
    env.reset(seed)
    return env
