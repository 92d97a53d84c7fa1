"""BFS shortest action paths and SFT data along them (RAGEN's SFT mode).

RAGEN (early 2025) generated SFT data from a BFS solver's shortest action path
(``ragen/env/sokoban/utils.py: get_shortest_action_path``): each state on the path becomes an
(observation, ``<answer>action</answer>``) pair. Here the pair's prompt is the full episode history up to
that state, exactly the text ``run_episode`` gives the policy, so SFT data and validation rollouts match.

An environment with ``has_solver = True`` provides ``solver_state()``, ``successors(state)`` (yielding
(action, next state) for moves that change the state and do not end the episode in failure) and
``is_goal(state)``. Actions are tried in ``action_words`` order, so the path found is deterministic. An environment
whose play is not a search over a small state space (search) provides ``scripted_actions()`` instead.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable

from trl_ext.registry import ConfigError

from .base import ENVIRONMENTS, Environment, Trajectory, answer_text, env_class, make_env


def bfs(
    start: Hashable,
    successors: Callable[[Hashable], Iterable[tuple[str, Hashable]]],
    is_goal: Callable[[Hashable], bool],
) -> list[str] | None:
    """Shortest action list from ``start`` to a goal state, [] if ``start`` is one, None if unreachable."""
    parent: dict[Hashable, tuple[Hashable, str] | None] = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        if is_goal(state):
            path = []
            while parent[state] is not None:
                state, action = parent[state]
                path.append(action)
            return path[::-1]
        for action, nxt in successors(state):
            if nxt not in parent:
                parent[nxt] = (state, action)
                queue.append(nxt)
    return None


def solver_env_names() -> list[str]:
    return [n for n in ENVIRONMENTS.names() if getattr(ENVIRONMENTS.get(n), "has_solver", False)]


def _require_solver(name: str) -> None:
    if not env_class(name).has_solver:
        raise ConfigError(f"environment {name!r} has no solver; environments with one: {solver_env_names()}")


def shortest_actions(env: Environment) -> list[str]:
    """BFS shortest action path from ``env``'s current state; ValueError when no path exists. An environment with
    ``scripted_actions()`` (search: search, read, answer) gives its scripted play instead of a BFS."""
    _require_solver(env.name)
    if hasattr(env, "scripted_actions"):
        return env.scripted_actions()
    path = bfs(env.solver_state(), env.successors, env.is_goal)
    if path is None:
        raise ValueError(f"{env.name}: no action path reaches the goal from this state")
    return path


def solved_steps(env_name: str, n: int, seed: int, **env_params):
    """Yield ``(env, trajectory so far, answer text)`` along the optimal paths of levels seed .. seed+n-1.

    Each item is yielded before the answer is applied, so the trajectory is the history the policy sees
    at that state. The paths are those of ``sft_params(env_params)`` (FrozenLake: non-slippery ice on the
    same maps). Every level's path must end in success (checked). An environment without a solver or
    ``n < 1`` -> ConfigError.
    """
    _require_solver(env_name)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"sft data: n must be an int >= 1, got {n!r}")
    env = make_env(env_name, **env_class(env_name).sft_params(dict(env_params)))
    for level_seed in range(seed, seed + n):
        traj = Trajectory(level_seed, env.reset(level_seed), prefill=env.prefill)
        for action in shortest_actions(env):
            answer = answer_text(action)
            yield env, traj, answer
            traj.add(answer, env.step(answer))
        if not (traj.done and traj.success):
            raise RuntimeError(f"{env_name} seed {level_seed}: the solver's path did not solve the level")


def sft_pairs(env_name: str, n: int, seed: int, **env_params) -> list[dict]:
    """(prompt, completion) pairs along the optimal paths of the ``n`` levels seeded seed .. seed+n-1.

    One pair per step of each level's shortest path (so the list is longer than ``n``); the prompt is
    the episode history up to that step, the completion ``<answer>action</answer>``. Held-out levels
    are simply other seeds.
    """
    return [{"prompt": traj.history_text(), "completion": answer}
            for _, traj, answer in solved_steps(env_name, n, seed, **env_params)]  # fmt: skip
