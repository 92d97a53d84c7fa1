"""Sokoban, one box (RAGEN commit 381b659, 2025-02-15: ``ragen/env/sokoban/env.py`` on gym-sokoban's
``SokobanEnv`` rewards, levels from ``ragen/env/sokoban/room_utils.py``; 6x6 rooms, search_depth 30 as in
RAGEN's ``config/sokoban.yaml``).

Per valid step: -0.1; pushing the box onto the target +1, off the target -1; solving (box on target)
+10 and the episode ends. Bumping into a wall, or pushing the box into a wall, is a valid step that
changes nothing (-0.1). An invalid answer runs gym-sokoban's no-op action (-0.1, nothing moves) and
adds ``invalid_penalty`` (-1): -1.1 in all, of which the agent is shown -0.1 (RAGEN's
``_update_tracking_variables``). Answers: up/down/left/right or RAGEN's digits 1-4 in that order.

Levels (``generate_level``, RAGEN's ``generate_room``; exact per seed: Python's ``random`` seeded with the
level seed draws the room, numpy's legacy ``RandomState(seed)`` the player and target, as RAGEN's
``set_seed``): a room is carved by a random walk of ``int(1.7 * 2 * size)`` steps (gym-sokoban's
``room_topology_generation``); the player and the box target are placed on random floor cells; then a
depth-first search of reverse play (every move pulls the box when it is behind the player) visits every
state within ``search_depth`` - 1 moves (RAGEN's ``depth_first_search``: states deduplicated on first
visit, ttl semantics as RAGEN's) and keeps the first state, in search order, of the highest score:
the box's Manhattan distance from the target (RAGEN's box_swaps x displacement, where box_swaps is 1
once the one box has been pulled), 0 when the target is covered (by the box or the player). A room whose
best score is 0 is redrawn; RAGEN tries 4 rooms per seed and then re-seeds with ``hash(str(seed))``
(which depends on PYTHONHASHSEED), here the same streams keep drawing (``_MAX_TRIES`` rooms). A BFS
solve confirms every level.

Grid symbols (RAGEN's, with ASCII ``*`` for its box-on-target glyph): ``#`` wall, ``_`` floor,
``O`` target, ``X`` box, ``*`` box on target, ``P`` player, ``S`` player on target.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from .base import Environment, register_env
from .solvers import bfs

WALL, FLOOR, TARGET, BOX, BOX_ON_TARGET, PLAYER, PLAYER_ON_TARGET = "#", "_", "O", "X", "*", "P", "S"
MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
STEP_PENALTY, BOX_ON_REWARD, BOX_OFF_PENALTY, SOLVED_REWARD = -0.1, 1.0, -1.0, 10.0
_MASKS = (  # gym-sokoban's carving masks: cells set to floor around the walk position
    ((0, 0, 0), (1, 1, 1), (0, 0, 0)),
    ((0, 1, 0), (0, 1, 0), (0, 1, 0)),
    ((0, 0, 0), (1, 1, 0), (0, 1, 0)),
    ((0, 0, 0), (1, 1, 0), (1, 1, 0)),
    ((0, 0, 0), (0, 1, 1), (0, 1, 0)),
)
_MAX_TRIES = 1000

Cell = tuple[int, int]


@dataclass(frozen=True)
class Level:
    floor: frozenset[Cell]  # every non-wall cell
    size: int
    target: Cell
    box: Cell
    player: Cell


def _shift(cell: Cell, d: Cell, k: int = 1) -> Cell:
    return (cell[0] + k * d[0], cell[1] + k * d[1])


def push(floor: frozenset[Cell], player: Cell, box: Cell, action: str) -> tuple[Cell, Cell]:
    """Sokoban move: walk, or push the box one cell when the cell beyond it is floor."""
    d = MOVES[action]
    nxt = _shift(player, d)
    if nxt not in floor:
        return player, box
    if nxt == box:
        beyond = _shift(box, d)
        return (nxt, beyond) if beyond in floor else (player, box)
    return nxt, box


def step_reward(was_on: bool, now_on: bool) -> float:
    """gym-sokoban's reward for one valid step with one box (solved = box on target).

    With one box the -1 for pushing it off the target cannot occur in an episode: landing on the target
    solves the level and ends the episode. It is kept so the rule reads as gym-sokoban's.
    """
    reward = STEP_PENALTY
    if now_on and not was_on:
        reward += BOX_ON_REWARD
    if was_on and not now_on:
        reward += BOX_OFF_PENALTY
    if now_on:
        reward += SOLVED_REWARD
    return reward


# gym-sokoban / RAGEN room_utils constants: walk directions and reverse-play move order.
_WALK_DIRECTIONS = ((1, 0), (0, 1), (-1, 0), (0, -1))
_REVERSE_MOVES = ((-1, 0), (1, 0), (0, -1), (0, 1))  # CHANGE_COORDINATES 0..3: up, down, left, right
_P_CHANGE_DIRECTIONS = 0.35
_MAX_EXPLORED = 300_000


def carve(rng: random.Random, size: int, num_steps: int) -> frozenset[Cell]:
    """``room_topology_generation``: a random walk stamping 3x3 masks; the border stays wall."""
    direction = rng.sample(_WALK_DIRECTIONS, 1)[0]
    pos = (rng.randint(1, size - 1), rng.randint(1, size - 1))
    floor: set[Cell] = set()
    for _ in range(num_steps):
        if rng.random() < _P_CHANGE_DIRECTIONS:
            direction = rng.sample(_WALK_DIRECTIONS, 1)[0]
        pos = (max(min(pos[0] + direction[0], size - 2), 1), max(min(pos[1] + direction[1], size - 2), 1))
        mask = rng.sample(_MASKS, 1)[0]
        floor |= {(pos[0] - 1 + i, pos[1] - 1 + j) for i in range(3) for j in range(3) if mask[i][j]}
    return frozenset(c for c in floor if 0 < c[0] < size - 1 and 0 < c[1] < size - 1)


def place(np_rng, floor: frozenset[Cell]) -> tuple[Cell, Cell] | None:
    """``place_boxes_and_player`` with one box: (player, target), or None when the room has <= 2 floor
    cells (RAGEN raises). Cells in row-major order, as ``np.where``."""
    cells = sorted(floor)
    if len(cells) <= 2:
        return None
    player = cells[np_rng.randint(len(cells))]
    rest = [c for c in cells if c != player]
    return player, rest[np_rng.randint(len(rest))]


def reverse_search(floor: frozenset[Cell], target: Cell, player: Cell, search_depth: int) -> tuple[int, Cell, Cell]:
    """RAGEN's ``reverse_playing`` / ``depth_first_search`` for one box starting on ``target``:
    (best score, player, box) of the first state in depth-first order with the highest score."""
    explored: set[tuple[Cell, Cell, bool]] = set()
    best = [-1, player, target]

    def visit(player: Cell, box: Cell, pulled: bool, ttl: int) -> None:
        ttl -= 1
        # RAGEN hashes the room array, where a pulled box is code 3 and the unmoved one code 4: the key
        # holds whether the box was pulled.
        if ttl <= 0 or len(explored) >= _MAX_EXPLORED or (player, box, pulled) in explored:
            return
        score = _displacement(box, target) if pulled and player != target and box != target else 0
        if score > best[0]:
            best[:] = [score, player, box]
        explored.add((player, box, pulled))
        for d in _REVERSE_MOVES:
            nxt, nbox, npulled = _shift(player, d), box, pulled
            if nxt not in floor or nxt == box:
                continue  # blocked: RAGEN recurses into the same, already explored state (a no-op)
            if _shift(player, d, -1) == box:  # the box is right behind the player: pull it
                nbox, npulled = player, True
            visit(nxt, nbox, npulled, ttl)

    visit(player, target, False, search_depth)
    return best[0], best[1], best[2]


def _displacement(a: Cell, b: Cell) -> int:
    return abs(a[0] - b[0]) + abs(a[1] - b[1])


def generate_level(seed: int, size: int, search_depth: int) -> Level:
    """RAGEN's ``generate_room`` for one box and level ``seed`` (see the module docstring)."""
    import numpy as np

    rng, np_rng = random.Random(seed), np.random.RandomState(seed)
    num_steps = int(1.7 * (size + size))  # gym-sokoban's num_gen_steps
    for _ in range(_MAX_TRIES):
        floor = carve(rng, size, num_steps)
        placed = place(np_rng, floor)
        if placed is None:
            continue
        player, target = placed
        score, player, box = reverse_search(floor, target, player, search_depth)
        if score <= 0:
            continue
        level = Level(floor, size, target, box, player)
        if bfs((player, box), _successors(level), lambda s: s[1] == target) is None:
            raise RuntimeError("reverse play produced an unsolvable Sokoban level")
        return level
    raise RuntimeError(f"no Sokoban level with the box off target after {_MAX_TRIES} tries")


def _successors(level: Level):
    def successors(state: tuple[Cell, Cell]) -> Iterator[tuple[str, tuple[Cell, Cell]]]:
        for action in MOVES:
            nxt = push(level.floor, state[0], state[1], action)
            if nxt != state:
                yield action, nxt

    return successors


def render(level: Level, player: Cell, box: Cell) -> str:
    rows = []
    for r in range(level.size):
        row = []
        for c in range(level.size):
            cell, on_target = (r, c), (r, c) == level.target
            if cell == player:
                row.append(PLAYER_ON_TARGET if on_target else PLAYER)
            elif cell == box:
                row.append(BOX_ON_TARGET if on_target else BOX)
            else:
                row.append(WALL if cell not in level.floor else TARGET if on_target else FLOOR)
        rows.append(" ".join(row))
    return "\n".join(rows)


def parse_level(text: str) -> Level:
    """Inverse of ``render`` for a start state (square grid, one player, one box off its target)."""
    rows = [line.split() for line in text.strip().splitlines()]
    size = len(rows)
    if any(len(row) != size for row in rows):
        raise ValueError(f"Sokoban level must be a square grid, got row lengths {[len(r) for r in rows]}")
    found: dict[str, list[Cell]] = {}
    for r, row in enumerate(rows):
        for c, sym in enumerate(row):
            if sym not in (WALL, FLOOR, TARGET, BOX, PLAYER, PLAYER_ON_TARGET):
                raise ValueError(f"unexpected Sokoban symbol {sym!r} at {(r, c)}")
            found.setdefault(sym, []).append((r, c))
    players = found.get(PLAYER, []) + found.get(PLAYER_ON_TARGET, [])
    targets = found.get(TARGET, []) + found.get(PLAYER_ON_TARGET, [])
    if len(players) != 1 or len(found.get(BOX, [])) != 1 or len(targets) != 1:
        raise ValueError("Sokoban level needs exactly one player, one box (off target) and one target")
    floor = frozenset(cell for sym, cells in found.items() if sym != WALL for cell in cells)
    return Level(floor, size, targets[0], found[BOX][0], players[0])


@register_env
class SokobanEnv(Environment):
    name = "sokoban"
    max_turns_default = 5  # RAGEN's Sokoban runs (seed run list: training.max_turns=5)
    action_words = ("up", "down", "left", "right")
    digit_actions = action_words  # RAGEN's ACTION_LOOKUP 1-4
    has_solver = True
    instructions = (
        "You are the player P in a Sokoban puzzle. Push the box X onto the target O. "
        "# is a wall, _ is floor, * is the box on the target, S is you on the target. "
        "Answer with one move: up, down, left or right, as <think>...</think><answer>move</answer>."
    )

    def __init__(self, size: int = 6, search_depth: int = 30, invalid_penalty: float | None = None):
        super().__init__(invalid_penalty)
        if size < 4 or search_depth < 2:
            raise ValueError(f"sokoban: need size >= 4 and search_depth >= 2, got {size}, {search_depth}")
        self.size, self.search_depth = size, search_depth

    def _reset(self, rng: random.Random) -> None:
        self._set(generate_level(self.seed, self.size, self.search_depth))

    def load(self, level_text: str) -> str:
        """Start an episode on a hand-made level (see ``parse_level``); returns its observation."""
        self._begin(0)
        self._set(parse_level(level_text))
        return self.format_observation()

    def _set(self, level: Level) -> None:
        self.level, self.player, self.box = level, level.player, level.box

    def _apply(self, action: str) -> tuple[float, bool, dict]:
        was_on = self.box == self.level.target
        self.player, self.box = push(self.level.floor, self.player, self.box, action)
        now_on = self.box == self.level.target
        return step_reward(was_on, now_on), now_on, {"success": now_on}

    def _noop(self) -> tuple[float, bool, dict]:
        """gym-sokoban's action 0 (no operation): a step penalty, nothing moves."""
        return STEP_PENALTY, False, {"success": False}

    def format_observation(self) -> str:
        return render(self.level, self.player, self.box)

    def solver_state(self) -> tuple[Cell, Cell]:
        return (self.player, self.box)

    def successors(self, state):
        return _successors(self.level)(state)

    def is_goal(self, state) -> bool:
        return state[1] == self.level.target
