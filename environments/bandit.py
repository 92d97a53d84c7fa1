"""Two-armed bandit (RAGEN early 2025: ``ragen/env/bandit/env.py``, ``TwoArmedBanditEnv``).

One step. Action words: ``low`` (the low-risk arm) and ``high`` (the high-risk arm); RAGEN named the
arms "phoenix" and "dragon". Payoffs, drawn from the episode's stream seeded by ``reset(seed)``:

- low:  N(0.2, 0.1)                               mean 0.2,   std 0.1
- high: N(0.1, 0.1) w.p. 0.75, else N(1.0, 0.1)   mean 0.325, std sqrt(0.161875) ~ 0.402

The high arm has the higher mean, the low arm wins a single draw more often (RAGEN: P(L > H) ~ 0.57).
An invalid answer ends the episode with ``invalid_penalty`` (-1, the project's common value; RAGEN's
two-armed bandit used 0, pass ``invalid_penalty=0.0`` to reproduce it).
"""

from __future__ import annotations

import random

from .base import Environment, register_env

LOW_MEAN, STD = 0.2, 0.1
HIGH_LOW_MEAN, HIGH_HIGH_MEAN, HIGH_JACKPOT_PROB = 0.1, 1.0, 0.25


def pull(rng: random.Random, arm: str) -> float:
    if arm == "low":
        return rng.gauss(LOW_MEAN, STD)
    if rng.random() < HIGH_JACKPOT_PROB:
        return rng.gauss(HIGH_HIGH_MEAN, STD)
    return rng.gauss(HIGH_LOW_MEAN, STD)


@register_env
class TwoArmedBanditEnv(Environment):
    name = "two_armed_bandit"
    max_turns_default = 1
    action_words = ("low", "high")
    single_step = True
    instructions = (
        "There are two slot machine arms, low and high. Each pays a random reward. "
        "Pull one arm to get the most reward. Answer with low or high, as <think>...</think><answer>arm</answer>."
    )

    def _reset(self, rng: random.Random) -> None:
        self.pulled: str | None = None

    def _apply(self, action: str) -> tuple[float, bool, dict]:
        self.pulled = action
        return pull(self.rng, action), True, {}

    def format_observation(self) -> str:
        if self.pulled is None:
            return "two arms: low and high. which arm do you pull?"
        return f"you pulled {self.pulled}."
