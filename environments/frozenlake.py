"""FrozenLake (RAGEN commit 381b659, 2025-02-15: ``ragen/env/frozen_lake/env.py``, on Gymnasium's
``FrozenLakeEnv``; 4x4, p 0.8 as RAGEN's ``config/frozenlake.yaml``).

Reaching the goal: +1 and the episode ends (success); stepping into a hole ends it with 0; any other
valid step 0. Walking off the grid leaves the player in place (Gymnasium). ``slippery`` (default, as
RAGEN's ``is_slippery=True``): the player moves in the intended direction w.p. 1/3 and in each
perpendicular direction w.p. 1/3 (Gymnasium's ``is_slippery``). An invalid answer changes nothing and
costs ``invalid_penalty`` (-1); the agent is shown reward 0. Answers: left/down/right/up or RAGEN's
digits 1-4 in that order.

SFT data (``sft_params``): the BFS shortest path on the same map with non-slippery dynamics, i.e. the
intended moves. RAGEN's BFS (``frozen_lake/utils.py: get_shortest_action_path``) replays each candidate
under the level seed's own slip draws, so its path has the same length but its labels are the actions
that, under those particular draws, produce the moves (2/3 of them perpendicular to the intended move);
under fresh draws such a label is no better than a random turn, so the intended move is used here.

Maps (deterministic by seed, RAGEN's generator): each cell is frozen w.p. ``p_frozen`` else a hole;
start and goal are distinct random cells; maps without a hole-free path from start to goal (BFS) are
redrawn from the same random stream. The slippery draws continue that stream.

Grid symbols (RAGEN's, with ASCII ``*`` for its player-on-goal glyph): ``P`` player, ``_`` frozen,
``O`` hole, ``G`` goal, ``X`` player in a hole, ``*`` player on the goal.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .base import Environment, register_env
from .solvers import bfs

PLAYER, FROZEN, HOLE, GOAL, PLAYER_IN_HOLE, PLAYER_ON_GOAL = "P", "_", "O", "G", "X", "*"
# Gymnasium's action order LEFT, DOWN, RIGHT, UP: the perpendiculars of i are (i - 1) % 4 and (i + 1) % 4.
ACTIONS = ("left", "down", "right", "up")
DELTAS = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}
GOAL_REWARD = 1.0
_MAX_TRIES = 10000

Cell = tuple[int, int]


@dataclass(frozen=True)
class LakeMap:
    size: int
    holes: frozenset[Cell]
    start: Cell
    goal: Cell


def move(lake: LakeMap, pos: Cell, action: str) -> Cell:
    d = DELTAS[action]
    return (min(max(pos[0] + d[0], 0), lake.size - 1), min(max(pos[1] + d[1], 0), lake.size - 1))


def slip_directions(action: str) -> tuple[str, str, str]:
    """The three equally likely actual directions of a slippery move (Gymnasium)."""
    i = ACTIONS.index(action)
    return (ACTIONS[(i - 1) % 4], action, ACTIONS[(i + 1) % 4])


def _successors(lake: LakeMap):
    def successors(pos: Cell):
        for action in ACTIONS:
            nxt = move(lake, pos, action)
            if nxt != pos and nxt not in lake.holes:
                yield action, nxt

    return successors


def shortest_path(lake: LakeMap, pos: Cell) -> list[str] | None:
    return bfs(pos, _successors(lake), lambda p: p == lake.goal)


def generate_map(rng: random.Random, size: int, p_frozen: float) -> LakeMap:
    cells = [(r, c) for r in range(size) for c in range(size)]
    for _ in range(_MAX_TRIES):
        holes = {cell for cell in cells if rng.random() >= p_frozen}
        start, goal = rng.sample(cells, 2)
        lake = LakeMap(size, frozenset(holes - {start, goal}), start, goal)
        if shortest_path(lake, start) is not None:
            return lake
    raise RuntimeError(f"no solvable FrozenLake map after {_MAX_TRIES} tries (p_frozen={p_frozen})")


def render(lake: LakeMap, pos: Cell) -> str:
    rows = []
    for r in range(lake.size):
        row = []
        for c in range(lake.size):
            cell = (r, c)
            if cell == pos:
                on = PLAYER_IN_HOLE if cell in lake.holes else PLAYER_ON_GOAL if cell == lake.goal else PLAYER
                row.append(on)
            else:
                row.append(HOLE if cell in lake.holes else GOAL if cell == lake.goal else FROZEN)
        rows.append(" ".join(row))
    return "\n".join(rows)


def parse_map(text: str) -> LakeMap:
    """Inverse of ``render`` for a start state: square grid of P _ O G, one P and one G."""
    rows = [line.split() for line in text.strip().splitlines()]
    size = len(rows)
    if any(len(row) != size for row in rows):
        raise ValueError(f"FrozenLake map must be a square grid, got row lengths {[len(r) for r in rows]}")
    cells = {(r, c): sym for r, row in enumerate(rows) for c, sym in enumerate(row)}
    if set(cells.values()) - {PLAYER, FROZEN, HOLE, GOAL}:
        raise ValueError(f"unexpected FrozenLake symbols {set(cells.values()) - {PLAYER, FROZEN, HOLE, GOAL}}")
    players = [c for c, s in cells.items() if s == PLAYER]
    goals = [c for c, s in cells.items() if s == GOAL]
    if len(players) != 1 or len(goals) != 1:
        raise ValueError("FrozenLake map needs exactly one P and one G")
    return LakeMap(size, frozenset(c for c, s in cells.items() if s == HOLE), players[0], goals[0])


@register_env
class FrozenLakeEnv(Environment):
    name = "frozenlake"
    max_turns_default = 5  # RAGEN's FrozenLake runs (seed run list: training.max_turns=5)
    action_words = ACTIONS
    digit_actions = ACTIONS  # RAGEN's ACTION_LOOKUP 1-4
    has_solver = True
    instructions = (
        "You are the player P on a frozen lake. Walk to the goal G without falling into a hole O. "
        "_ is frozen ice, X is you in a hole, * is you on the goal. The ice may be slippery. "
        "Answer with one move: left, down, right or up, as <think>...</think><answer>move</answer>."
    )

    def __init__(
        self, size: int = 4, p_frozen: float = 0.8, slippery: bool = True, invalid_penalty: float | None = None
    ):
        super().__init__(invalid_penalty)
        if size < 2 or not 0.0 < p_frozen <= 1.0:
            raise ValueError(f"frozenlake: need size >= 2 and 0 < p_frozen <= 1, got {size}, {p_frozen}")
        self.size, self.p_frozen, self.slippery = size, p_frozen, bool(slippery)

    def _reset(self, rng: random.Random) -> None:
        self.lake = generate_map(rng, self.size, self.p_frozen)
        self.pos = self.lake.start

    def load(self, map_text: str, seed: int) -> str:
        """Start an episode on a hand-made map (see ``parse_map``); ``seed`` drives slipping."""
        self._begin(seed)
        self.lake = parse_map(map_text)
        self.pos = self.lake.start
        return self.format_observation()

    def _apply(self, action: str) -> tuple[float, bool, dict]:
        moved = self.rng.choice(slip_directions(action)) if self.slippery else action
        self.pos = move(self.lake, self.pos, moved)
        success = self.pos == self.lake.goal
        return (GOAL_REWARD if success else 0.0), success or self.pos in self.lake.holes, {
            "moved": moved,
            "success": success,
        }

    def format_observation(self) -> str:
        return render(self.lake, self.pos)

    def solver_state(self) -> Cell:
        return self.pos

    @classmethod
    def sft_params(cls, params: dict) -> dict:
        """SFT paths on the same maps with non-slippery dynamics (the map draws come before any slip)."""
        return {**params, "slippery": False}

    def successors(self, state: Cell):
        return _successors(self.lake)(state)

    def is_goal(self, state: Cell) -> bool:
        return state == self.lake.goal
