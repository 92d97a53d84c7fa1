"""Environments as a component (``--env``): the synchronous rollout source (`env_rollout`, TRL's ``rollout_func``
driving `episodes.play_episodes` with the trainer's own generation). The asynchronous source plays the same episodes
in the generator thread (``trl_ext.offpolicy.component``); ``--adv_estimator`` is the estimator stage's
(``trl_ext.estimator``)."""

from __future__ import annotations

from trl_ext import compat
from trl_ext.batch import BatchContext
from trl_ext.components import Component, register
from trl_ext.env.episodes import episode_columns, log_episodes, log_words, play_episodes, row_envs


def env_rollout(prompts: list, trainer) -> dict:
    """TRL ``rollout_func``: play one episode per prompt (environment and level from the generation batch's rows:
    ``env``, ``env_seed``) with TRL's generation. The sampling log-probs, when the engine gives them, reach TRL as
    ``logprobs`` (its vLLM importance-sampling correction reads them; environment tokens carry 0 and env_mask 0).
    The episodes go to ``ctx.trajectories`` (an environment RH detector judges them)."""
    ctx = trainer.batch_context
    seeds = [row["env_seed"] for row in ctx.rows]

    def generate(contexts):  # the engine's sampling log-probs when it returns them (vLLM, the fast backend)
        ids, logprobs = compat.generate_single_turn(trainer, contexts)[:2]
        return ids, logprobs, None if logprobs is None else [[0] * len(row) for row in ids]

    out = play_episodes(prompts, seeds, trainer.args, trainer.processing_class, generate, row_envs(ctx.rows),
                        lockstep=_lockstep(trainer))
    ctx.trajectories = out.pop("trajectories")
    log_episodes(trainer, ctx.trajectories, *log_words(trainer.args))
    out.pop("versions")
    return out


def _lockstep(trainer):
    """Under FSDP2 on several processes TRL generates from the sharded model, each forward a collective: the episode
    loop plays in lockstep (`episodes.play_episodes`), each turn asking whether any process still plays. None
    elsewhere (each process generates alone)."""
    if not (getattr(trainer, "is_fsdp_enabled", False) and trainer.accelerator.num_processes > 1):
        return None
    import torch

    def any_active(local: bool) -> bool:
        flag = torch.tensor([int(local)], device=trainer.accelerator.device)
        return bool(trainer.accelerator.reduce(flag, reduction="sum").item() > 0)

    return any_active


@register
class Environments(Component):
    """The environment rollout source: TRL's ``rollout_func`` is `env_rollout`; each batch's ``env`` and
    ``env_seed`` join the saved rollouts."""

    name, order = "env", 0

    @classmethod
    def wanted(cls, cfg, kwargs) -> bool:
        return bool(cfg.env)

    def __init__(self, trainer, kwargs: dict, options: dict) -> None:
        super().__init__(trainer, kwargs, options)
        if kwargs.get("rollout_func") is not None:
            raise ValueError("--env provides the rollout_func; do not pass another")
        kwargs["rollout_func"] = env_rollout

    def needs_every_reward(self) -> str | None:
        return "the environment's reward"

    def score(self, batch: dict, ctx: BatchContext) -> None:
        ctx.columns.update(episode_columns(ctx.rows))

    def batch_keys(self, ctx: BatchContext) -> dict[str, bool]:
        return {"env": True}
