"""Registration of the environments' prompts (`trl_ext.parts.PROMPT_SOURCES` "env": ``--env``, one environment or a
mixture): their levels are the prompts and the episode's summed step rewards the reward."""

from __future__ import annotations

import dataclasses

from trl_ext.parts import PROMPT_SOURCES, PromptSource
from trl_ext.registry import ConfigError


class EnvPrompts(PromptSource):
    """``--env``: levels of one environment, or a mixture's shares (`trl_ext.env.episodes.mixture_dataset`)."""

    def selected(self, run, cfg) -> bool:
        return bool(cfg.env)

    def check_args(self, run, cfg) -> None:
        """--env replaces --reward (the environment's reward is the reward) and needs a tokenizer for its text."""
        from trl_ext.models import STORY_MODELS
        from trl_ext.models.builtin_env import BUILTIN_ENV
        from trl_ext.models.builtin_search import BUILTIN_SEARCH

        if run.reward or run.eval_reward_names:
            raise ConfigError("--env and --reward/--eval_rewards exclude each other: the environment gives the reward")
        if cfg.max_async_level > 0 and cfg.no_think_rl:
            raise ConfigError("--no_think_rl rewrites the sampled answer, so its tokens have no behaviour log-probs: "
                              "it needs --max_async_level 0")  # fmt: skip
        if run.model in STORY_MODELS:
            raise ConfigError(f"--env needs --model {BUILTIN_ENV} (or an instruct model): the {run.model} model's "
                              "tokenizer has no symbols for the environments' text (< > _ * # digits)")  # fmt: skip
        if run.model == BUILTIN_SEARCH and set(cfg.env_names) != {"search"}:
            raise ConfigError(f"--model {BUILTIN_SEARCH} was pretrained on search episodes only (its tokenizer lacks "
                              f"the other environments' symbols): use it with --env search, or --model {BUILTIN_ENV}")

    def build(self, build) -> tuple[object, dict]:
        from trl_ext.env.episodes import env_reward, mixture_dataset

        plan = build.plan
        return mixture_dataset(plan.cfg, plan.run.num_prompts, build.tokenizer), {"reward_funcs": [env_reward]}

    def naming(self, run, cfg) -> tuple[list[str], object]:
        from trl_ext.env.mixture import env_tag

        return ["--env", cfg.env], dataclasses.replace(run, reward=f"{cfg.mode}-{env_tag(cfg.env)}")


PROMPT_SOURCES.add("env", EnvPrompts())
