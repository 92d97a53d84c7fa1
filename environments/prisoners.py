"""Iterated prisoner's dilemma against a fixed opponent strategy.

Each turn is one round: the agent and the opponent each cooperate or defect and the agent's step reward
is its payoff with the standard values T=5 (defect vs cooperate), R=3 (both cooperate), P=1 (both
defect), S=0 (cooperate vs defect) (Axelrod & Hamilton 1981). The episode ends after ``n_rounds``
rounds. An invalid answer costs ``invalid_penalty`` (-1) and does not play a round.

Opponents: ``tit_for_tat`` (cooperate first, then copy the agent's previous move), ``always_defect``,
``random`` (cooperate w.p. 1/2 from the stream seeded by ``reset(seed)``).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from trl_ext.registry import Registry

from .base import Environment, register_env

COOPERATE, DEFECT = "cooperate", "defect"
T, R, P, S = 5.0, 3.0, 1.0, 0.0
PAYOFF = {  # (agent move, opponent move) -> (agent payoff, opponent payoff)
    (COOPERATE, COOPERATE): (R, R),
    (COOPERATE, DEFECT): (S, T),
    (DEFECT, COOPERATE): (T, S),
    (DEFECT, DEFECT): (P, P),
}
DEFAULT_ROUNDS = 5

# An opponent maps (the agent's previous moves, random stream) to its move.
OPPONENTS: Registry[Callable[[list[str], random.Random], str]] = Registry("prisoner's dilemma opponent")


@OPPONENTS.register("tit_for_tat")
def tit_for_tat(agent_moves: list[str], rng: random.Random) -> str:
    return agent_moves[-1] if agent_moves else COOPERATE


@OPPONENTS.register("always_defect")
def always_defect(agent_moves: list[str], rng: random.Random) -> str:
    return DEFECT


@OPPONENTS.register("random")
def random_opponent(agent_moves: list[str], rng: random.Random) -> str:
    return COOPERATE if rng.random() < 0.5 else DEFECT


@register_env
class PrisonersDilemmaEnv(Environment):
    name = "prisoners_dilemma"
    max_turns_default = DEFAULT_ROUNDS
    action_words = (COOPERATE, DEFECT)
    instructions = (
        "You play repeated rounds of the prisoner's dilemma. Each round you and the opponent cooperate or "
        "defect. Both cooperate: 3 points each. Both defect: 1 each. If you defect and the opponent "
        "cooperates you get 5 and they get 0, and the other way round. Score as many points as you can. "
        "Answer with cooperate or defect, as <think>...</think><answer>move</answer>."
    )

    def __init__(
        self, opponent: str = "tit_for_tat", n_rounds: int = DEFAULT_ROUNDS, invalid_penalty: float | None = None
    ):
        super().__init__(invalid_penalty)
        self.opponent_name, self.opponent = opponent, OPPONENTS.get(opponent)
        if isinstance(n_rounds, bool) or not isinstance(n_rounds, int) or n_rounds < 1:
            raise ValueError(f"prisoners_dilemma: n_rounds must be an int >= 1, got {n_rounds!r}")
        self.n_rounds = n_rounds

    def _reset(self, rng: random.Random) -> None:
        self.agent_moves: list[str] = []
        self.opponent_moves: list[str] = []
        self.scores = [0.0, 0.0]

    def _apply(self, action: str) -> tuple[float, bool, dict]:
        theirs = self.opponent(self.agent_moves, self.rng)
        mine, their_payoff = PAYOFF[(action, theirs)]
        self.agent_moves.append(action)
        self.opponent_moves.append(theirs)
        self.scores = [self.scores[0] + mine, self.scores[1] + their_payoff]
        return mine, len(self.agent_moves) == self.n_rounds, {"opponent_move": theirs}

    def format_observation(self) -> str:
        played = len(self.agent_moves)
        lines = []
        if played:
            lines.append(f"last round: you {self.agent_moves[-1]}, opponent {self.opponent_moves[-1]}.")
        lines.append(f"your points {self.scores[0]:g}, opponent points {self.scores[1]:g}.")
        if played == self.n_rounds:
            lines.append("the game is over.")
        else:
            lines.append(f"round {played + 1} of {self.n_rounds}. cooperate or defect?")
        return "\n".join(lines)
