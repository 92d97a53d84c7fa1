"""Registration of the reward-bound prompt sources (`trl_ext.parts.PROMPT_SOURCES` "stories", the default, and
"dataset": ``--dataset``, `trl_ext.data.load`), scored by the ``--reward`` binding of ``--config``, and of TRL's eval
loop (`trl_ext.parts.FEATURES` "eval_loop": ``--eval_dataset`` with ``--eval_strategy``)."""

from __future__ import annotations

from trl_ext.parts import FEATURES, PROMPT_SOURCES, Feature, PromptSource
from trl_ext.registry import ConfigError


def prompt_source(run) -> str:
    """The `model` argument of `environments.stories.load_prompts` for ``--prompts`` (the story prompts; also the
    held-out prompts of the routing eval and of ``--eval_baseline``)."""
    from environments.stories import BUILTIN_PROMPTS
    from trl_ext.models import STORY_MODELS

    source = run.prompts or (BUILTIN_PROMPTS if run.model in STORY_MODELS else "simplestories")
    return BUILTIN_PROMPTS if source == BUILTIN_PROMPTS else run.model


def check_reward_inputs(run, cfg, reward_config, data=None) -> None:
    """The rewards' dataset columns against the prompts' (``data``: --dataset's `trl_ext.data.load.PromptData`; the
    story prompts have none but "prompt"); a reward that reads more than texts cannot score --eval_baseline's text-only
    samples."""
    names = [run.reward, *run.eval_reward_names, *[cfg.base_reward] * (cfg.base_reward is not None)]
    columns, source = (data.reward_columns, f"--dataset {data.source}") if data else ((), "the story prompts")
    reward_config.check_columns(names, columns, source)
    if cfg.eval_baseline and reward_config.reward(run.reward).needs_context():
        raise ConfigError(f"--eval_baseline scores completion texts alone: reward binding {run.reward!r} reads "
                          "prompts or dataset columns (a TRL-signature function or a reward model)")  # fmt: skip


def check_story_source(run) -> None:
    """The hub's story prompts (``--prompts simplestories``, the default for a model other than the builtin story
    models) loadable at parse time: offline, or with the hub unreachable, `datasets` raises a ConnectionError on every
    rank once the model has loaded; here it is a ConfigError naming the ways on."""
    import datasets

    from environments.stories import BUILTIN_PROMPTS, HUB_DATASET

    if prompt_source(run) == BUILTIN_PROMPTS:
        return
    try:
        datasets.load_dataset_builder(HUB_DATASET)  # the hub's metadata, or the local cache when offline
    except (ConnectionError, OSError) as e:  # OfflineModeIsEnabled, LocalEntryNotFoundError, no network
        given = "--prompts simplestories" if run.prompts else f"--model {run.model} (no --prompts)"
        raise ConfigError(f"{given} takes its prompts from the hub's {HUB_DATASET}, which could not be loaded ({e}); "
                          "pass --prompts builtin (the builtin held-out stories) or --dataset FILE|DIR|HUB_ID (your "
                          "own prompts)") from None


class RewardPromptsPart(PromptSource):
    """Prompts scored by the ``--reward`` binding of ``--config``."""

    def check_args(self, run, cfg) -> None:
        from trl_ext.models.builtin_env import BUILTIN_ENV
        from trl_ext.models.builtin_search import BUILTIN_SEARCH
        from trl_ext.models.builtin_tools import BUILTIN_TOOLS

        if not run.reward:
            raise ConfigError("--reward is required (a reward binding name from --config), or --env")
        if run.model in (BUILTIN_ENV, BUILTIN_SEARCH, BUILTIN_TOOLS):
            raise ConfigError(f"--model {run.model} is an environments' model: use it with --env")

    def check(self, plan) -> None:
        check_reward_inputs(plan.run, plan.cfg, plan.reward_config, plan.train_data)

    def rewards(self, plan) -> dict:
        from rewards.config import trl_reward_args

        return trl_reward_args(plan.run.reward, plan.reward_config.reward(plan.run.reward))  # a reward model: its path


class StoriesPart(RewardPromptsPart):
    """Story prompt prefixes (``--prompts``, `environments.stories.load_prompts`): a run's prompts by default."""

    fallback = True

    def check(self, plan) -> None:
        super().check(plan)
        check_story_source(plan.run)

    def build(self, build) -> tuple[object, dict]:
        from environments.stories import load_prompts

        run, cfg = build.plan.run, build.plan.cfg
        dataset = load_prompts(prompt_source(run), build.tokenizer, run.prompt_length, "train", run.num_prompts,
                               cfg.seed)  # fmt: skip
        return dataset, self.rewards(build.plan)


class DatasetPromptsPart(RewardPromptsPart):
    """``--dataset``: a file, a save_to_disk directory or a hub dataset, loaded at parse time (`trl_ext.data.load`); its
    other columns reach the reward functions. (With ``--env``, `load_run_data` refuses it.)"""

    def selected(self, run, cfg) -> bool:
        return run.dataset is not None and not cfg.env

    def build(self, build) -> tuple[object, dict]:
        return build.plan.train_data.dataset, self.rewards(build.plan)

    def naming(self, run, cfg) -> tuple[list[str], object]:
        return ["--reward", run.reward, "--dataset", run.dataset], run  # compared with the default run on the same data


class EvalLoopPart(Feature):
    """TRL's eval loop on ``--eval_dataset`` (``--eval_strategy steps|epoch``). Under FSDP2 too (TRL generates from the
    sharded model, as in training: tests/test_procs_runs.py); not under DeepSpeed: not run there yet."""

    what = "TRL's eval loop"
    flags = ("eval_strategy",)

    def selected(self, run, cfg) -> bool:
        return run.eval_dataset is not None

    def supports(self, launch) -> str | None:
        return None if launch.sharding == "FSDP" else launch.unsharded(self.what)

    def contribute(self, build) -> None:
        build.kwargs["eval_dataset"] = build.plan.eval_data.dataset


PROMPT_SOURCES.add("stories", StoriesPart())
PROMPT_SOURCES.add("dataset", DatasetPromptsPart())
FEATURES.add("eval_loop", EvalLoopPart())
