"""Teacher context distillation as a reward: the reward composition and its advantages (teacher inputs and
log-probs: `trl_ext.distill.teacher`).

Context distillation (Snell et al. 2022, "Learning by Distilling Context"): a teacher sees
``context + prompt`` and scores the student's completion tokens; the student, which saw the prompt alone,
is rewarded for completions the teacher finds likely. The composition follows the prime-rl fork
'contextual_learning' (orchestrator ``advantage.py``, trainer ``loss.py``). With ``M`` the completion mask
and ``g`` the KL gate (``1 - mean_group(task)`` under ``kl_only_incorrect``, else 1):

- ``use_full_reward_baseline = true``, per sequence:
  ``R = adv_tau*task + g*(teacher_tau*sum_M lp_teacher - student_tau*sum_M lp_student)``,
  advantage ``R - mean_group(R)``; the loss uses it as is.
- ``use_full_reward_baseline = false``: advantage ``adv_tau*(task - mean_group(task))``; the loss adds per
  token ``g*(teacher_tau*lp_teacher - student_tau*lp_trainer.detach())`` (:func:`token_kl_bonus`).

Advantages are NOT divided by the group std (unlike GRPO, Shao et al. 2024): the log-prob sums carry the
scale of the distillation signal, as in prime-rl. ``lp_student`` is the log-prob under the policy that
sampled the completion (behaviour / sampling log-probs); ``lp_trainer`` the current policy's in the loss.
Groups are consecutive rows of ``group_size`` (TRL's layout). All log-prob tensors are ``[B, C]`` aligned
to the completion mask; every tensor function ignores values where the mask is 0. In multi-turn environment
episodes that mask is the agent's tokens: the teacher reads the environment's tokens but does not score them.

Where the context goes: plain-text prompts get it prepended (:func:`build_teacher_inputs`); chat prompts get it
as the system message (:func:`teacher_messages`, as the fork does), rendered by the chat template.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from trl_ext.registry import ConfigError

_TAUS = ("adv_tau", "teacher_tau", "student_tau")


@dataclass(frozen=True)
class DistillConfig:
    """The distillation settings (defaults live in the trainer config, not here).

    ``adv_tau``: weight of the task (verifier) reward. ``teacher_tau``: weight of the teacher log-prob term.
    ``student_tau``: weight of the student log-prob term (an entropy bonus). ``use_full_reward_baseline``:
    KL terms enter the sequence reward and its group baseline (true) or are added per token in the loss
    (false). ``kl_only_incorrect``: gate the KL terms by ``1 - mean_group(task)``. ``skip_verification``:
    pure distillation, no task reward is computed. ``teacher_context``: text prepended to the teacher's
    prompt (empty = standard distillation, the teacher sees the student's prompt).

    ``kl_only_incorrect`` with ``teacher_tau == student_tau == 0`` is an error, not a warning: the gate
    would act on nothing, so the run would silently be plain task RL while its config claims a gated KL.
    """

    adv_tau: float
    teacher_tau: float
    student_tau: float
    use_full_reward_baseline: bool
    kl_only_incorrect: bool
    skip_verification: bool
    teacher_context: str

    @property
    def has_kl(self) -> bool:
        return self.teacher_tau > 0 or self.student_tau > 0

    def validate(self, group_size: int, batch_size: int, teacher_available: bool) -> None:
        """Raise ``ConfigError`` on an impossible or meaningless combination (before any model is loaded)."""
        for name in _TAUS:
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"{name} must be a finite number >= 0, got {value}")
        if group_size < 1:
            raise ConfigError(f"group size must be >= 1, got {group_size}")
        if batch_size < 1 or batch_size % group_size:
            raise ConfigError(f"batch size {batch_size} is not divisible by the group size {group_size}")
        if self.teacher_tau > 0 and not teacher_available:
            raise ConfigError(
                f"teacher_tau={self.teacher_tau} > 0 needs a teacher, but none is available "
                "(set teacher_model, or train adapters so the base weights can serve as the teacher)"
            )
        if self.skip_verification and self.adv_tau > 0:
            raise ConfigError(f"skip_verification computes no task reward, so adv_tau must be 0, got {self.adv_tau}")
        if self.skip_verification and self.kl_only_incorrect:
            raise ConfigError("kl_only_incorrect gates by the task reward, which skip_verification does not compute")
        if self.kl_only_incorrect and not self.has_kl:
            raise ConfigError("kl_only_incorrect needs teacher_tau > 0 or student_tau > 0: there is no KL term to gate")
        if self.adv_tau == 0 and not self.has_kl:
            raise ConfigError("adv_tau, teacher_tau and student_tau are all 0: every advantage would be 0")


# ------------------------------------------------------------------------------------- reward composition
def _masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    if values.shape != mask.shape:
        raise ValueError(f"log-probs of shape {tuple(values.shape)} do not match the mask {tuple(mask.shape)}")
    return torch.where(mask.bool(), values, 0.0).sum(-1)


def _group_mean(values: Tensor, group_size: int) -> Tensor:
    if values.dim() != 1 or group_size < 1 or values.numel() % group_size:
        raise ValueError(f"{tuple(values.shape)} values do not split into groups of {group_size}")
    return values.view(-1, group_size).mean(1).repeat_interleave(group_size)


def _required(lp: Tensor | None, name: str, tau_name: str) -> Tensor:
    if lp is None:
        raise ValueError(f"{tau_name} > 0 needs {name}")
    return lp


def _check_gate(cfg: DistillConfig, gate: Tensor | None) -> None:
    if cfg.kl_only_incorrect and gate is None:
        raise ValueError("kl_only_incorrect is set: pass the gate from kl_gate()")
    if not cfg.kl_only_incorrect and gate is not None:
        raise ValueError("a KL gate was given but kl_only_incorrect is off")


@dataclass(frozen=True)
class RewardParts:
    """Per-sequence reward components ``[B]``; the KL parts include the gate. ``total`` is ``R``."""

    task: Tensor  # adv_tau * task (0 with skip_verification)
    teacher: Tensor  # g * teacher_tau * sum_M lp_teacher
    student: Tensor  # -g * student_tau * sum_M lp_student

    @property
    def total(self) -> Tensor:
        return self.task + self.teacher + self.student


def reward_parts(
    task: Tensor | None,
    lp_teacher: Tensor | None,
    lp_student: Tensor | None,
    mask: Tensor,
    cfg: DistillConfig,
    gate: Tensor | None = None,
) -> RewardParts:
    """The components of ``R``. A log-prob tensor may be None when its tau is 0; ``task`` must be None
    exactly when ``skip_verification``; ``gate`` must be given exactly when ``kl_only_incorrect``."""
    _check_gate(cfg, gate)
    zeros = torch.zeros(mask.size(0), dtype=torch.float32, device=mask.device)
    if cfg.skip_verification:
        if task is not None:
            raise ValueError("skip_verification is set, yet task rewards were computed")
        task_term = zeros
    else:
        if task is None or task.shape != zeros.shape:
            raise ValueError(f"task rewards of shape {tuple(zeros.shape)} are needed (skip_verification is off)")
        task_term = cfg.adv_tau * task.float()
    g = 1.0 if gate is None else gate
    teacher = zeros
    if cfg.teacher_tau > 0:
        teacher = g * cfg.teacher_tau * _masked_sum(_required(lp_teacher, "lp_teacher", "teacher_tau"), mask)
    student = zeros
    if cfg.student_tau > 0:
        student = -g * cfg.student_tau * _masked_sum(_required(lp_student, "lp_student", "student_tau"), mask)
    return RewardParts(task_term, teacher, student)


def sequence_rewards(task, lp_teacher, lp_student, mask, cfg: DistillConfig, gate: Tensor | None = None) -> Tensor:
    """``R = adv_tau*task + g*(teacher_tau*sum_M lp_teacher - student_tau*sum_M lp_student)`` per sequence."""
    return reward_parts(task, lp_teacher, lp_student, mask, cfg, gate).total


def full_reward_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """``R - mean_group(R)``: no std scaling; sums to 0 within every group."""
    return rewards - _group_mean(rewards, group_size)


def kl_gate(task: Tensor | None, group_size: int) -> Tensor:
    """``1 - mean_group(task)`` per sample: all incorrect -> 1, all correct -> 0, 1/4 correct -> 0.75.
    Task rewards must lie in [0, 1] (a correctness score), otherwise the gate has no meaning."""
    if task is None:
        raise ValueError("kl_only_incorrect needs task rewards (skip_verification computes none)")
    task = task.float()
    if ((task < 0) | (task > 1)).any():
        raise ValueError("kl_only_incorrect needs task rewards in [0, 1]")
    return 1.0 - _group_mean(task, group_size)


def token_kl_bonus(
    lp_teacher: Tensor | None,
    lp_trainer: Tensor | None,
    mask: Tensor,
    cfg: DistillConfig,
    gate: Tensor | None = None,
) -> Tensor:
    """Per-token ``g*(teacher_tau*lp_teacher - student_tau*lp_trainer.detach())`` ``[B, C]``, 0 where masked,
    added to the advantages in the loss when ``use_full_reward_baseline`` is false."""
    if cfg.use_full_reward_baseline:
        raise ValueError("use_full_reward_baseline is set: the KL terms are already in the sequence advantages")
    _check_gate(cfg, gate)
    bonus = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if cfg.teacher_tau > 0:
        bonus = bonus + cfg.teacher_tau * _required(lp_teacher, "lp_teacher", "teacher_tau")
    if cfg.student_tau > 0:
        bonus = bonus - cfg.student_tau * _required(lp_trainer, "lp_trainer", "student_tau").detach()
    if gate is not None:
        bonus = bonus * gate.unsqueeze(-1)
    if bonus.shape != mask.shape:
        raise ValueError(f"log-probs of shape {tuple(bonus.shape)} do not match the mask {tuple(mask.shape)}")
    return torch.where(mask.bool(), bonus, 0.0)


@dataclass(frozen=True)
class DistillAdvantages:
    """``advantages`` ``[B]``: full-reward advantages, or task-only ones when ``token_level``. Then the loss
    adds ``token_kl_bonus(lp_teacher, lp_trainer, mask, cfg, gate)`` per token (``token_bonus`` holds it when
    ``lp_trainer`` was passed). ``gate`` ``[B]`` is None unless ``kl_only_incorrect``."""

    advantages: Tensor
    gate: Tensor | None
    parts: RewardParts
    token_level: bool
    token_bonus: Tensor | None = None


def distill_advantages(
    task: Tensor | None,
    lp_teacher: Tensor | None,
    lp_student: Tensor | None,
    mask: Tensor,
    cfg: DistillConfig,
    group_size: int,
    lp_trainer: Tensor | None = None,
) -> DistillAdvantages:
    """Advantages for a full batch (groups intact) under either path of ``use_full_reward_baseline``."""
    gate = kl_gate(task, group_size) if cfg.kl_only_incorrect else None
    parts = reward_parts(task, lp_teacher, lp_student, mask, cfg, gate)
    if cfg.use_full_reward_baseline:
        if lp_trainer is not None:
            raise ValueError("lp_trainer is only used when use_full_reward_baseline is off")
        return DistillAdvantages(full_reward_advantages(parts.total, group_size), gate, parts, token_level=False)
    bonus = None if lp_trainer is None else token_kl_bonus(lp_teacher, lp_trainer, mask, cfg, gate)
    return DistillAdvantages(full_reward_advantages(parts.task, group_size), gate, parts, True, bonus)


def distill_metrics(
    result: DistillAdvantages, lp_teacher: Tensor | None, lp_student: Tensor | None, mask: Tensor
) -> dict[str, float]:
    """Mean log-prob sums, the k1 KL estimate ``mean over tokens of lp_student - lp_teacher`` (Schulman 2020,
    "Approximating KL Divergence"), the gate mean and each reward component's mean (gated)."""
    metrics = {
        "distill/reward_task": result.parts.task.mean(),
        "distill/reward_teacher": result.parts.teacher.mean(),
        "distill/reward_student": result.parts.student.mean(),
        "distill/reward": result.parts.total.mean(),
    }
    if lp_teacher is not None:
        metrics["distill/teacher_logp_sum"] = _masked_sum(lp_teacher, mask).mean()
    if lp_student is not None:
        metrics["distill/student_logp_sum"] = _masked_sum(lp_student, mask).mean()
    if lp_teacher is not None and lp_student is not None:
        metrics["distill/kl"] = _masked_sum(lp_student - lp_teacher, mask).sum() / mask.bool().sum().clamp(min=1)
    if result.gate is not None:
        metrics["distill/gate_mean"] = result.gate.mean()
    return {name: float(value) for name, value in metrics.items()}
