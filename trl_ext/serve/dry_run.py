"""layout.py ``--dry_run`` (`dry_run`): the plan of a layout per device (`trl_ext.serve.fit`) from the model's config
alone, for the GPUs stated (``--plan_gpus``) or seen; ConfigError (exit 2) naming a device that cannot hold its parts."""

from __future__ import annotations

from collections.abc import Sequence

from trl_ext.registry import ConfigError
from trl_ext.serve.fit import (ModelShape, ServerPart, TrainerPart, cuda_inventory, model_shape, parse_inventory,
                               plan_fit)


def dry_run(layout, args) -> str:
    """layout.py ``--dry_run``: the plan of ``layout`` (`trl_ext.serve.plan.Layout`, read by attribute) for
    ``args.plan_gpus`` or this machine's CUDA devices. The trainer's figures come from train.py's flags as the
    trainer parses them; its rows are taken at the servers' max_model_len (the longest a row can be: an upper
    bound). ConfigError (exit 2) with the problems and the plan when a device cannot hold its parts."""
    from trl_ext.cli_train import parser

    inventory = parse_inventory(args.plan_gpus) if args.plan_gpus else cuda_inventory()
    if not inventory:
        raise ConfigError("--dry_run sees no CUDA device here: state the GPUs to plan for with --plan_gpus (e.g. 8x80)")
    cfg, _ = parser().parse_known_args(layout.flags)
    shapes: dict[str, ModelShape] = {}
    for s in layout.servers:  # each server's config, as the plan read it
        shapes.setdefault(s.model, model_shape(s.config, cfg.trust_remote_code))
    servers = [ServerPart(s.role, s.index, shapes[s.model], list(s.devices), _flag(s.command, "--dtype"),
                          s.gpu_share, s.max_model_len) for s in layout.servers]
    policy = layout.servers[0]  # the policy's first replica: the trainer's model
    init = cfg.model_init_kwargs if isinstance(cfg.model_init_kwargs, dict) else {}
    n, targets, shape = len(layout.trainer_devices), cfg.lora_target_modules, shapes[policy.model]
    loaded = str(init.get("dtype") or "float32").removeprefix("torch.")
    trainer = TrainerPart(
        shape, list(layout.trainer_devices), "FSDP2" if cfg.fsdp else "DDP" if n > 1 else "none",
        cfg.lora_rank, [t.strip() for t in targets.split(",")] if targets else None, cfg.per_device_train_batch_size,
        policy.max_model_len, cfg.max_completion_length, bool(cfg.activation_checkpointing), cfg.beta > 0, None,
        shape.dtype if loaded == "auto" else loaded,
        "bfloat16" if cfg.bf16 else "float16" if cfg.fp16 else None, _dual(cfg))  # fmt: skip
    plan = plan_fit(servers, trainer, inventory)
    where = f"--plan_gpus {args.plan_gpus}" if args.plan_gpus else "this machine's CUDA devices"
    text = f"layout.py --dry_run: {len(inventory)} GPUs ({where}); nothing started, no weights read\n{plan.describe()}"
    if plan.problems:
        hint = (f" (its rows are planned at the servers' max_model_len, {policy.max_model_len} tokens: a lower "
                "--max_model_len bounds them, as do --per_device_train_batch_size and --activation_checkpointing)")
        problems = [p + hint * ("a trainer process" in p) for p in plan.problems]
        raise ConfigError("the layout does not fit its devices: " + "; ".join(problems) + "\n" + text)
    return text


def _dual(cfg) -> tuple[str, int, int] | None:
    """train.py's dual adapters (``trl_ext.routing``: LoRA or MLP, retain and forget ranks), or None."""
    if (cfg.lora_config, cfg.mlp_config, cfg.retain_rank, cfg.forget_rank) == (None, None, None, None):
        return None
    from trl_ext.routing.mlp import MLP_PRESETS
    from trl_ext.routing.step import resolve_adapter_ranks

    if cfg.adapter_type == "mlp":
        ranks = resolve_adapter_ranks(cfg.mlp_config, cfg.retain_rank, cfg.forget_rank,
                                      routing=cfg.gradient_routing, presets=MLP_PRESETS, flag="--mlp_config")
    else:
        ranks = resolve_adapter_ranks(cfg.lora_config, cfg.retain_rank, cfg.forget_rank, routing=cfg.gradient_routing)
    return cfg.adapter_type, *ranks


def _flag(command: Sequence[str], name: str) -> str:
    return command[command.index(name) + 1]
