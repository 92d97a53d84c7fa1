"""The Python API's conveniences: what train.py does around `ExtGRPOTrainer`, done by the trainer itself when a
script builds it the way TRL users build ``GRPOTrainer``::

    trainer = ExtGRPOTrainer(model="Qwen/Qwen3-0.6B", reward_funcs=[accuracy], args=ExtGRPOConfig(...),
                             train_dataset=dataset, rh_detector=my_detector)

- ``model`` may be a builtin model name (``"builtin"``, ``"builtin_env"``, ``"builtin_search"``, ``"builtin_mood"``:
  built on first use), a local path or a hub id, as ``--model``;
- without ``processing_class`` the model's tokenizer is loaded and prepared as train.py prepares it (PAD = EOS,
  left padding: ``trl_ext.models.prepare_tokenizer``);
- with a dual LoRA config in ``args`` (``lora_config`` / ``retain_rank`` / ``forget_rank`` / ``mlp_config``) and a
  model given by name or path, the dual adapters are built here from the run's seed (``routing_setup`` in train.py;
  alpha: ``args.dual_lora_alpha`` if set, else the preset's, else ``--lora_alpha``'s default);
- ``rh_detector`` and ``base_reward`` may be plain callables (named by their ``__name__``) or (name, callable).

Everything else is TRL's: ``peft_config`` for PEFT LoRA, ``reward_funcs`` (functions with TRL's signature, or
reward model paths), ``train_dataset`` whose extra columns reach the reward functions.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _named(fn: Callable) -> tuple[str, Callable]:
    if isinstance(fn, tuple):
        return fn
    if not callable(fn):
        raise TypeError(f"expected a callable or (name, callable), got {type(fn).__name__}")
    return getattr(fn, "__name__", type(fn).__name__), fn


def trainer_arguments(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """GRPOTrainer's arguments (positional ones bound to their names) with the conveniences above applied."""
    from transformers import set_seed
    from trl import GRPOTrainer

    from trl_ext.config import DEFAULT_LORA_ALPHA, ExtGRPOConfig
    from trl_ext.models import load_tokenizer, model_source, prepare_tokenizer

    names = list(inspect.signature(GRPOTrainer.__init__).parameters)[1:]
    if len(args) > len(names):
        raise TypeError(f"ExtGRPOTrainer takes at most {len(names)} positional arguments, got {len(args)}")
    named = {**dict(zip(names, args)), **kwargs}
    cfg = named.get("args")
    if not isinstance(cfg, ExtGRPOConfig):
        raise TypeError(f"args must be an ExtGRPOConfig, got {type(cfg).__name__}")
    for key in ("rh_detector", "base_reward"):
        if named.get(key) is not None:
            named[key] = _named(named[key])
    if cfg.distill_on and cfg.teacher_tau > 0 and not (cfg.teacher_model or cfg.dual_lora or cfg.beta > 0
                                                        or named.get("peft_config") is not None):
        raise ValueError("distillation with teacher_tau > 0 needs a teacher: args.teacher_model, LoRA adapters "
                         "(peft_config or a dual LoRA config: the teacher is the model with them disabled) or "
                         "beta > 0 (TRL's frozen reference model)")  # train.py: distill.args.check_run_distill
    if named.get("environment_factory") is not None or named.get("tools"):  # TRL's tool loop (README "Search")
        if cfg.distill_on:
            raise ValueError("distillation scores single-turn and --env completions; TRL's tool loop (tools / "
                             "environment_factory) writes tool results into the completion, which the teacher's "
                             "system-message context cannot be placed around: not supported")
        if cfg.env:
            raise ValueError("args.env runs the project's episode loop; environment_factory / tools run TRL's tool "
                             "loop: give one of them")
    model = named.get("model")
    if isinstance(model, str):
        model = named["model"] = model_source(model)
        if named.get("processing_class") is None:
            named["processing_class"] = prepare_tokenizer(load_tokenizer(model))
        if cfg.dual_lora and named.get("dual_lora_layout") is None:
            from trl_ext.routing.setup import build_dual_lora_model
            from trl_ext.routing.step import resolve_dual_lora_alpha

            if cfg.dual_lora_alpha is None:  # train.py resolves it from --lora_alpha (routing.args.check_run_routing)
                cfg.dual_lora_alpha = resolve_dual_lora_alpha(cfg.lora_config, DEFAULT_LORA_ALPHA, False)
            set_seed(cfg.seed)  # the adapters' initialisation is the run's, as in train.py
            named["model"], named["dual_lora_layout"] = build_dual_lora_model(model, cfg, cfg.dual_lora_alpha)
            named.setdefault("dual_lora_base", str(Path(model).resolve()) if Path(model).is_dir() else model)
    return named
