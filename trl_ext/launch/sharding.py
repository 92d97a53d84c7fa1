"""Sharded training (FSDP, DeepSpeed): what a launch may ask for, checked at parse time.

**FSDP2 runs the plain paths** (story or dataset rewards, ``--eval_rewards``, k = 0, full fine-tune or PEFT LoRA,
TRL's generation, saved rollouts, TRL's eval loop, resume) and the features (routing, distillation, off-policy k >= 1,
environments, SFT mode), on several CPU processes (gloo) too (`trl_ext.launch.fsdp`; each feature's sharded path is its
own). The parts not run under FSDP2 (the fast backend at k = 0, vLLM) or under any ZeRO stage (every feature)
refuse it in their ``supports`` / ``check_args`` (`trl_ext.parts`; the common wording:
`trl_ext.launch.refusals.Launch.unsharded`), an error (exit 2), never a silent wrong sample.

**What FSDP needs** (`check_fsdp`), each a ConfigError rather than a setting accelerate would ignore:

- processes: accelerate applies FSDP only to a launched process (torchrun / accelerate launch set ``LOCAL_RANK``) on
  a GPU, or to several CPU processes. A plain start (``uv run train.py --fsdp``) keeps ``DistributedType.NO`` and
  drops the plugin, and so does one CPU process;
- FSDP2: ``fsdp_config`` ``version`` 2 (transformers' default; FSDP1 is deprecated there and has not been run here);
- full-state-dict checkpoints (``state_dict_type`` FULL_STATE_DICT, transformers' default): the checkpoint holds
  ``model.safetensors`` (or the adapter), which eval_run.py loads on one process, beside the FSDP files
  (``pytorch_model_fsdp.bin``, ``optimizer.bin``) that ``--resume_from_checkpoint`` loads. A sharded state dict
  writes no ``model.safetensors``;
- ``--fsdp_config`` only with ``--fsdp`` (transformers reads it only then).

DeepSpeed on CPU processes is refused: accelerate runs them as DDP and ignores it.

How a launch asks for sharding: ``--fsdp`` (with ``--fsdp_config FILE.json``) / ``--deepspeed CONFIG``
(TrainingArguments), or ``accelerate launch --config_file accelerate_configs/<fsdp2|deepspeed_*>.yaml`` (accelerate
exports ``ACCELERATE_USE_FSDP`` / ``ACCELERATE_USE_DEEPSPEED`` and ``FSDP_*``, which transformers and accelerate read).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from trl_ext.launch.refusals import Launch, check_launch
from trl_ext.registry import ConfigError

_TRUE = ("1", "true", "yes", "y", "on")
FSDP_VERSION = 2  # the one FSDP version run here (transformers' default for --fsdp)
FSDP_STATE_DICT = "FULL_STATE_DICT"  # the one checkpoint form run here (transformers' default for --fsdp)


def sharded_training(cfg, environ: Mapping[str, str] | None = None) -> str | None:
    """"FSDP" or "DeepSpeed" when the run shards its training state, else None."""
    env = os.environ if environ is None else environ
    if getattr(cfg, "fsdp", None) or env.get("ACCELERATE_USE_FSDP", "false").lower() in _TRUE:
        return "FSDP"
    if getattr(cfg, "deepspeed", None) or env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in _TRUE:
        return "DeepSpeed"
    return None


def fsdp_settings(cfg, environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """(FSDP version, state dict type) an FSDP run asks for: from ``--fsdp_config`` (a dict, or a JSON file; keys
    with or without transformers' ``fsdp_`` prefix) with transformers' defaults, or, without ``--fsdp``, from the
    ``FSDP_*`` variables accelerate launch exports, with accelerate's defaults."""
    env = os.environ if environ is None else environ
    if not getattr(cfg, "fsdp", None):
        version = int(env.get("FSDP_VERSION", "1"))
        return version, env.get("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT" if version == 1 else "SHARDED_STATE_DICT")
    conf = cfg.fsdp_config or {}
    if isinstance(conf, (str, Path)):
        if not Path(conf).is_file():
            raise ConfigError(f"--fsdp_config {conf}: no such file (a JSON file of transformers' fsdp_config keys)")
        try:
            conf = json.loads(Path(conf).read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"--fsdp_config {cfg.fsdp_config}: not JSON ({e})") from None
    conf = {k.removeprefix("fsdp_"): v for k, v in conf.items()}
    return int(conf.get("version", FSDP_VERSION)), str(conf.get("state_dict_type", FSDP_STATE_DICT))


def check_fsdp(cfg, environ: Mapping[str, str] | None = None, cuda: bool | None = None) -> None:
    """ConfigError for an FSDP or DeepSpeed request that would be ignored or has not been run (module docstring)."""
    from trl_ext.launch import processes  # module attribute: sweep planning answers for N processes

    env = os.environ if environ is None else environ
    kind = sharded_training(cfg, env)
    if getattr(cfg, "fsdp_config", None) and not getattr(cfg, "fsdp", None):
        raise ConfigError("--fsdp_config is read only with --fsdp (transformers ignores it otherwise): add --fsdp")
    if kind is None:
        return
    n, _ = processes.launched_processes(env)
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if kind == "DeepSpeed":
        if not cuda and n > 1:
            raise ConfigError("DeepSpeed needs GPUs: on CPU processes accelerate runs DDP and ignores it (use --fsdp)")
        return
    if n == 1 and not (cuda and "LOCAL_RANK" in env):
        where = "one CPU process" if not cuda else "a plain start (no torchrun / accelerate launch)"
        raise ConfigError(f"--fsdp shards over the processes of a launch, and this is {where}: accelerate would "
                          "train unsharded. Start it with `torchrun --nproc_per_node N` (N >= 2 on CPU) or "
                          "`accelerate launch`, or drop --fsdp")
    version, state_dict = fsdp_settings(cfg, env)
    if version != FSDP_VERSION:
        raise ConfigError(f"FSDP version {version}: only FSDP{FSDP_VERSION} has been run here (transformers "
                          f"deprecates FSDP1); set fsdp_config version {FSDP_VERSION}")
    if str(state_dict).upper().removeprefix("STATEDICTTYPE.") != FSDP_STATE_DICT:
        raise ConfigError(f"FSDP state_dict_type {state_dict}: only {FSDP_STATE_DICT} checkpoints have been run here "
                          "(their model.safetensors or adapter is what eval_run.py loads)")


def check_cfg_sharding(cfg, environ: Mapping[str, str] | None = None) -> None:
    """ConfigError naming the flag of ``cfg`` whose part refuses the run's FSDP / DeepSpeed (`check_launch`), then
    what FSDP itself needs (`check_fsdp`)."""
    kind = sharded_training(cfg, environ)
    if kind is not None:
        check_launch(cfg, Launch(sharding=kind))
    check_fsdp(cfg, environ)


def sharding_tag(cfg, environ: Mapping[str, str] | None = None) -> str:
    """Run-name suffix of an FSDP run (``_fsdp2``; the names leave out the ``fsdp`` / ``fsdp_config`` values, whose
    resolved dicts would not fit a name); empty otherwise."""
    return f"_fsdp{FSDP_VERSION}" if sharded_training(cfg, environ) == "FSDP" else ""
