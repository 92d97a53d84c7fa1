"""The ``--env`` flags (`EnvArgs`, mixed into ExtGRPOConfig) and the level seeds of training and held-out levels
(defined in ``environments.base``: the search environment splits its questions by them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from environments.base import HELDOUT_LEVELS, TRAIN_LEVELS, check_max_turns, env_class, make_env, parse_env_params
from trl_ext.advantages import ADV_ESTIMATORS
from trl_ext.registry import ConfigError

__all__ = ["EnvArgs", "HELDOUT_LEVELS", "TRAIN_LEVELS"]


@dataclass
class EnvArgs:
    env: str = field(
        default="",
        metadata={"help": "Train on a text environment (RAGEN): two_armed_bandit, sokoban, frozenlake, arithmetic, "
                  "prisoners_dilemma, search. Replaces --reward: the reward is the episode's summed step rewards."},
    )  # fmt: skip
    env_params: str = field(
        default="",
        metadata={"help": "Environment parameters, key=value pairs separated by commas (values are YAML scalars), "
                  "e.g. 'slippery=false' or 'size=8,p_frozen=0.9' (frozenlake), 'size=7' (sokoban), "
                  "'strict=true' (any: the strict answer format, no <think> prefill), "
                  "'opponent=always_defect' or 'opponent=random' (prisoners_dilemma), "
                  "'k=5,n_pages=200,corpus_seed=1,page_chars=300' (search). Unset: the environment's defaults."},
    )  # fmt: skip
    max_turns: int | None = field(
        default=None, metadata={"help": "Turns per episode (RAGEN max_turns); default: the environment's own."}
    )
    adv_estimator: str = field(
        default="",
        metadata={"help": "Advantage estimator replacing TRL's: grpo (per group), brpo (whole batch), arpo (raw "
                  "reward) (RAGEN; trl_ext/advantages.py). Empty: TRL's advantage (--scale_rewards)."},
    )  # fmt: skip
    no_think_rl: bool = field(
        default=False, metadata={"help": "RAGEN no_think_rl: train on the bare <answer>X</answer> of each response."}
    )

    def validate_env(self) -> None:
        if self.adv_estimator:
            ADV_ESTIMATORS.get(self.adv_estimator)  # ConfigError listing the estimators
            if self.multi_objective_aggregation != "sum_then_normalize":
                raise ConfigError("--adv_estimator needs --multi_objective_aggregation sum_then_normalize")
        if self.max_turns is not None:
            check_max_turns(self.max_turns)
        if not self.env:
            for flag, on in (("--max_turns", self.max_turns is not None), ("--no_think_rl", self.no_think_rl),
                             ("--env_params", bool(self.env_params))):  # fmt: skip
                if on:
                    raise ConfigError(f"{flag} needs --env")
            return
        self.build_env()  # ConfigError listing the environments, or naming a bad parameter or value

    def build_env(self):
        """A fresh environment ``--env`` with ``--env_params``."""
        return make_env(self.env, **parse_env_params(self.env_params))

    @property
    def turns(self) -> int:
        return self.max_turns if self.max_turns is not None else env_class(self.env).max_turns_default
