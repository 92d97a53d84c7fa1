"""The estimator stage: the one place where a batch's advantages are decided (pure functions; the trainer calls
`estimate_advantages` once per generation batch, after every scorer ran).

Sources, in the order they apply (each combination not listed is rejected at parse time, `check_estimator_flags`):

    base     TRL's group advantage (``--scale_rewards``), or ``--adv_estimator`` grpo|brpo|arpo (RAGEN,
             ``trl_ext.advantages``) on the weighted reward sum, or distillation's advantage (prime-rl fork
             'contextual_learning' advantage.py: ``x - mean_group(x)``, no std scaling, with ``x`` the full
             reward ``R`` or, on the token path, ``adv_tau * task``)
    routing  a renormalisation mode or baseline arm (small-rl ``compute_routed_advantages``) replaces the base:
             on the task reward with TRL's std-scaled group formula, or on distillation's ``x`` with its unscaled
             baseline (``routing.advantages.group_advantages(scale=False)``): retain-only and filter then mean
             "the baseline of the unflagged samples of the group" for either estimator.

``--adv_estimator`` with distillation, and ``--adv_estimator`` with a routing arm, would each leave one of the two
unused: both are parse-time errors. Reward-changing baseline arms (reward_penalty, retain_penalty) rewrite the
task reward, which distillation's ``x`` mixes with log-prob terms: also parse-time errors with distillation.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from trl_ext.advantages import compute_advantages
from trl_ext.registry import ConfigError
from trl_ext.routing.advantages import routed_advantages


@dataclass(frozen=True)
class RoutingArm:
    """A routing advantage arm over the whole batch: ``mode`` (retain-only, filter, reward_penalty,
    retain_penalty), the labels ``is_bad`` [N] (bool), the base rewards of retain_penalty and reward_penalty's
    amount."""

    mode: str
    is_bad: Tensor
    base_rewards: Tensor | None = None
    penalty_amount: float | None = None


@dataclass(frozen=True)
class Estimate:
    """``advantages`` [N] over the whole batch, or None when TRL's own advantage stands; ``base`` the advantage
    before the routing arm (None = TRL's); ``source`` names what decided them (logged once, for the run log)."""

    advantages: Tensor | None
    base: Tensor | None
    source: str


def estimate_advantages(rewards: Tensor, group: int, *, env_estimator: str = "", distill=None,
                        routing: RoutingArm | None = None) -> Estimate:
    """The batch's advantages from the weighted per-sample ``rewards`` [N] (all processes, TRL's order: groups of
    ``group`` consecutive samples). ``distill``: the batch's `distill.advantages.DistillAdvantages` (single
    process), or None. Combinations are assumed valid (`check_estimator_flags`)."""
    base, source = None, "trl"
    if distill is not None:
        base, source = distill.advantages, "distill"
    elif env_estimator:
        base, source = compute_advantages(env_estimator, rewards, group), f"adv_estimator:{env_estimator}"
    if routing is None:
        return Estimate(base, base, source)
    if distill is not None:
        x = distill.parts.task if distill.token_level else distill.parts.total
        adv = routed_advantages(routing.mode, x.float(), routing.is_bad.to(x.device), group, scale=False)
    else:
        base_rewards = None if routing.base_rewards is None else routing.base_rewards.to(rewards.device)
        adv = routed_advantages(routing.mode, rewards.float(), routing.is_bad.to(rewards.device), group,
                                base_rewards=base_rewards, penalty_amount=routing.penalty_amount)
    return Estimate(adv, base, f"routing:{routing.mode}" + ("+distill" if distill is not None else ""))


def check_estimator_flags(*, adv_estimator: str, distill_on: bool, routing_arm: str | None) -> None:
    """Parse-time: raise ConfigError for a combination in which one advantage source would go unused.
    ``routing_arm``: the renormalisation mode or baseline arm the flags select (None or "off": none)."""
    arm = None if routing_arm in (None, "off") else routing_arm
    if adv_estimator and distill_on:
        raise ConfigError(f"--adv_estimator {adv_estimator} with distillation: distillation's advantage is its own "
                          "estimator (full reward minus the group mean, prime-rl fork advantage.py), so the "
                          "estimator would be unused; drop --adv_estimator")
    if adv_estimator and arm:
        raise ConfigError(f"--adv_estimator {adv_estimator} with the routing arm {arm!r}: the arm recomputes the "
                          "group advantages from the rewards (small-rl), so the estimator would be unused; drop "
                          "--adv_estimator or use --renormalization_mode off")
    if distill_on and arm in ("reward_penalty", "retain_penalty"):
        raise ConfigError(f"the {arm} baseline rewrites the task reward of flagged samples, but distillation's "
                          "advantage mixes the task reward with teacher/student log-prob terms: use gradient routing "
                          "(retain-only or off) or --filter_baseline with distillation")


def local_slice(values: Tensor, process_index: int, n_local: int) -> Tensor:
    """This process's rows of a whole-batch tensor (TRL gathers in process order)."""
    return values[process_index * n_local : (process_index + 1) * n_local]


def weighted_rewards(rewards_per_func: Tensor, weights: Tensor) -> Tensor:
    """TRL's per-sample reward: the weighted sum over reward functions (NaN, a function's "no value", counts 0)."""
    return (rewards_per_func * weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
