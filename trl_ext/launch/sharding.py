"""Sharded training (FSDP, DeepSpeed) and the project's features: refused at parse time until verified.

The fast generation backend reads every projection's full weight; the off-policy generator deep-copies the model and
publishes its trainable parameters; dual LoRA routing masks per-sample adapter gradients in its own autograd function;
distillation scores with the policy's adapters disabled. Under FSDP and DeepSpeed ZeRO-3 a process holds a shard of
each parameter (a flat, partial tensor), and none of these has been run under FSDP or any ZeRO stage, so each is an
error (exit 2) with the reason, never a silent wrong sample. The plain runs (story or dataset rewards, k = 0, full
fine-tune or PEFT LoRA, TRL's generation) are TRL's own and go through.

How a launch asks for sharding: ``--fsdp ...`` / ``--deepspeed CONFIG`` (TrainingArguments), or ``accelerate launch
--config_file accelerate_configs/<fsdp|deepspeed_*>.yaml`` (accelerate exports ``ACCELERATE_USE_FSDP`` /
``ACCELERATE_USE_DEEPSPEED``, which transformers and accelerate read).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from trl_ext.registry import ConfigError

_TRUE = ("1", "true", "yes", "y", "on")


def sharded_training(cfg, environ: Mapping[str, str] | None = None) -> str | None:
    """"FSDP" or "DeepSpeed" when the run shards its training state, else None."""
    env = os.environ if environ is None else environ
    if getattr(cfg, "fsdp", None) or env.get("ACCELERATE_USE_FSDP", "false").lower() in _TRUE:
        return "FSDP"
    if getattr(cfg, "deepspeed", None) or env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in _TRUE:
        return "DeepSpeed"
    return None


def _feature_groups() -> dict[type, str]:
    """Flag dataclasses whose every field must keep its default under sharding -> the feature's name."""
    from trl_ext.distill.args import DistillArgs
    from trl_ext.env.args import EnvArgs
    from trl_ext.offpolicy.args import OffPolicyArgs
    from trl_ext.routing.args import RoutingArgs
    from trl_ext.sft import SFTArgs

    return {RoutingArgs: "gradient routing / dual LoRA", DistillArgs: "distillation",
            OffPolicyArgs: "off-policy training", EnvArgs: "environments", SFTArgs: "SFT mode"}  # fmt: skip


def check_cfg_sharding(cfg, environ: Mapping[str, str] | None = None) -> None:
    """ConfigError for a feature not verified under the run's FSDP / DeepSpeed (see the module docstring): every
    feature subpackage's flags, the fast backend, saved rollouts, and what several processes refuse."""
    from trl_ext.launch.processes import CFG_FLAGS, changed_flag

    kind = sharded_training(cfg, environ)
    if kind is None:
        return
    flags = (("generation_backend", "the fast generation backend"), ("save_rollouts", "saved rollouts"),
             ("eval_strategy", "TRL's eval loop"), *CFG_FLAGS)  # fmt: skip
    found = changed_flag(cfg, _feature_groups(), flags)
    if found is not None:
        flag, value, feature = found
        shown = f"--{flag}" if isinstance(value, bool) else f"--{flag} {value}"
        raise ConfigError(f"{shown}: {feature} has not been run under {kind} (it reads or copies whole parameters, "
                          f"which {kind} may shard); run it without {kind} (DDP or one process)")
