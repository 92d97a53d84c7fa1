"""Learning-signal monitor.

GRPO's advantage is reward minus the group mean: when every group has zero reward spread, every
advantage is zero, the policy-gradient loss is exactly 0 and nothing is learned (seed 003's lesson:
hours of training at loss 0.0 unnoticed). `ZeroSignalMonitor` counts such steps in a row and raises
a loud warning once the streak reaches `patience`, then again every `patience` steps it lasts.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

BANNER = "!" * 78


class ZeroSignalMonitor:
    def __init__(self, patience: int):
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        self.patience = patience
        self.streak = 0
        self.warnings = 0

    def state(self) -> dict:
        """What a checkpoint keeps, so a resumed run continues the streak."""
        return {"streak": self.streak, "warnings": self.warnings}

    def load_state(self, state: dict) -> None:
        self.streak, self.warnings = int(state["streak"]), int(state["warnings"])

    def update(self, frac_groups_zero_std: float, step: int) -> str | None:
        """Record one step; return the warning text when one is raised (it is also logged)."""
        if frac_groups_zero_std < 1.0:
            self.streak = 0
            return None
        self.streak += 1
        if self.streak % self.patience != 0:
            return None
        self.warnings += 1
        text = (
            f"\n{BANNER}\nNO LEARNING SIGNAL: every group had zero reward spread for {self.streak} steps in a row "
            f"(up to step {step}). All advantages are 0 and the loss is 0: the policy is not being trained.\n"
            f"Check the reward function, the sampling temperature and the group size.\n{BANNER}"
        )
        logger.warning(text)
        return text
