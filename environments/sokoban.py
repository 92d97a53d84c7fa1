"""Sokoban, one box (RAGEN early 2025: ``ragen/env/sokoban``, rewards of gym-sokoban by Schrader 2018).

Per valid step: -0.1; pushing the box onto the target +1, off the target -1; solving (box on target)
+10 and the episode ends. Bumping into a wall, or pushing the box into a wall, is a valid step that
changes nothing (-0.1). An invalid answer costs ``invalid_penalty`` (-1) and changes nothing; RAGEN's
tracking added its penalty twice, here it counts once. Turn limits are the caller's ``max_turns``.

Levels (deterministic by seed): a room is carved by a random walk (gym-sokoban's topology generation);
the box starts on the target and the player plays in reverse (moving, sometimes pulling the box) for
``reverse_steps`` moves; the state with the highest pulls x box displacement is kept (gym-sokoban's
room score), then the player wanders 0-3 cells (RAGEN's ``add_random_player_movement``).
Reverse play makes every level solvable; a BFS solve confirms it. Rooms where the box never left the
target are redrawn from the same random stream.

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


def _carve(rng: random.Random, size: int) -> frozenset[Cell]:
    steps = int(1.7 * (size + size))  # gym-sokoban's num_gen_steps
    dirs = list(MOVES.values())
    d = rng.choice(dirs)
    pos = (rng.randint(1, size - 2), rng.randint(1, size - 2))
    floor: set[Cell] = set()
    for _ in range(steps):
        if rng.random() < 0.35:  # gym-sokoban's p_change_directions
            d = rng.choice(dirs)
        pos = (min(max(pos[0] + d[0], 1), size - 2), min(max(pos[1] + d[1], 1), size - 2))
        mask = rng.choice(_MASKS)
        floor |= {(pos[0] - 1 + i, pos[1] - 1 + j) for i in range(3) for j in range(3) if mask[i][j]}
    return frozenset(c for c in floor if 0 < c[0] < size - 1 and 0 < c[1] < size - 1)


def _displacement(a: Cell, b: Cell) -> int:
    return abs(a[0] - b[0]) + abs(a[1] - b[1])


def generate_level(rng: random.Random, size: int, reverse_steps: int) -> Level:
    dirs = list(MOVES.values())
    for _ in range(_MAX_TRIES):
        floor = _carve(rng, size)
        cells = sorted(floor)
        if len(cells) < 3:
            continue
        target = rng.choice(cells)
        player = rng.choice([c for c in cells if c != target])
        box, pulls, best = target, 0, (0, player, target)
        for _ in range(reverse_steps):
            d = rng.choice(dirs)
            nxt = _shift(player, d)
            if nxt not in floor or nxt == box:
                continue
            if _shift(player, d, -1) == box and rng.random() < 0.5:
                box, pulls = player, pulls + 1  # pull: the box follows the player
            player = nxt
            if pulls * _displacement(box, target) > best[0]:
                best = (pulls * _displacement(box, target), player, box)
        score, player, box = best
        if score == 0:
            continue
        displacement = _displacement(box, target)
        player = _wander(rng, floor, player, box, 0.8 if displacement == 1 else 0.5)
        level = Level(floor, size, target, box, player)
        if bfs((player, box), _successors(level), lambda s: s[1] == target) is None:
            raise RuntimeError("reverse play produced an unsolvable Sokoban level")
        return level
    raise RuntimeError(f"no Sokoban level with the box off target after {_MAX_TRIES} tries")


def _wander(rng: random.Random, floor: frozenset[Cell], player: Cell, box: Cell, p_move: float) -> Cell:
    """RAGEN's random player movement after reverse play: w.p. p_move walk 1-3 cells (continuing
    w.p. 1/2), never revisiting a cell, so the player does not always start next to the box."""
    if rng.random() >= p_move:
        return player
    seen = [player]
    for _ in range(3):
        options = [_shift(player, d) for d in MOVES.values()]
        options = [c for c in options if c in floor and c != box and c not in seen]
        if not options:
            break
        player = rng.choice(options)
        seen.append(player)
        if rng.random() >= 0.5:
            break
    return player


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
    has_solver = True
    instructions = (
        "You are the player P in a Sokoban puzzle. Push the box X onto the target O. "
        "# is a wall, _ is floor, * is the box on the target, S is you on the target. "
        "Answer with one move: up, down, left or right, as <think>...</think><answer>move</answer>."
    )

    def __init__(self, size: int = 6, reverse_steps: int = 30, invalid_penalty: float | None = None):
        super().__init__(invalid_penalty)
        if size < 4 or reverse_steps < 1:
            raise ValueError(f"sokoban: need size >= 4 and reverse_steps >= 1, got {size}, {reverse_steps}")
        self.size, self.reverse_steps = size, reverse_steps

    def _reset(self, rng: random.Random) -> None:
        self._set(generate_level(rng, self.size, self.reverse_steps))

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

    def format_observation(self) -> str:
        return render(self.level, self.player, self.box)

    def solver_state(self) -> tuple[Cell, Cell]:
        return (self.player, self.box)

    def successors(self, state):
        return _successors(self.level)(state)

    def is_goal(self, state) -> bool:
        return state[1] == self.level.target
