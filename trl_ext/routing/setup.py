"""Building a run's routing pieces before the trainer exists: the dual-adapter model (`build_dual_lora_model`) and
the routing component's keyword arguments of a validated train.py run (`routing_setup`: detector, base reward, routing-eval
prompts and rewards)."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from rewards.bound import on_prompts
from trl_ext.routing.adapter_layout import DualLoRALayout
from trl_ext.routing.adapters import apply_dual_lora
from trl_ext.routing.args import check_run_routing


def build_dual_lora_model(model_path: str, cfg, alpha: float, targets: tuple[str, ...] | None = None
                          ) -> tuple[nn.Module, DualLoRALayout]:
    """Load ``model_path`` as GRPOTrainer would (``model_init_kwargs``) and wrap it with dual LoRA or MLP adapters
    (``alpha`` and ``targets``, None = every linear of a block: LoRA only)."""
    from trl.trainer.utils import create_model_from_path

    from trl_ext.launch.processes import model_init_kwargs

    kwargs = model_init_kwargs(cfg)  # on this process's GPU, as the trainer's own load (trl_ext.api)
    kwargs.setdefault("trust_remote_code", cfg.trust_remote_code)
    if cfg.distributed_state.distributed_type in ("MULTI_GPU", "DEEPSPEED"):
        kwargs["device_map"] = None
    model = create_model_from_path(model_path, **kwargs)
    retain, forget = cfg.adapter_ranks
    if cfg.adapter_type == "mlp":
        from trl_ext.routing.mlp import apply_dual_mlp

        layout = apply_dual_mlp(model, retain, forget, cfg.lora_layer_start, cfg.lora_layer_end, cfg.lora_layer_stride)
    else:
        layout = apply_dual_lora(model, retain, forget, alpha, cfg.lora_layer_start, cfg.lora_layer_end,
                                 cfg.lora_layer_stride, targets, include_lm_head=cfg.lora_lm_head)
    if cfg.gradient_checkpointing:
        model.enable_input_require_grads()  # frozen embeddings: reentrant checkpointing needs a grad input
    return model, layout


def routing_setup(
    run, cfg, reward_config, model_path: str, tokenizer, prompt_source: str, eval_data=None
) -> tuple[str | nn.Module, dict]:
    """(model for GRPOTrainer, the routing component's keyword arguments) of a validated run; ``prompt_source`` is the
    ``load_prompts`` source of the training prompts, whose split "test" feeds the routing eval; a --dataset run's
    routing eval takes the first --eval_routing_prompts rows of ``eval_data`` (--eval_dataset's
    `trl_ext.data.load.PromptData`; text prompts, enough rows: checked at parse time by
    `trl_ext.data.load.load_run_data`), each reward getting the rows' columns."""
    detector = check_run_routing(run, cfg, reward_config)
    kwargs = {"rh_detector": None if detector is None else (detector, reward_config.detector(detector))}
    if cfg.base_reward is not None:
        kwargs["base_reward"] = (cfg.base_reward, reward_config.reward(cfg.base_reward))
    if not cfg.dual_lora:
        return model_path, kwargs
    targets = None if run.lora_targets is None else run.lora_targets.names
    model, kwargs["dual_lora_layout"] = build_dual_lora_model(model_path, cfg, cfg.dual_lora_alpha, targets)
    kwargs["dual_lora_base"] = str(Path(model_path).resolve()) if Path(model_path).is_dir() else model_path
    if cfg.eval_routing_steps and not cfg.env and run.dataset:
        import warnings

        from trl_ext.data.load import PROMPT, row_scorer
        from trl_ext.routing.args import routing_eval_count

        with warnings.catch_warnings():  # said once, at parse time (trl_ext.data.load.load_run_data)
            warnings.simplefilter("ignore")
            n = routing_eval_count(cfg, len(eval_data.dataset), f"--eval_dataset {eval_data.source}")
        kwargs["routing_eval_prompts"] = list(eval_data.dataset.select(range(n))[PROMPT])
        kwargs["routing_eval_rewards"] = {name: row_scorer(reward_config.reward(name), eval_data, n)
                                          for name in [run.reward, *run.eval_reward_names]}  # fmt: skip
    elif cfg.eval_routing_steps and not cfg.env:  # env runs play held-out levels (routing.evaluation.env_routing_eval)
        from environments.stories import load_prompts

        prompts = list(load_prompts(prompt_source, tokenizer, run.prompt_length, "test", cfg.eval_routing_prompts,
                                    cfg.seed)["prompt"])  # fmt: skip
        kwargs["routing_eval_prompts"] = prompts
        kwargs["routing_eval_rewards"] = {n: on_prompts(reward_config.reward(n), prompts)
                                          for n in [run.reward, *run.eval_reward_names]}  # fmt: skip
    return model, kwargs
