"""Environments as a component (``--env``, ``--env_factory``, ``environment_factory=``): the synchronous rollout
source (`env_rollout`, TRL's ``rollout_func`` driving `episodes.play` with the trainer's own generation). The asynchronous source plays the same episodes
in the generator thread (``trl_ext.offpolicy.component``); ``--adv_estimator`` is the estimator stage's
(``trl_ext.estimator``)."""

from __future__ import annotations

from trl_ext import compat
from trl_ext.batch import BatchContext
from trl_ext.components import Component, register
from trl_ext.env.episodes import episode_columns, named_env_reward
from trl_ext.env.source import context_length, episode_source, take_episodes


def env_rollout(prompts: list, trainer) -> dict:
    """TRL ``rollout_func``: play one episode per row of the generation batch (``trainer.episode_source``: text
    environments from the rows' ``env`` and ``env_seed``, or a tool environment from the columns its reset reads) with
    TRL's generation. The sampling log-probs, when the engine gives them, reach TRL as ``logprobs`` (its vLLM
    importance-sampling correction reads them; environment tokens carry 0 and env_mask 0). The episodes go to
    ``ctx.trajectories`` (an environment RH detector judges them); a tool environment's instances to
    ``trainer.environments`` (TRL's reward functions get them as ``environments=``)."""
    ctx = trainer.batch_context

    def generate(contexts):  # the engine's sampling log-probs when it returns them (vLLM, the fast backend)
        ids, logprobs = compat.generate_single_turn(trainer, contexts)[:2]
        return ids, logprobs, None if logprobs is None else [[0] * len(row) for row in ids]

    source = trainer.episode_source
    out = source.play(ctx.rows, trainer.processing_class, generate, _lockstep(trainer), context_length(trainer))
    take_episodes(trainer, ctx, out)
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
    ``env_seed`` join the saved rollouts. A tool environment (``--env`` naming one, ``--env_factory``, or the Python
    API's ``environment_factory=``, taken out of TRL's arguments so that TRL's own tool loop does not run) plays in
    the same loop; its reward is ``get_reward()``, named after its class."""

    name, order = "env", 0

    @classmethod
    def wanted(cls, cfg, kwargs) -> bool:
        return bool(cfg.env or cfg.env_factory) or kwargs.get("environment_factory") is not None

    def __init__(self, trainer, kwargs: dict, options: dict) -> None:
        super().__init__(trainer, kwargs, options)
        if kwargs.get("rollout_func") is not None:
            raise ValueError("the environment provides the rollout_func; do not pass another")
        factory = kwargs.pop("environment_factory", None)
        if factory is not None and (kwargs["args"].env or kwargs["args"].env_factory):
            raise ValueError("args.env / args.env_factory name the environment; do not pass environment_factory too")
        if factory is not None and kwargs.get("tools"):
            raise ValueError("tools= beside environment_factory: give the tools as methods of the environment class")
        self.source = episode_source(kwargs["args"], factory)
        if factory is not None:  # train.py's prompt source gives env_reward; the API's factory brings its own
            funcs = kwargs.get("reward_funcs")
            funcs = [] if funcs is None else list(funcs) if isinstance(funcs, list) else [funcs]
            kwargs["reward_funcs"] = [*funcs, named_env_reward(self.source.name)]
        kwargs["rollout_func"] = env_rollout

    def setup(self) -> None:
        self.trainer.episode_source = self.source  # the off-policy generator and the routing eval play with it

    def needs_every_reward(self) -> str | None:
        return "the environment's reward"

    def score(self, batch: dict, ctx: BatchContext) -> None:
        ctx.columns.update(episode_columns(ctx.rows))

    def batch_keys(self, ctx: BatchContext) -> dict[str, bool]:
        return {"env": True}
