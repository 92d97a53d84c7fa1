"""Outcome advantage estimators: pure functions (rewards[N], group_size) -> advantages[N].

RAGEN (early 2025) computes all three with verl's ``compute_grpo_outcome_advantage`` and a grouping id:
``grpo`` groups rollouts of the same environment seed, ``brpo`` puts the whole batch in one group,
``arpo`` gives every rollout its own group. Formula of GRPO (Shao et al. 2024, DeepSeekMath
§4.1.2, outcome supervision): A_i = (r_i - mean(group)) / (std(group) + eps).

Conventions (verl's, which RAGEN used): std is the unbiased sample std (Bessel's n-1, ``torch.std``
default); eps = 1e-6. Statistics are computed in float64 and the result cast back to the rewards' dtype,
so a group of equal rewards gets advantages within ~1e-9 of 0 (float64 rounding of the mean / eps).
Differences from verl, made to fail loudly:
a group of one has no std, so verl used mean 0 / std 1 (a raw reward); here grpo needs group_size >= 2
and brpo a batch of >= 2. ``arpo`` returns the raw rewards (verl's singleton groups divide by 1 + eps).

Groups are consecutive: rewards[k * group_size:(k + 1) * group_size] are the rollouts of one seed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trl_ext.registry import ConfigError, Registry

EPS = 1e-6

Estimator = Callable[[torch.Tensor, int], torch.Tensor]
ADV_ESTIMATORS: Registry[Estimator] = Registry("advantage estimator")


def check_group_size(n: int, group_size: int) -> None:
    """ConfigError unless group_size is an int >= 1 dividing the batch size n."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ConfigError(f"group_size must be an int >= 1, got {group_size!r}")
    if n % group_size:
        raise ConfigError(f"batch of {n} rewards is not divisible into groups of {group_size}")


def _checked(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1 or not rewards.is_floating_point():
        raise ValueError(f"rewards must be a 1-D float tensor, got shape {tuple(rewards.shape)} {rewards.dtype}")
    if not torch.isfinite(rewards).all():
        raise ValueError(f"rewards contain non-finite values: {rewards.tolist()}")
    check_group_size(rewards.numel(), group_size)
    return rewards.double()


def _normalise(r: torch.Tensor) -> torch.Tensor:
    """(r - mean) / (unbiased std + EPS) along the last dim."""
    centred = r - r.mean(dim=-1, keepdim=True)
    return centred / (r.std(dim=-1, keepdim=True) + EPS)


@ADV_ESTIMATORS.register("grpo")
def grpo(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Normalise within each group of ``group_size`` consecutive rollouts (same seed)."""
    r = _checked(rewards, group_size)
    if group_size < 2:
        raise ConfigError("grpo needs group_size >= 2 (a group of one has no std); use brpo or arpo")
    return _normalise(r.view(-1, group_size)).view(-1).to(rewards.dtype)


@ADV_ESTIMATORS.register("brpo")
def brpo(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Normalise across the whole batch (RAGEN's batch-relative estimator)."""
    r = _checked(rewards, group_size)
    if r.numel() < 2:
        raise ConfigError("brpo needs a batch of >= 2 rewards (a batch of one has no std)")
    return _normalise(r).to(rewards.dtype)


@ADV_ESTIMATORS.register("arpo")
def arpo(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """The raw reward as advantage (no relative normalisation)."""
    _checked(rewards, group_size)
    return rewards.clone()


def compute_advantages(name: str, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    return ADV_ESTIMATORS.get(name)(rewards, group_size)
