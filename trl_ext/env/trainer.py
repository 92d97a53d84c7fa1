"""Trainer plumbing of environment runs: the synchronous rollout source (`env_rollout`, TRL's ``rollout_func`` driving
`episodes.play_episodes` with the trainer's own generation). The asynchronous source plays the same episodes in the
generator thread (``offpolicy.trainer``); ``--adv_estimator`` is the estimator stage's (``trl_ext.estimator``)."""

from __future__ import annotations

from trl_ext.env.episodes import log_episodes, log_words, play_episodes, row_envs


def env_rollout(prompts: list, trainer) -> dict:
    """TRL ``rollout_func``: play one episode per prompt (environment and level from the batch rows: ``env``,
    ``env_seed``) with TRL's generation. The sampling log-probs, when the engine gives them, reach TRL as
    ``logprobs`` (its vLLM importance-sampling correction reads them; environment tokens carry 0 and env_mask 0)."""
    rows = trainer._env_rows
    seeds = [row["env_seed"] for row in rows]

    def generate(contexts):  # the engine's sampling log-probs when it returns them (vLLM, the fast backend)
        ids, logprobs = trainer._generate_single_turn(contexts, None, {}, 1)[:2]
        return ids, logprobs, None if logprobs is None else [[0] * len(row) for row in ids]

    out = play_episodes(prompts, seeds, trainer.args, trainer.processing_class, generate, row_envs(rows),
                        lockstep=_lockstep(trainer))
    trainer._env_trajectories = out.pop("trajectories")  # for an environment RH detector (RoutingMixin._detect)
    log_episodes(trainer, trainer._env_trajectories, *log_words(trainer.args))
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


class EnvMixin:
    """The environment rollout source (when ``--env``): TRL's ``rollout_func`` hook is `env_rollout`. The batch rows
    (their ``env_seed``) are ``self._env_rows``, set by ExtGRPOTrainer before generation."""

    def __init__(self, *args, **kwargs):
        cfg = kwargs.get("args")
        if cfg is not None and getattr(cfg, "env", ""):
            if kwargs.get("rollout_func") is not None:
                raise ValueError("--env provides the rollout_func; do not pass another")
            kwargs["rollout_func"] = env_rollout
        super().__init__(*args, **kwargs)
