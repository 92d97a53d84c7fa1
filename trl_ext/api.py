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
- ``rh_detector`` and ``base_reward`` may be plain callables (named by their ``__name__``) or (name, callable);
- the routing eval (on by default with dual LoRA) takes its prompts from ``eval_dataset``, else ``train_dataset``,
  and scores them with ``reward_funcs`` when ``routing_eval_prompts`` / ``routing_eval_rewards`` are not given
  (`routing_eval_from_data`).

Everything else is TRL's: ``peft_config`` for PEFT LoRA, ``reward_funcs`` (functions with TRL's signature, or
reward model paths), ``train_dataset`` whose extra columns reach the reward functions.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trl_ext.registry import ConfigError


def _named(fn: Callable) -> tuple[str, Callable]:
    if isinstance(fn, tuple):
        return fn
    if not callable(fn):
        raise TypeError(f"expected a callable or (name, callable), got {type(fn).__name__}")
    return getattr(fn, "__name__", type(fn).__name__), fn


def ext_config(args, model) -> Any:
    """``args`` as an `ExtGRPOConfig`: as given; a default one for None (named as GRPOTrainer names it:
    ``"{model name}-GRPO"``); a plain ``trl.GRPOConfig`` converted field by field (every extension off)."""
    from trl import GRPOConfig
    from trl.trainer.utils import get_config_model_id

    from trl_ext.config import ExtGRPOConfig

    if isinstance(args, ExtGRPOConfig):
        return args
    if args is None:  # GRPOTrainer's own naming
        name = model if isinstance(model, str) else get_config_model_id(model.config)
        return ExtGRPOConfig(f"{name.split('/')[-1]}-GRPO")
    if isinstance(args, GRPOConfig):
        return ExtGRPOConfig.from_grpo_config(args)
    raise TypeError(f"args must be an ExtGRPOConfig, a trl.GRPOConfig or None, got {type(args).__name__}")


def check_trainer_arguments(cfg, adapters: bool, tool_loop: bool = False) -> None:
    """The Python API's refusals that need no model (ValueError): train.py's plan and layout.py run them too
    (`trl_ext.serve.plan.check_trainer_plan`), so a run they refuse never starts. ``adapters``: the policy has
    adapters that can be disabled (a PEFT config); ``tool_loop``: TRL's standalone ``tools=``
    are given (its own tool loop; an ``environment_factory`` plays in the project's episode loop)."""
    from trl_ext.distill.args import has_teacher

    if cfg.distill_on and cfg.teacher_tau > 0 and not has_teacher(cfg, adapters):
        raise ValueError("distillation with teacher_tau > 0 needs a teacher: args.teacher_model, a teacher server "
                         "(args.teacher_server_url), LoRA adapters (peft_config or a dual LoRA config: the teacher is "
                         "the model with them disabled) or beta > 0 (TRL's frozen reference model)")
    if tool_loop and cfg.distill_on:  # TRL's own tool loop: standalone tools= (docs/environments.md)
        raise ValueError("distillation scores single-turn completions and the project's episode loop (--env, "
                         "environment_factory); TRL's own tool loop (tools= without an environment) writes tool "
                         "results into the completion without their turns: give the tools as methods of an "
                         "environment_factory class")  # fmt: skip


def trainer_arguments(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """GRPOTrainer's arguments (positional ones bound to their names) with the conveniences above applied."""
    from transformers import set_seed
    from trl import GRPOTrainer

    from trl_ext.config import DEFAULT_LORA_ALPHA, ExtGRPOConfig
    from trl_ext.launch.processes import model_init_kwargs
    from trl_ext.models import load_tokenizer, model_source, prepare_tokenizer

    names = list(inspect.signature(GRPOTrainer.__init__).parameters)[1:]
    if len(args) > len(names):
        raise TypeError(f"ExtGRPOTrainer takes at most {len(names)} positional arguments, got {len(args)}")
    named = {**dict(zip(names, args)), **kwargs}
    cfg = named["args"] = ext_config(named.get("args"), named.get("model"))
    if (pinned := model_init_kwargs(cfg)) != dict(cfg.model_init_kwargs or {}):
        cfg.model_init_kwargs = pinned  # TRL's loads (policy, reference) on this process's GPU
    for key in ("rh_detector", "base_reward"):
        if named.get(key) is not None:
            named[key] = _named(named[key])
    check_trainer_arguments(cfg, adapters=named.get("peft_config") is not None,
                            tool_loop=bool(named.get("tools")) and named.get("environment_factory") is None)
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
    if cfg.dual_lora and named.get("dual_lora_layout") is not None and cfg.eval_routing_steps > 0 and not cfg.env \
            and named.get("routing_eval_prompts") is None:  # (a model without dual adapters: the routing component refuses)
        prompts, rewards = routing_eval_from_data(named, cfg)
        named["routing_eval_prompts"] = prompts
        if named.get("routing_eval_rewards") is None:  # a script's own eval rewards are kept
            named["routing_eval_rewards"] = rewards
    return named


def routing_eval_from_data(named: dict[str, Any], cfg) -> tuple[list[str], dict[str, Callable]]:
    """The routing eval's prompts and rewards when a script gives neither: the first ``cfg.eval_routing_prompts``
    rows of ``eval_dataset`` (else of ``train_dataset``), as train.py takes them from --eval_dataset, and the
    ``reward_funcs`` called as TRL calls them (``prompts``, ``completions`` and the rows' other columns)."""
    ways = ("pass routing_eval_prompts and routing_eval_rewards, or set eval_routing_steps=0 to switch the routing "
            "eval off")
    data = named.get("eval_dataset") if named.get("eval_dataset") is not None else named.get("train_dataset")
    from datasets import Dataset

    from trl_ext.routing.args import routing_eval_count

    if not isinstance(data, Dataset) or "prompt" not in data.column_names:
        raise ValueError(f"the routing eval (on with dual LoRA: eval_routing_steps={cfg.eval_routing_steps}) takes "
                         f"its {cfg.eval_routing_prompts} prompts from eval_dataset or train_dataset (a "
                         f"datasets.Dataset with a 'prompt' column); {ways}")
    which = "eval_dataset" if named.get("eval_dataset") is not None else "train_dataset"
    try:
        n = routing_eval_count(cfg, len(data), which)
    except ConfigError as e:
        raise ValueError(f"{e}; {ways}") from None
    rows = data.select(range(n))
    prompts = list(rows["prompt"])
    if not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"the routing eval samples from text prompts; the dataset's prompts are conversational: {ways}")
    funcs = named.get("reward_funcs")
    funcs = funcs if isinstance(funcs, list) else [funcs]
    if not funcs or not all(callable(f) for f in funcs):
        raise ValueError(f"the routing eval scores with the reward functions; a reward model path is not one: {ways}")
    columns = {c: list(rows[c]) for c in rows.column_names if c not in ("prompt", "completion", "completion_ids")}

    def scorer(fn: Callable) -> Callable[[list[str]], list]:
        def score(texts: list[str]) -> list:
            k = len(texts)
            return fn(prompts=prompts[:k], completions=list(texts), **{c: v[:k] for c, v in columns.items()})

        return score

    names = [getattr(f, "__name__", type(f).__name__) for f in funcs]
    names = [name if names.count(name) == 1 else f"{name}_{i}" for i, name in enumerate(names)]
    return prompts, {name: scorer(fn) for name, fn in zip(names, funcs)}
