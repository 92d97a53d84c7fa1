"""Registration of the environments (`trl_ext.parts`): their prompts (`PROMPT_SOURCES` "env": ``--env``, one
environment or a mixture; their levels are the prompts and the episode's summed step rewards the reward), their
flags (`FEATURES` "env") and SFT mode (`FEATURES` "sft")."""

from __future__ import annotations

import dataclasses

from trl_ext.env.args import EnvArgs
from trl_ext.parts import FEATURES, PROMPT_SOURCES, Feature, PromptSource
from trl_ext.registry import ConfigError
from trl_ext.sft import SFTArgs


class EnvPromptsPart(PromptSource):
    """``--env``: levels of one environment, or a mixture's shares (`trl_ext.env.episodes.mixture_dataset`)."""

    def selected(self, run, cfg) -> bool:
        return bool(cfg.env or cfg.env_factory)

    def check_args(self, run, cfg) -> None:
        """--env replaces --reward (the environment's reward is the reward) and needs a tokenizer for its text."""
        from trl_ext.models import STORY_MODELS
        from trl_ext.models.builtin_env import BUILTIN_ENV
        from trl_ext.models.builtin_search import BUILTIN_SEARCH

        if run.reward or run.eval_reward_names:
            raise ConfigError("--env and --reward/--eval_rewards exclude each other: the environment gives the reward")
        if run.model in STORY_MODELS:
            raise ConfigError(f"--env needs --model {BUILTIN_ENV} (or an instruct model): the {run.model} model's "
                              "tokenizer has no symbols for the environments' text (< > _ * # digits)")  # fmt: skip
        if cfg.tool_env:
            from trl_ext.models.builtin_tools import BUILTIN_TOOLS

            if run.model in (*STORY_MODELS, BUILTIN_ENV, BUILTIN_SEARCH):
                raise ConfigError(f"a tool environment needs a chat model whose template writes tool calls: --model "
                                  f"{BUILTIN_TOOLS} (builtin) or an instruct model (Qwen2.5, Qwen3, Llama 3.1+, ...); "
                                  f"{run.model}'s tokenizer has no tool-call template")  # fmt: skip
            return
        if run.model == BUILTIN_SEARCH and set(cfg.env_names) != {"search"}:
            raise ConfigError(f"--model {BUILTIN_SEARCH} was pretrained on search episodes only (its tokenizer lacks "
                              f"the other environments' symbols): use it with --env search, or --model {BUILTIN_ENV}")

    def build(self, build) -> tuple[object, dict]:
        from trl_ext.env.episodes import env_reward, mixture_dataset

        plan = build.plan
        if plan.cfg.tool_env:  # the tool environment's rows; the column env names it in saved rollouts
            rows = plan.cfg.tool_dataset(plan.run.num_prompts)
            if "env" not in rows.column_names:
                rows = rows.add_column("env", [plan.cfg.env_names[0]] * len(rows))
            return rows, {"reward_funcs": [env_reward]}
        return mixture_dataset(plan.cfg, plan.run.num_prompts, build.tokenizer), {"reward_funcs": [env_reward]}

    def naming(self, run, cfg) -> tuple[list[str], object]:
        from trl_ext.env.mixture import env_tag

        if cfg.env_factory:
            return ["--env_factory", cfg.env_factory], dataclasses.replace(run, reward=f"rl-{cfg.env_names[0]}")
        return ["--env", cfg.env], dataclasses.replace(run, reward=f"{cfg.mode}-{env_tag(cfg.env)}")


PROMPT_SOURCES.add("env", EnvPromptsPart())


class EnvPart(Feature):
    """The environments' flags (levels, turns, advantage estimators, ``--no_think_rl``), read by the trainer's episode
    loop and estimators. Under FSDP2 the synchronous episode loop plays in lockstep over the processes (TRL generates
    from the sharded model, each forward a collective: `trl_ext.env.component`); the off-policy generator plays on its
    plain copy. Not under DeepSpeed: not run there."""

    what = "environments"
    flags = EnvArgs

    def supports(self, launch) -> str | None:
        return None if launch.sharding == "FSDP" else launch.unsharded(self.what)


class SftPart(Feature):
    """``--mode sft``: TRL's SFTTrainer on an environment's BFS trajectories (`trl_ext.sft.run_sft`) instead of GRPO.
    Under FSDP2 it trains sharded, and the main process merges, saves and validates a plain copy loaded with the
    whole parameters gathered from the shards (`trl_ext.sft.gather_into`). Not under DeepSpeed: not run there."""

    what = "SFT mode"
    flags = SFTArgs

    def selected(self, run, cfg) -> bool:
        return cfg.mode == "sft"

    def supports(self, launch) -> str | None:
        return None if launch.sharding == "FSDP" else launch.unsharded(self.what)

    def check(self, plan) -> None:
        """SFT trains by --sft_epochs; a given --max_steps ends it at that step (HF's max_steps over epochs), said
        when both are given (a recipe's epochs and a short command-line run)."""
        import warnings

        if {"max_steps", "sft_epochs"} <= set(plan.flags or {}):
            warnings.warn(f"--mode sft: --max_steps {plan.cfg.max_steps} ends the run, before --sft_epochs "
                          f"{plan.cfg.sft_epochs:g} would", stacklevel=2)

    def run(self, plan) -> int | None:
        from trl_ext.sft import run_sft

        return run_sft(plan)


FEATURES.add("env", EnvPart())
FEATURES.add("sft", SftPart())
