"""The flags of off-policy training (`OffPolicyArgs`, mixed into ExtGRPOConfig): the async level, the generator
thread and prime-rl's loss options (defaults: ``importance.PRIME_RL_DEFAULTS``), checked at parse time."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from trl import GRPOConfig

from trl_ext.offpolicy.importance import NORMALISATIONS, PRIME_RL_DEFAULTS, ImportanceConfig
from trl_ext.registry import ConfigError

_PPO_ONLY = ("epsilon", "epsilon_high", "delta", "importance_sampling_level", "top_entropy_quantile",
             "off_policy_mask_threshold", "entropy_coef", "use_adaptive_entropy",
             "num_iterations", "min_p", "repetition_penalty", "generation_kwargs",
             "use_transformers_continuous_batching", "steps_per_generation", "generation_batch_size")  # fmt: skip
"""GRPOConfig fields that must keep TRL's default when max_async_level > 0 (unused by, or incompatible with, the
off-policy loss and the generator thread)."""


def _loss_field(name: str, help_text: str):
    return field(default=PRIME_RL_DEFAULTS[name], metadata={"help": help_text})


@dataclass
class OffPolicyArgs:
    """Flags of off-policy training (seed 000; prime-rl's orchestrator and trainer.loss options)."""

    _argument_group_name = "off-policy training (trl_ext.offpolicy)"  # train.py --help group (cli_help.py)

    max_async_level: int = field(
        default=0,
        metadata={"help": "k: the batch trained at step n was sampled by a policy at most k steps old; 0 = synchronous "
                  "on-policy (TRL's own generation and loss)."},
    )  # fmt: skip
    strict_async_level: bool = field(
        default=False,
        metadata={"help": "Sample the batch of step n with exactly policy max(n - k, start step); otherwise the newest "
                  "policy, updated in flight between decoding steps (PipelineRL). Needs --max_async_level >= 1."},
    )  # fmt: skip
    generator_threads: int = field(
        default=0,
        metadata={"help": "CPU: torch threads of the generator thread (the trainer keeps the rest); 0 = half of "
                  "torch.get_num_threads(), at least 1."},
    )  # fmt: skip
    ratio_type: str = _loss_field("ratio_type", "Importance ratio: 'token' (per token) or 'sequence' (exp of the "
                                  "summed log-ratio, capped at e^10, clipped at --sequence_clip_high).")
    token_mask_low: float = _loss_field("token_mask_low", "Drop tokens whose ratio is below this (0 = off).")
    token_mask_high: float = _loss_field("token_mask_high", "Drop tokens whose ratio is above this (1e10 = off).")
    sequence_mask_low: float = _loss_field("sequence_mask_low", "Drop sequences whose min token ratio is below this.")
    sequence_mask_high: float = _loss_field("sequence_mask_high", "Drop sequences whose max token ratio is above this.")
    geo_mask_low: float = _loss_field("geo_mask_low", "Drop sequences whose geometric-mean ratio is below this.")
    geo_mask_high: float = _loss_field("geo_mask_high", "Drop sequences whose geometric-mean ratio is above this.")
    sequence_clip_high: float = _loss_field("sequence_clip_high", "Clip of the sequence ratio (1e10 = off).")
    token_clip_high: float = _loss_field("token_clip_high", "Truncated IS: clamp the token ratio at this (1e10 = off; "
                                         "Yao et al. 2025).")
    kl_tau: float = _loss_field("kl_tau", "Weight of the -kl_tau * log-ratio term added to the advantage (prime-rl).")
    loss_adv_tau: float = _loss_field("loss_adv_tau", "Weight of the advantage in the off-policy loss (prime-rl's "
                                      "trainer.loss.adv_tau; distillation's task weight is --adv_tau).")

    def validate_offpolicy(self) -> None:
        """Raise ConfigError for impossible settings (called by ExtGRPOConfig before TRL's own checks)."""
        k = self.max_async_level
        if k < 0:
            raise ConfigError(f"--max_async_level must be >= 0, got {k}")
        if self.strict_async_level and k == 0:
            raise ConfigError("--strict_async_level needs --max_async_level >= 1 (0 is synchronous on-policy)")
        if self.generator_threads < 0:
            raise ConfigError(f"--generator_threads must be >= 0, got {self.generator_threads}")
        ImportanceConfig.from_object(self)  # validates every loss flag
        if k == 0:
            changed = [n for n in PRIME_RL_DEFAULTS if getattr(self, n) != PRIME_RL_DEFAULTS[n]]
            if changed:
                raise ConfigError(f"--{changed[0]} has no effect with --max_async_level 0 (on-policy: TRL's own loss)")
            return
        NORMALISATIONS.get(self.loss_type)
        defaults = {f.name: f.default for f in fields(GRPOConfig)}
        for name in _PPO_ONLY:
            if getattr(self, name) != defaults[name] and not (name == "steps_per_generation" and self._spg_is_ga()):
                raise ConfigError(
                    f"--{name} {getattr(self, name)!r} is not supported with --max_async_level {k} "
                    f"(keep TRL's default {defaults[name]!r}; the off-policy loss and generator do not use it)"
                )
        if self.max_completion_length is None or self.max_completion_length < 1:
            raise ConfigError("--max_completion_length must be >= 1 with --max_async_level >= 1")
        if not self.temperature > 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ConfigError(f"the generator needs --temperature > 0, 0 < --top_p <= 1 and --top_k >= 0, got "
                              f"{self.temperature}, {self.top_p}, {self.top_k}")  # fmt: skip

    def _spg_is_ga(self) -> bool:
        return self.steps_per_generation == self.gradient_accumulation_steps
