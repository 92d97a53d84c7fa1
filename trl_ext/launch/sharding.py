"""Sharded training (FSDP, DeepSpeed): refused at parse time for every part not yet verified under it.

Under FSDP and DeepSpeed ZeRO-3 a process holds a shard of each parameter (a flat, partial tensor). The parts that
read or copy whole parameters (the fast generation backend, the off-policy generator, dual LoRA routing,
distillation's adapter-disabled teacher ...) have not been run under FSDP or any ZeRO stage: each refuses it in its
``supports`` (`trl_ext.parts`; their reasons: `trl_ext.launch.refusals.Launch.unsharded`), an error (exit 2), never a
silent wrong sample. The plain runs (story or dataset rewards, k = 0, full fine-tune or PEFT LoRA, TRL's generation)
are TRL's own and go through.

How a launch asks for sharding: ``--fsdp ...`` / ``--deepspeed CONFIG`` (TrainingArguments), or ``accelerate launch
--config_file accelerate_configs/<fsdp|deepspeed_*>.yaml`` (accelerate exports ``ACCELERATE_USE_FSDP`` /
``ACCELERATE_USE_DEEPSPEED``, which transformers and accelerate read).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from trl_ext.launch.refusals import Launch, check_launch

_TRUE = ("1", "true", "yes", "y", "on")


def sharded_training(cfg, environ: Mapping[str, str] | None = None) -> str | None:
    """"FSDP" or "DeepSpeed" when the run shards its training state, else None."""
    env = os.environ if environ is None else environ
    if getattr(cfg, "fsdp", None) or env.get("ACCELERATE_USE_FSDP", "false").lower() in _TRUE:
        return "FSDP"
    if getattr(cfg, "deepspeed", None) or env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in _TRUE:
        return "DeepSpeed"
    return None


def check_cfg_sharding(cfg, environ: Mapping[str, str] | None = None) -> None:
    """ConfigError naming the flag of ``cfg`` whose part refuses the run's FSDP / DeepSpeed (`check_launch`)."""
    kind = sharded_training(cfg, environ)
    if kind is not None:
        check_launch(cfg, Launch(sharding=kind))
