"""Two-armed bandit (RAGEN commit 381b659, 2025-02-15: ``ragen/env/bandit/env.py`` ``TwoArmedBanditEnv``
and the prompt of ``ragen/env/bandit/create_dataset_two_armed.py``).

One step. The arms have names, by default ``phoenix`` (the low-risk arm) and ``dragon`` (the high-risk
arm); the prompt lists them in an order shuffled per seed (``random.Random(seed).shuffle``, as RAGEN) and
asks the model to infer each arm's risk from its name (RAGEN's prompt, condensed: see ``PROMPT``). Answers: an arm name, or RAGEN's digits ``1``
(always the low-risk arm) and ``2`` (the high-risk arm), whatever the shown order. Payoffs, drawn from
the episode's stream seeded by ``reset(seed)``:

- low-risk:  N(0.2, 0.1)                               mean 0.2,   std 0.1
- high-risk: N(0.1, 0.1) w.p. 0.75, else N(1.0, 0.1)   mean 0.325, std sqrt(0.161875) ~ 0.402

The high-risk arm has the higher mean, the low-risk arm wins a single draw more often (RAGEN: P(L > H)
~ 0.57). An invalid answer ends the episode with reward 0 (RAGEN's ``PENALTY_FOR_INVALID = 0`` here).
``info["risk"]`` is ``low`` or ``high`` for a valid pull.
"""

from __future__ import annotations

import random
import re

from .base import Environment, register_env

LOW_MEAN, STD = 0.2, 0.1
HIGH_LOW_MEAN, HIGH_HIGH_MEAN, HIGH_JACKPOT_PROB = 0.1, 1.0, 0.25
LOW_RISK_NAME, HIGH_RISK_NAME = "phoenix", "dragon"  # RAGEN's config/two_armed_bandit.yaml
_NAME = re.compile(r"[a-z]+")
# RAGEN's prompt (``intro`` of create_dataset_two_armed.py, 380 builtin_env tokens), condensed to its
# content so that prompt and answer fit the builtin models' 128-token pretraining window: the game, the
# names in the shuffled order, that the reward distributions relate to the names, and the question.
PROMPT = (
    "You are playing a two-armed bandit game. There are 2 arms, named {name_a} and {name_b}. Each arm has its "
    "own reward distribution, related to their names. Based on the symbolic meaning of their names, which arm "
    "do you think is more likely to give higher rewards on average? Choose between {name_a} and {name_b}."
)


def pull(rng: random.Random, risk: str) -> float:
    if risk == "low":
        return rng.gauss(LOW_MEAN, STD)
    if rng.random() < HIGH_JACKPOT_PROB:
        return rng.gauss(HIGH_HIGH_MEAN, STD)
    return rng.gauss(HIGH_LOW_MEAN, STD)


@register_env
class TwoArmedBanditEnv(Environment):
    name = "two_armed_bandit"
    max_turns_default = 1
    invalid_penalty = 0.0
    single_step = True
    instructions = "Pull one of the two arms to get the most reward. Answer with the arm's name, as <answer>name</answer>."

    def __init__(self, low_risk_name: str = LOW_RISK_NAME, high_risk_name: str = HIGH_RISK_NAME,
                 invalid_penalty: float | None = None):  # fmt: skip
        super().__init__(invalid_penalty)
        for arm in (low_risk_name, high_risk_name):
            if not isinstance(arm, str) or not _NAME.fullmatch(arm) or arm == "none":
                raise ValueError(f"two_armed_bandit: arm names must be lower-case words other than none, got {arm!r}")
        if low_risk_name == high_risk_name:
            raise ValueError(f"two_armed_bandit: the arms need different names, got {low_risk_name!r} twice")
        self.action_words = (low_risk_name, high_risk_name)
        self.digit_actions = self.action_words  # RAGEN: 1 = low-risk arm, 2 = high-risk arm

    def _reset(self, rng: random.Random) -> None:
        rng.shuffle(names := list(self.action_words))  # the stream's first draw: RAGEN's per-seed shuffle
        self.shown: list[str] = names
        self.pulled: str | None = None

    def parse_action(self, answer: str) -> str | None:
        """RAGEN's ``extract_action``: ``^\\s*(\\d+|low name|high name)\\s*$``, case-insensitive; a number
        must be 1 or 2 (``01`` is 1)."""
        word = answer.strip().lower()
        if word in self.action_words:
            return word
        if not self.strict and word.isascii() and word.isdigit() and int(word) in (1, 2):
            return self.digit_actions[int(word) - 1]
        return None

    def _apply(self, action: str) -> tuple[float, bool, dict]:
        self.pulled = action
        risk = "low" if action == self.action_words[0] else "high"
        return pull(self.rng, risk), True, {"risk": risk}

    def format_observation(self) -> str:
        if self.pulled is None:
            return PROMPT.format(name_a=self.shown[0], name_b=self.shown[1])
        return f"You pulled machine {self.pulled}."
