"""Trainer plumbing of environment runs: the synchronous rollout source (`env_rollout`, TRL's ``rollout_func`` driving
`episodes.play_episodes` with the trainer's own generation) and the ``--adv_estimator`` override (`EnvMixin`)."""

from __future__ import annotations

import torch

from trl_ext.advantages import compute_advantages
from trl_ext.env.episodes import log_episodes, play_episodes

def env_rollout(prompts: list, trainer) -> dict:
    """TRL ``rollout_func``: play one episode per prompt (seeds from the batch rows) with TRL's generation."""
    seeds = [row["env_seed"] for row in trainer._env_rows]

    def generate(contexts):
        return trainer._generate_single_turn(contexts, None, {}, 1)[0], None, None

    out = play_episodes(prompts, seeds, trainer.args, trainer.processing_class, generate)
    trainer._env_trajectories = out.pop("trajectories")  # for an environment RH detector (RoutingMixin._detect)
    log_episodes(trainer, trainer._env_trajectories, trainer.args.build_env().action_words)
    out.pop("versions")
    return out


class EnvMixin:
    """GRPOTrainer hooks: the environment rollout (when ``--env``) and the advantage estimator override."""

    def __init__(self, *args, **kwargs):
        cfg = kwargs.get("args")
        if cfg is not None and getattr(cfg, "env", ""):
            if kwargs.get("rollout_func") is not None:
                raise ValueError("--env provides the rollout_func; do not pass another")
            kwargs["rollout_func"] = env_rollout
        super().__init__(*args, **kwargs)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._rewards_per_func = rewards_per_func
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        self._env_rows = inputs  # env_rollout reads each row's env_seed (same order as the prompts)
        batch = super()._generate_and_score_completions(inputs)
        if self.args.adv_estimator:
            batch["advantages"] = self.estimator_advantages(len(inputs))
        return batch

    def estimator_advantages(self, n_local: int) -> torch.Tensor:
        """``--adv_estimator`` on the weighted reward sum of the whole (all-process) batch, local slice."""
        per_func = self._rewards_per_func
        rewards = (per_func * self.reward_weights.to(per_func.device).unsqueeze(0)).nansum(dim=1)
        group = self.num_generations if self.model.training else self.num_generations_eval
        adv = compute_advantages(self.args.adv_estimator, rewards, group)
        start = self.accelerator.process_index * n_local
        return adv[start : start + n_local]
