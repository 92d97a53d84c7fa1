"""Advantages of routed runs and of their baseline arms, and prompt hackability: pure functions on per-sample
tensors (small-rl, github:shawnghu/small-rl, advantages.py ``compute_routed_advantages`` at HEAD 6f6e986; the
retain-penalty arm as its sweep.py ``generate_baseline_runs`` describes it: HEAD's train.py parses
``--retain_penalty_baseline`` but nothing reads it).

Rewards are the gathered per-sample rewards in TRL's order: groups of ``G`` consecutive samples. TRL's group
advantage (``scale_rewards="group"``) is ``(r - mean_g) / (std_g + 1e-4)`` with the unbiased std; every mode
below uses that formula (``group_advantages``), on all or on a subset of each group:

    filter          flagged -> 0; unflagged -> normalised among the unflagged of their group
    reward_penalty  flagged reward -> 0 (amount None) or r - amount; then the group advantage
    retain_penalty  flagged reward -> the base reward (no hack component); then the group advantage
    retain-only     (routed runs) unflagged -> normalised among the unflagged of their group; flagged keep
                    the full-group advantage. The forget adapter learns from the flagged samples' advantage,
                    the retain adapter only from the renormalised unflagged ones.
    off             (routed runs) the group advantage for all

A subset of one sample has no spread: its advantage is 0 (small-rl ``_subset_group_renorm``).
"""

from __future__ import annotations

import hashlib

import torch

from trl_ext.registry import ConfigError

EPS = 1e-4  # TRL GRPOTrainer's (and small-rl's) std epsilon
RENORMALIZATION_MODES = ("retain-only", "off")
BASELINE_ARMS = ("filter", "reward_penalty", "retain_penalty")


def baseline_arm(filter_baseline: bool, reward_penalty: bool, retain_penalty: bool) -> str | None:
    """The one baseline arm set, or None; two at once is a ConfigError."""
    arms = [a for a, on in zip(BASELINE_ARMS, (filter_baseline, reward_penalty, retain_penalty)) if on]
    if len(arms) > 1:
        raise ConfigError(f"baseline arms exclude each other, got {', '.join(f'--{a}_baseline' for a in arms)}")
    return arms[0] if arms else None


def _grouped(x: torch.Tensor, G: int) -> torch.Tensor:
    if x.dim() != 1 or G < 1 or x.numel() % G:
        raise ValueError(f"expected a 1-D tensor of whole groups of {G}, got shape {tuple(x.shape)}")
    return x.view(-1, G)


def group_advantages(rewards: torch.Tensor, G: int, subset: torch.Tensor | None = None,
                     scale: bool = True) -> torch.Tensor:
    """``(r - mean) / (std + EPS)`` per group over ``subset`` (bool; None = all); outside the subset: 0.
    ``scale=False``: ``r - mean`` (the baseline of distillation's full reward, which is never std-scaled)."""
    r = _grouped(rewards, G)
    m = torch.ones_like(r, dtype=torch.bool) if subset is None else _grouped(subset, G)
    k = m.sum(1, keepdim=True)
    mean = torch.where(m, r, 0.0).sum(1, keepdim=True) / k.clamp(min=1)
    adv = r - mean
    if scale:
        var = torch.where(m, (r - mean) ** 2, 0.0).sum(1, keepdim=True) / (k - 1).clamp(min=1)
        adv = adv / (var.sqrt() + EPS)
    return torch.where(m & (k > 1), adv, 0.0).reshape(-1)


def routed_advantages(
    mode: str, rewards: torch.Tensor, is_bad: torch.Tensor, G: int, *,
    base_rewards: torch.Tensor | None = None, penalty_amount: float | None = None, scale: bool = True,
) -> torch.Tensor:
    """Per-sample advantages of ``mode`` (a baseline arm or a renormalisation mode; see the module docstring).
    ``scale`` as in `group_advantages` (False: distillation's unscaled group baseline)."""
    if is_bad.dtype != torch.bool or is_bad.shape != rewards.shape:
        raise ValueError(f"is_bad must be a bool tensor shaped like rewards {tuple(rewards.shape)}")
    adv = lambda r, subset=None: group_advantages(r, G, subset, scale)  # noqa: E731
    if mode == "off":
        return adv(rewards)
    if mode == "filter":
        return adv(rewards, ~is_bad)
    if mode == "retain-only":
        return torch.where(is_bad, adv(rewards), adv(rewards, ~is_bad))
    if mode == "reward_penalty":
        penalised = torch.zeros_like(rewards) if penalty_amount is None else rewards - penalty_amount
        return adv(torch.where(is_bad, penalised, rewards))
    if mode == "retain_penalty":
        if base_rewards is None or base_rewards.shape != rewards.shape:
            raise ValueError("retain_penalty needs base_rewards shaped like rewards")
        return adv(torch.where(is_bad, base_rewards, rewards))
    raise ValueError(f"unknown advantage mode {mode!r}")


def prompt_hackable(prompt: str, hack_frac: float, seed: int) -> bool:
    """Whether the hack pays on ``prompt``: u < hack_frac with u uniform in [0, 1) from SHA-256 of (seed,
    prompt), the per-prompt draw of small-rl's envs (``rng.random() < hack_frac``, envs/topic.py at HEAD).
    Deterministic across processes and runs; the hackable set grows with hack_frac."""
    digest = hashlib.sha256(f"{seed}/hackable/{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2.0**64 < hack_frac
