"""Off-policy loss: importance ratios, token / sequence / geometric masks, clips, kl term, normalisation.

Reference: prime-rl ``src/prime_rl/trainer/rl/loss.py`` (PrimeIntellect-ai/prime-rl, the masked-IS loss of
December 2025 to February 2026, before its March 2026 switch to the IPO loss): REINFORCE with stop-gradient
importance weights, each mask a named boolean tensor that is also a logged metric. Truncated IS
(``token_clip_high``) follows Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training"; prime-rl never had it.

Per sequence, with loss mask M (padding = 0) and log-probs of the sampled tokens under the trainer and under the
behaviour (generating) policy::

    logr  = lp_trainer - lp_behaviour                (0 where M = 0)
    r     = exp(logr)                                token ratio
    geo   = exp(mean_M logr)                         geometric-mean ratio
    seq   = min(exp(min(sum_M logr, 10)), sequence_clip_high)
    drop token      if r < token_mask_low or r > token_mask_high
    drop sequence   if geo < geo_mask_low or geo > geo_mask_high
                    or min_M r < sequence_mask_low or max_M r > sequence_mask_high
    ratio = min(r, token_clip_high)   (ratio_type "token")   |   seq broadcast over tokens   ("sequence")
    coeff = ratio * (loss_adv_tau * A - kl_tau * logr)      (prime-rl loss.py: adv_tau, kl_tau)
    loss  = -sum_keep(sg(coeff) * lp_trainer) / normaliser

Every comparison is strict, so a ratio exactly on a bound is kept. A low of 0 never drops anything (ratios are
>= 0), and any high or clip >= ``DISABLED`` (1e10, the value the "no mask" runs pass) is read as +inf, so the
disabling values are exactly "no mask" even for ratios above 1e10.

The normaliser counts loss tokens (M), not kept tokens: a dropped token still counts, as in prime-rl (whose
``loss_scale`` is the number of loss tokens). Unlike prime-rl, ratio_type "sequence" adds no extra per-sequence
division: the normalisation is chosen by ``loss_type`` only, with TRL 1.16 GRPOTrainer's semantics:

    grpo          per-sequence sum / |M_i| (clamped to 1), then mean over all B sequences
    bnpo          sum / |M| of this micro-batch
    dapo, token   sum / num_items_in_batch (passed by the caller; TRL's dapo uses the generation batch's count)
    dr_grpo       sum / (B * max_completion_length)

The caller applies TRL's gradient-accumulation scaling exactly as TRL does for that loss_type. When the trainer and
behaviour log-probs are equal (r = 1) and nothing is masked, the gradient is -A * d lp / normaliser, the same as
TRL's unclipped ``-exp(lp - sg(lp)) * A`` for the same loss_type.

Reference-model KL (beta > 0, :func:`reference_kl`): TRL's k3 estimator ``k3 = exp(lp_ref - lp) - (lp_ref - lp) - 1``
(Schulman 2020, "Approximating KL Divergence"), on the same tokens and with the same importance weight as the policy
term, so a token the masks drop pushes no gradient at all and a clipped ratio is clipped here too::

    kl_t = keep_t * w_t * k3_t,   w = ratio (the policy term's, clip included) if use_bias_correction_kl else 1

normalised by the same normaliser (loss tokens M). ``w`` keeps its gradient, as TRL's ``coef_1`` does (d/dθ of
``w * k3``), except through dropped tokens (the sequence ratio sums them: their value counts, not their gradient);
beyond a clip ``w`` is a constant. prime-rl has no reference-model KL; its per-token terms (the teacher KL of
the distillation fork) enter ``coeff`` and so obey keep and ratio the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from trl_ext.registry import ConfigError, Registry

DISABLED = 1e10
"""A high bound or clip at or above this value is off (read as +inf)."""

SEQ_LOG_RATIO_CAP = 10.0
"""The summed log-ratio is capped at 10 before exp (prime-rl), so the sequence ratio is at most e**10."""

RATIO_TYPES = ("token", "sequence")

PRIME_RL_DEFAULTS: dict[str, float | str] = {
    "ratio_type": "token",
    "token_mask_low": 0.125,
    "token_mask_high": 8.0,
    "sequence_mask_low": 0.0,
    "sequence_mask_high": 100.0,
    "geo_mask_low": 0.1,
    "geo_mask_high": 10.0,
    "sequence_clip_high": 10.0,
    "token_clip_high": DISABLED,
    "kl_tau": 0.0,
    "loss_adv_tau": 1.0,
}
"""prime-rl's loss defaults (plus token_clip_high off); the trainer config uses them as its field defaults."""

NO_MASK: dict[str, float] = {
    "token_mask_low": 0.0,
    "token_mask_high": DISABLED,
    "sequence_mask_low": 0.0,
    "sequence_mask_high": DISABLED,
    "geo_mask_low": 0.0,
    "geo_mask_high": DISABLED,
    "sequence_clip_high": DISABLED,
    "token_clip_high": DISABLED,
}
"""Values that switch every mask and clip off (the "no mask" runs)."""


def _high(value: float) -> float:
    return math.inf if value >= DISABLED else value


@dataclass(frozen=True)
class ImportanceConfig:
    """Settings of the off-policy loss (semantics in the module docstring). No defaults here: see PRIME_RL_DEFAULTS."""

    ratio_type: str
    token_mask_low: float
    token_mask_high: float
    sequence_mask_low: float
    sequence_mask_high: float
    geo_mask_low: float
    geo_mask_high: float
    sequence_clip_high: float
    token_clip_high: float
    kl_tau: float
    loss_adv_tau: float

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_object(cls, obj: object) -> ImportanceConfig:
        """Build from any object carrying attributes of the same names (e.g. the trainer's config)."""
        return cls(**{f.name: getattr(obj, f.name) for f in fields(cls)})

    def validate(self) -> None:
        """Raise ConfigError naming the field for any impossible setting."""
        if self.ratio_type not in RATIO_TYPES:
            raise ConfigError(f"ratio_type must be one of {RATIO_TYPES}, got {self.ratio_type!r}")
        for f in fields(self):
            if f.name == "ratio_type":
                continue
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise ConfigError(f"{f.name} must be a number, got {value!r}")
        for name in ("token_mask", "sequence_mask", "geo_mask"):
            low, high = getattr(self, f"{name}_low"), getattr(self, f"{name}_high")
            if low < 0:
                raise ConfigError(f"{name}_low must be >= 0 (0 disables it), got {low}")
            if low >= high:
                raise ConfigError(f"{name}_low ({low}) must be < {name}_high ({high})")
        for name in ("sequence_clip_high", "token_clip_high"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0 ({DISABLED:g} disables it), got {getattr(self, name)}")
        if self.kl_tau < 0:
            raise ConfigError(f"kl_tau must be >= 0, got {self.kl_tau}")
        if self.loss_adv_tau < 0:
            raise ConfigError(f"loss_adv_tau must be >= 0, got {self.loss_adv_tau}")
        if self.ratio_type == "sequence" and self.token_clip_high < DISABLED:
            raise ConfigError(
                f"token_clip_high={self.token_clip_high} has no effect with ratio_type='sequence' "
                "(use sequence_clip_high)"
            )


@dataclass
class LossOutput:
    """The normalised loss, named boolean masks ((B, T) per token, (B,) per sequence) and detached 0-dim metrics."""

    loss: Tensor
    masks: dict[str, Tensor]
    metrics: dict[str, Tensor]


Normaliser = Callable[[Tensor, Tensor, "Tensor | float | None", "int | None"], Tensor]
NORMALISATIONS: Registry[Normaliser] = Registry("loss_type")


@NORMALISATIONS.register("grpo")
def _per_sequence_mean(per_token: Tensor, mask: Tensor, num_items_in_batch, max_completion_length) -> Tensor:
    return (per_token.sum(-1) / mask.sum(-1).clamp(min=1)).mean()


@NORMALISATIONS.register("bnpo")
def _micro_batch_token_mean(per_token: Tensor, mask: Tensor, num_items_in_batch, max_completion_length) -> Tensor:
    return per_token.sum() / mask.sum().clamp(min=1)


@NORMALISATIONS.register("token")
@NORMALISATIONS.register("dapo")
def _global_token_mean(per_token: Tensor, mask: Tensor, num_items_in_batch, max_completion_length) -> Tensor:
    if num_items_in_batch is None:
        raise ValueError("loss_type 'dapo'/'token' needs num_items_in_batch (loss tokens the loss is divided by)")
    if not isinstance(num_items_in_batch, Tensor):
        if num_items_in_batch < 0:
            raise ValueError(f"num_items_in_batch must be >= 0, got {num_items_in_batch}")
        num_items_in_batch = torch.tensor(float(num_items_in_batch), device=per_token.device)
    return per_token.sum() / num_items_in_batch.to(per_token.dtype).clamp(min=1.0)


@NORMALISATIONS.register("dr_grpo")
def _constant_length(per_token: Tensor, mask: Tensor, num_items_in_batch, max_completion_length) -> Tensor:
    if max_completion_length is None or max_completion_length <= 0:
        raise ValueError(f"loss_type 'dr_grpo' needs max_completion_length > 0, got {max_completion_length}")
    return per_token.sum() / (per_token.size(0) * max_completion_length)


def check_loss_type(loss_type: str) -> None:
    """Raise ConfigError (listing the supported names) unless ``loss_type`` has a normalisation here."""
    NORMALISATIONS.get(loss_type)


def importance_loss(
    lp_trainer: Tensor,
    lp_behaviour: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cfg: ImportanceConfig,
    loss_type: str,
    *,
    num_items_in_batch: Tensor | float | None = None,
    max_completion_length: int | None = None,
) -> LossOutput:
    """Off-policy REINFORCE loss with importance masks (see module docstring).

    lp_trainer (B, T) carries the gradient; lp_behaviour (B, T); advantages (B,) or (B, T); loss_mask (B, T) bool
    or 0/1. Values at positions with loss_mask = 0 are never read into the loss, its gradient or the metrics.
    """
    normalise = NORMALISATIONS.get(loss_type)
    if lp_trainer.dim() != 2 or lp_trainer.shape != lp_behaviour.shape or lp_trainer.shape != loss_mask.shape:
        raise ValueError(
            f"lp_trainer, lp_behaviour and loss_mask must share one (B, T) shape, got "
            f"{tuple(lp_trainer.shape)}, {tuple(lp_behaviour.shape)}, {tuple(loss_mask.shape)}"
        )
    batch = lp_trainer.size(0)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    if advantages.shape not in ((batch, 1), tuple(lp_trainer.shape)):
        raise ValueError(f"advantages must be (B,) or (B, T) for (B, T)={tuple(lp_trainer.shape)}")

    dtype = torch.promote_types(lp_trainer.dtype, torch.float32)
    m = loss_mask.bool()
    zero = torch.zeros((), dtype=dtype, device=lp_trainer.device)
    with torch.no_grad():
        logr = torch.where(m, lp_trainer.detach().to(dtype) - lp_behaviour.to(dtype), zero)
        ratio = torch.exp(logr)  # 1 on padding
        n_tokens = m.sum(-1)
        has_tokens = n_tokens > 0
        sum_logr = logr.sum(-1)
        geo_ratio = torch.exp(sum_logr / n_tokens.clamp(min=1))
        seq_ratio_raw = torch.exp(sum_logr.clamp(max=SEQ_LOG_RATIO_CAP))
        seq_ratio = seq_ratio_raw.clamp(max=_high(cfg.sequence_clip_high))
        min_ratio = torch.where(m, ratio, math.inf).amin(-1)
        max_ratio = torch.where(m, ratio, -math.inf).amax(-1)

        masks = {
            "token_low": m & (ratio < cfg.token_mask_low),
            "token_high": m & (ratio > _high(cfg.token_mask_high)),
            "geo_low": has_tokens & (geo_ratio < cfg.geo_mask_low),
            "geo_high": has_tokens & (geo_ratio > _high(cfg.geo_mask_high)),
            "seq_low": has_tokens & (min_ratio < cfg.sequence_mask_low),
            "seq_high": has_tokens & (max_ratio > _high(cfg.sequence_mask_high)),
            "token_clipped": m & (ratio > _high(cfg.token_clip_high)),
            "seq_clipped": has_tokens & (seq_ratio_raw > _high(cfg.sequence_clip_high)),
        }
        seq_masked = masks["geo_low"] | masks["geo_high"] | masks["seq_low"] | masks["seq_high"]
        masks["seq_masked"] = seq_masked
        masks["is_masked"] = m & (masks["token_low"] | masks["token_high"] | seq_masked.unsqueeze(1))
        keep = m & ~masks["is_masked"]
        masks["keep"] = keep

        if cfg.ratio_type == "token":
            used = ratio.clamp(max=_high(cfg.token_clip_high))
        else:
            used = seq_ratio.unsqueeze(1).expand_as(ratio)
        coeff = torch.where(keep, used * (cfg.loss_adv_tau * advantages.to(dtype) - cfg.kl_tau * logr), zero)

    per_token = torch.where(keep, -coeff * lp_trainer.to(dtype), zero)
    loss = normalise(per_token, m, num_items_in_batch, max_completion_length)
    return LossOutput(loss=loss, masks=masks, metrics=_metrics(masks, m, has_tokens, logr, ratio, geo_ratio))


def reference_kl(
    lp_trainer: Tensor,
    lp_ref: Tensor,
    lp_behaviour: Tensor,
    loss_mask: Tensor,
    keep: Tensor,
    cfg: ImportanceConfig,
    *,
    bias_correction: bool,
) -> Tensor:
    """Per-token reference-model KL term ``keep * w * k3`` (B, T) of the off-policy loss (module docstring), 0 on
    dropped tokens and padding; the caller multiplies by beta and normalises like the policy term.

    ``keep`` is ``importance_loss(...).masks["keep"]`` for the same tensors. ``w`` (with ``bias_correction``, TRL's
    ``use_bias_correction_kl``) is ``min(exp(lp - lp_b), token_clip_high)`` for ratio_type "token" and
    ``min(exp(min(sum_M (lp - lp_b), 10)), sequence_clip_high)`` for "sequence", differentiable in ``lp_trainer``.
    """
    if not (lp_trainer.shape == lp_ref.shape == lp_behaviour.shape == loss_mask.shape == keep.shape):
        raise ValueError(
            f"lp_trainer, lp_ref, lp_behaviour, loss_mask and keep must share one (B, T) shape, got "
            f"{[tuple(t.shape) for t in (lp_trainer, lp_ref, lp_behaviour, loss_mask, keep)]}"
        )
    m, keep = loss_mask.bool(), keep.bool()
    if bool((keep & ~m).any()):
        raise ValueError("keep marks a token outside the loss mask")
    dtype = torch.promote_types(lp_trainer.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=lp_trainer.device)
    lp = torch.where(keep, lp_trainer.to(dtype), zero)  # garbage outside keep never reaches the gradient
    delta = torch.where(keep, lp_ref.to(dtype), zero) - lp
    per_token = torch.exp(delta) - delta - 1
    if bias_correction:
        logr = torch.where(m, lp_trainer.to(dtype) - torch.where(m, lp_behaviour.to(dtype), zero), zero)
        logr = torch.where(keep, logr, logr.detach())  # a dropped token's log-prob carries no gradient via w either
        if cfg.ratio_type == "token":
            weight = torch.exp(logr).clamp(max=_high(cfg.token_clip_high))
        else:
            seq = torch.exp(logr.sum(-1).clamp(max=SEQ_LOG_RATIO_CAP)).clamp(max=_high(cfg.sequence_clip_high))
            weight = seq.unsqueeze(1).expand_as(logr)
        per_token = per_token * weight
    return torch.where(keep, per_token, zero)


def _metrics(masks, m, has_tokens, logr, ratio, geo_ratio) -> dict[str, Tensor]:
    n_loss = m.sum().clamp(min=1).to(ratio.dtype)
    n_seq = has_tokens.sum().clamp(min=1).to(ratio.dtype)

    def per_token(x: Tensor) -> Tensor:
        return (x & m).sum().to(ratio.dtype) / n_loss

    def per_seq(x: Tensor) -> Tensor:
        return (x & has_tokens).sum().to(ratio.dtype) / n_seq

    zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
    max_ratio = torch.where(m, ratio, zero).amax() if m.numel() else zero
    return {
        "token_masked_low_frac": per_token(masks["token_low"]),
        "token_masked_high_frac": per_token(masks["token_high"]),
        "geo_masked_low_frac": per_seq(masks["geo_low"]),
        "geo_masked_high_frac": per_seq(masks["geo_high"]),
        "seq_masked_low_frac": per_seq(masks["seq_low"]),
        "seq_masked_high_frac": per_seq(masks["seq_high"]),
        "seq_masked_frac": per_seq(masks["seq_masked"]),
        "masked_frac": per_token(masks["is_masked"]),
        "kept_frac": per_token(masks["keep"]),
        "token_clipped_frac": per_token(masks["token_clipped"]),
        "seq_clipped_frac": per_seq(masks["seq_clipped"]),
        "ratio_mean": torch.where(m, ratio, zero).sum() / n_loss,
        "ratio_max": max_ratio,
        "geo_ratio_mean": torch.where(has_tokens, geo_ratio, zero).sum() / n_seq,
        "abs_log_ratio_mean": logr.abs().sum() / n_loss,
        # prime-rl's mismatch_kl: the k3 estimator r - log r - 1 of KL(behaviour || trainer).
        "mismatch_kl": torch.where(m, ratio - logr - 1, zero).sum() / n_loss,
    }


def policy_lag_stats(versions_per_token: Tensor, mask: Tensor, current_version: int) -> dict[str, Tensor]:
    """Policy lag over loss tokens (current_version - version that produced the token), PipelineRL-style metrics.

    Returns 0-dim float tensors: ``policy_lag_mean``, ``policy_lag_max`` and ``multi_version_seq_frac`` (fraction of
    sequences with loss tokens whose loss tokens come from more than one policy version: in-flight updates).
    Empty masks give 0. A token stamped with a version newer than current_version raises ValueError.
    """
    if versions_per_token.dtype.is_floating_point or versions_per_token.dtype == torch.bool:
        raise ValueError(f"versions_per_token must be an integer tensor, got {versions_per_token.dtype}")
    if versions_per_token.dim() != 2 or versions_per_token.shape != mask.shape:
        raise ValueError(
            f"versions_per_token and mask must share one (B, T) shape, got "
            f"{tuple(versions_per_token.shape)} and {tuple(mask.shape)}"
        )
    m = mask.bool()
    lag = torch.where(m, current_version - versions_per_token, 0)
    if bool((lag < 0).any()):
        raise ValueError(f"a loss token carries a policy version newer than current_version={current_version}")
    big = torch.iinfo(versions_per_token.dtype).max
    has_tokens = m.any(-1)
    v_min = torch.where(m, versions_per_token, big).amin(-1)
    v_max = torch.where(m, versions_per_token, -big).amax(-1)
    multi = has_tokens & (v_min != v_max)
    n_loss = m.sum().clamp(min=1).float()
    return {
        "policy_lag_mean": lag.sum().float() / n_loss,
        "policy_lag_max": lag.amax().float() if lag.numel() else torch.zeros(()),
        "multi_version_seq_frac": multi.sum().float() / has_tokens.sum().clamp(min=1).float(),
    }
