"""The ``--env`` flags (`EnvArgs`, mixed into ExtGRPOConfig) and the level seeds of training and held-out levels
(defined in ``environments.base``: the search environment splits its questions by them). ``--env`` may name a
mixture of environments (`trl_ext.env.mixture`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from environments.base import HELDOUT_LEVELS, TRAIN_LEVELS, check_max_turns, env_class, make_env, parse_env_params
from trl_ext.advantages import ADV_ESTIMATORS
from trl_ext.env.mixture import parse_env_spec, split_env_params
from trl_ext.env.tools import TOOL_ENVIRONMENTS, check_factory, load_factory
from trl_ext.registry import ConfigError

__all__ = ["EnvArgs", "HELDOUT_LEVELS", "TRAIN_LEVELS"]


@dataclass
class EnvArgs:
    _argument_group_name = "environments (trl_ext.env)"  # train.py --help group (cli_help.py)

    env: str = field(
        default="",
        metadata={"help": "Train on a text environment (RAGEN): two_armed_bandit, sokoban, frozenlake, arithmetic, "
                  "prisoners_dilemma, search; or a tool environment (tool calls, chat models whose template renders them): "
                  "search_tools, ml_task. Replaces --reward: the reward is the episode's summed step rewards. "
                  "A mixture: names separated by commas, each with an optional integer weight, e.g. "
                  "'frozenlake:2,sokoban,arithmetic' (shares 2:1:1 of the prompts; a group never mixes them)."},
    )  # fmt: skip
    env_params: str = field(
        default="",
        metadata={"help": "Environment parameters, key=value pairs separated by commas (values are YAML scalars), "
                  "e.g. 'slippery=false' or 'size=8,p_frozen=0.9' (frozenlake), 'size=7' (sokoban), "
                  "'strict=true' (any: the strict answer format, no <think> prefill), "
                  "'opponent=always_defect' or 'opponent=random' (prisoners_dilemma), "
                  "'k=5,n_pages=200,corpus_seed=1,page_chars=300' (search). A mixture: 'frozenlake.size=8' sets one "
                  "environment's parameter; a bare key must be accepted by all. Unset: the environment's defaults."},
    )  # fmt: skip
    env_factory: str = field(
        default="",
        metadata={"help": "Train on your own tool environment: module:Class in TRL's environment_factory convention "
                  "(reset(**row), public methods as tools, get_reward()), played by the project's episode loop with "
                  "every extension; --env_params are its constructor's keyword arguments; its rows come from "
                  "--dataset. Excludes --env."},
    )  # fmt: skip
    max_turns: int | None = field(
        default=None, metadata={"help": "Turns per episode (RAGEN max_turns), for every environment of a mixture "
                                     "alike; default: each environment's own."}
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
        if self.max_async_level > 0 and self.no_think_rl:
            raise ConfigError("--no_think_rl rewrites the sampled answer, so its tokens have no behaviour log-probs: "
                              "it needs --max_async_level 0")  # fmt: skip
        if self.adv_estimator:
            ADV_ESTIMATORS.get(self.adv_estimator)  # ConfigError listing the estimators
            if self.multi_objective_aggregation != "sum_then_normalize":
                raise ConfigError("--adv_estimator needs --multi_objective_aggregation sum_then_normalize")
        if self.max_turns is not None:
            check_max_turns(self.max_turns)
        if self.env and self.env_factory:
            raise ConfigError("--env and --env_factory exclude each other: give one environment")
        if not self.env and not self.env_factory:
            for flag, on in (("--max_turns", self.max_turns is not None), ("--no_think_rl", self.no_think_rl),
                             ("--env_params", bool(self.env_params))):  # fmt: skip
                if on:
                    raise ConfigError(f"{flag} needs --env")
            return
        if self.tool_env:
            self._check_tool_env()
            return
        for name in self.env_names:
            self.build_env(name)  # ConfigError listing the environments, or naming a bad parameter or value
        if len(self.env_names) > 1:
            self._check_mixture()

    def _check_mixture(self) -> None:
        """What a mixture does not support (yet), refused before anything is loaded."""
        refused = {
            "--mode sft": (self.mode == "sft", "its BFS data and validation are one environment's"),
            "gradient routing (a dual LoRA config, --rh_detector)": (
                self.dual_lora or bool(self.rh_detector),
                "its detectors and held-out routing eval are one environment's"),
        }  # fmt: skip
        for what, (on, why) in refused.items():
            if on:
                raise ConfigError(f"--env {self.env}: a mixture of environments does not support {what}: {why}")

    def _check_tool_env(self) -> None:
        """A tool environment (``--env`` naming one, or ``--env_factory``): one instance built now (its parameters,
        its tools' schemas, its sandbox: ConfigError), a turn limit known, and no text-action flag."""
        if self.no_think_rl:
            raise ConfigError("--no_think_rl rewrites RAGEN's <answer> tags; a tool environment's actions are tool "
                              "calls")  # fmt: skip
        if self.mode == "sft":
            raise ConfigError("--mode sft trains on an environment's solver trajectories; a tool environment has "
                              "none: warm-start with trl_ext.sft_tools or TRL's SFTTrainer on its scripted episodes")
        check_factory(self.tool_factory(), f"--env {self.env}" if self.env else f"--env_factory {self.env_factory}")
        self.tool_turns  # noqa: B018 (ConfigError when no turn limit is known)
        self.tool_dataset(1)  # ConfigError when there are no rows

    @property
    def tool_env(self) -> bool:
        """Whether the run's environment is a tool environment (`trl_ext.env.tools`)."""
        return bool(self.env_factory) or self.env in TOOL_ENVIRONMENTS

    def tool_factory(self):
        """The tool environment's factory with its ``--env_params`` (a fresh instance per call)."""
        return load_factory(self.tool_spec, parse_env_params(self.env_params))

    @property
    def tool_spec(self) -> str:
        """``module:Class`` of the tool environment (--env_factory, or the registered one --env names)."""
        return self.env_factory or TOOL_ENVIRONMENTS[self.env]

    def tool_class(self) -> type:
        """The tool environment's class (its factory's, for a ``module:function``)."""
        factory = self.tool_factory()
        return getattr(factory, "func", factory)

    def tool_dataset(self, n: int, heldout: bool = False):
        """``n`` rows of the tool environment's levels (held-out ones for the routing eval): its class's
        ``dataset(n_rows, heldout=False)`` classmethod."""
        fn = getattr(self.tool_class(), "dataset", None)
        if not callable(fn):
            raise ConfigError(f"--env_factory {self.env_factory}: the class must define a classmethod dataset(n_rows, "
                              "heldout=False) returning its rows (a datasets.Dataset with 'prompt' and the columns "
                              "reset reads; a plain method would be a tool): train.py takes the training rows from it")
        rows = fn(n, heldout=heldout)
        if "prompt" not in rows.column_names:
            raise ConfigError(f"--env {self.env or self.env_factory}: its dataset has no 'prompt' column")
        return rows

    @property
    def tool_turns(self) -> int:
        """Agent turns per tool episode: --max_turns, else the class's ``max_turns_default`` (ConfigError when it
        has none)."""
        if self.max_turns is not None:
            return self.max_turns
        default = getattr(self.tool_class(), "max_turns_default", None)
        if default is None:
            raise ConfigError(f"--env_factory {self.env_factory}: give --max_turns (agent turns per episode); the "
                              "class defines no max_turns_default")  # fmt: skip
        return check_max_turns(default)

    @property
    def env_mixture(self) -> list:
        """``--env`` parsed: [`mixture.Component`] (name, weight), one for a single environment (a tool
        environment: its name, or --env_factory's class name)."""
        if self.tool_env:
            from trl_ext.env.mixture import Component

            return [Component(self.env or self.env_factory.partition(":")[2], 1)]
        return parse_env_spec(self.env)

    @property
    def env_names(self) -> list[str]:
        return [c.name for c in self.env_mixture]

    def build_env(self, name: str | None = None):
        """A fresh environment ``name`` (default: the one ``--env`` names; a mixture must say which) with its
        ``--env_params``."""
        names = self.env_names
        if name is None:
            if len(names) > 1:
                raise ValueError(f"--env {self.env} is a mixture: name the environment to build")
            name = names[0]
        if name not in names:
            raise ValueError(f"environment {name!r} is not in --env {self.env}")
        return make_env(name, **split_env_params(self.env_params, names)[name])

    def env_turns(self, name: str) -> int:
        """Turn limit of environment ``name``'s episodes: --max_turns, else the environment's own."""
        return self.max_turns if self.max_turns is not None else env_class(name).max_turns_default

    @property
    def turns(self) -> int:
        """The episode loop's turn bound: the largest turn limit of --env's environments."""
        return max(self.env_turns(name) for name in self.env_names)
