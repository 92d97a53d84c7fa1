"""Gradient routing in the trainer (Cloud et al. 2024, arXiv:2410.04332; seed 004): config fields
(`RoutingArgs`), dual-LoRA model building and the trainer plumbing (`RoutingMixin`). The math lives in
routing.py (adapters), routing_step.py (routed backward, labels) and routing_eval.py (three-mode eval).

One step with ``--gradient_routing``:
1. `_generate_and_score_completions`: the RH detector flags each completion; ``is_rh`` and the routing
   labels ``is_bad`` (``routing_labels``, deterministic in (seed, global_step)) join the batch dict, so
   TRL's shuffle and split keep them aligned with their samples.
2. `training_step`: ``_prepare_inputs`` once, one routed backward (single pass by default, or the two-pass
   reference), then GRPOTrainer.training_step's own bookkeeping (``_step`` += 1, ``step_time``).
3. Every ``--eval_routing_steps`` and at the last step: the routing eval, printed to train.log, added to
   the trainer's metrics (wandb) and appended to ``{run_dir}/routing_eval.jsonl``.

Any dual-LoRA run (routed or not) gets the reference policy "all adapters disabled" when beta > 0 (the
same model, no second copy), the routing eval, and ``dual_lora_layout.json`` in every checkpoint. A
detector, when one is configured, logs ``rh_rate`` for any run. With the feature off nothing changes.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import TrainerCallback
from trl import GRPOTrainer

from trl_ext.registry import ConfigError
from trl_ext.routing import (
    DualLoRALayout, DualLoRALinear, adapters_disabled, apply_dual_lora, check_routing_mode, save_layout,
)
from trl_ext.routing_eval import append_record, format_results, routing_eval
from trl_ext.routing_step import (
    SAMPLE_MEAN_LOSS_TYPES, _check_frac, resolve_adapter_ranks, routing_labels, single_pass_backward,
    two_pass_backward,
)

TextDetector = Callable[[list[str]], list[bool]]


@dataclass
class RoutingArgs:
    """Dual LoRA adapters and gradient routing (mixed into ExtGRPOConfig). LoRA alpha is RunArgs.lora_alpha."""

    gradient_routing: bool = field(default=False, metadata={
        "help": "Route the gradients of RH-flagged completions away from the retain adapter (needs --routing_mode "
                "and a dual LoRA config)."})
    routing_mode: str | None = field(default=None, metadata={
        "help": "'shared': forget adapter learns from all samples; 'exclusive': only from flagged ones. The retain "
                "adapter learns from unflagged samples in both."})
    lora_config: str | None = field(default=None, metadata={
        "help": "Dual LoRA preset naming (retain, forget) ranks, e.g. r8 = (8, 8), r32f4 = (32, 4)."})
    retain_rank: int | None = field(default=None, metadata={"help": "Retain adapter rank (with --forget_rank)."})
    forget_rank: int | None = field(default=None, metadata={
        "help": "Forget adapter rank (with --retain_rank); 0 without routing = one plain LoRA (the matched baseline)."})
    lora_layer_start: int = field(default=0, metadata={"help": "First decoder layer with dual LoRA adapters."})
    lora_layer_end: int | None = field(default=None, metadata={
        "help": "End (exclusive) of the adapted layers; None = all."})
    lora_layer_stride: int = field(default=1, metadata={"help": "Adapt every k-th layer from --lora_layer_start."})
    lora_lm_head: bool = field(default=False, metadata={
        "help": "Also give the output layer (LM head) both adapters; with routing this needs --routing_two_pass "
                "(TRL's fused head reads a merged weight, which cannot mask per sample)."})
    rh_detector: str | None = field(default=None, metadata={
        "help": "RH detector binding from --config; default: the reward binding's rh_detector."})
    rh_eligible_frac: float = field(default=1.0, metadata={
        "help": "Fraction of samples (exact count, seeded per step) whose detection may be routed. Labels only: "
                "the reward is not changed."})
    routing_frac: float = field(default=1.0, metadata={
        "help": "Fraction of detected eligible samples that are routed."})
    label_noise_frac: float = field(default=0.0, metadata={
        "help": "Fraction of all samples whose routing label is flipped."})
    routing_two_pass: bool = field(default=False, metadata={
        "help": "Use the two-pass reference step (good samples, then bad samples) instead of the single pass."})
    eval_routing_steps: int = field(default=100, metadata={
        "help": "Run the three-mode routing eval every N steps and at the end (dual LoRA runs); 0 = never."})
    eval_routing_prompts: int = field(default=64, metadata={
        "help": "Held-out prompts (split 'test') of the routing eval."})

    @property
    def dual_lora(self) -> bool:
        return (self.lora_config, self.retain_rank, self.forget_rank) != (None, None, None)

    @property
    def adapter_ranks(self) -> tuple[int, int]:
        return resolve_adapter_ranks(self.lora_config, self.retain_rank, self.forget_rank,
                                     routing=self.gradient_routing)

    def validate_routing(self) -> None:
        if self.dual_lora:
            resolve_adapter_ranks(self.lora_config, self.retain_rank, self.forget_rank, routing=self.gradient_routing)
        elif self.lora_layer_start != 0 or self.lora_layer_end is not None or self.lora_layer_stride != 1 \
                or self.lora_lm_head:
            raise ConfigError("--lora_layer_*/--lora_lm_head need a dual LoRA config (--lora_config or "
                              "--retain_rank/--forget_rank)")
        if self.lora_layer_start < 0 or self.lora_layer_stride < 1 or (
                self.lora_layer_end is not None and self.lora_layer_end <= self.lora_layer_start):
            raise ConfigError(f"bad dual LoRA layer range: start {self.lora_layer_start}, end {self.lora_layer_end}, "
                              f"stride {self.lora_layer_stride}")
        if self.gradient_routing:
            if self.routing_mode is None:
                raise ConfigError("--gradient_routing needs --routing_mode shared|exclusive")
            check_routing_mode(self.routing_mode)
            if not self.dual_lora:
                raise ConfigError("--gradient_routing needs a dual LoRA config: --lora_config PRESET or "
                                  "--retain_rank/--forget_rank")
            if self.loss_type not in SAMPLE_MEAN_LOSS_TYPES:
                raise ConfigError(f"--gradient_routing needs a per-sample mean loss (--loss_type "
                                  f"{' or '.join(SAMPLE_MEAN_LOSS_TYPES)}), got {self.loss_type!r}")
            if self.lora_lm_head and not self.routing_two_pass:
                raise ConfigError("--lora_lm_head with --gradient_routing needs --routing_two_pass")
            if self.routing_two_pass and (self.entropy_coef or self.use_adaptive_entropy
                                          or self.top_entropy_quantile < 1.0):
                raise ConfigError("--routing_two_pass needs a loss without batch-level entropy terms "
                                  "(entropy_coef 0, no adaptive entropy, top_entropy_quantile 1)")
        else:
            unused = {"--routing_mode": self.routing_mode is not None, "--routing_two_pass": self.routing_two_pass,
                      "--rh_eligible_frac": self.rh_eligible_frac != 1.0, "--routing_frac": self.routing_frac != 1.0,
                      "--label_noise_frac": self.label_noise_frac != 0.0}
            if any(unused.values()):
                raise ConfigError(f"{', '.join(k for k, v in unused.items() if v)} apply only with --gradient_routing")
        for name in ("rh_eligible_frac", "routing_frac", "label_noise_frac"):
            _check_frac(f"--{name}", getattr(self, name))
        if self.eval_routing_steps < 0:
            raise ConfigError(f"--eval_routing_steps must be >= 0, got {self.eval_routing_steps}")
        if self.eval_routing_prompts < 2:
            raise ConfigError(f"--eval_routing_prompts must be >= 2, got {self.eval_routing_prompts}")
        if self.dual_lora and (self.use_vllm or self.sync_ref_model):
            raise ConfigError("dual LoRA supports neither --use_vllm nor --sync_ref_model")


def check_run_routing(run, cfg, reward_config) -> str | None:
    """Checks that need RunArgs and the reward config; returns the RH detector binding name (None = none)."""
    if cfg.dual_lora and run.lora_rank:
        raise ConfigError("--lora_rank (PEFT LoRA) and a dual LoRA config (--lora_config/--retain_rank/--forget_rank) "
                          "exclude each other; the matched-capacity baseline of a routed run is either alone")
    name = cfg.rh_detector or reward_config.default_detector(run.reward)
    if name is not None:
        reward_config.detector(name)  # raises ConfigError listing the bound detectors
    elif cfg.gradient_routing:
        raise ConfigError(f"--gradient_routing needs an RH detector: reward {run.reward!r} names no rh_detector; "
                          f"pass --rh_detector (bound: {', '.join(reward_config.detector_names()) or '(none)'})")
    return name


def dual_lora_tag(cfg) -> str | None:
    """Run-name adapter tag of a dual LoRA run (``dual_r32f16``), None otherwise."""
    return "dual_r{}f{}".format(*cfg.adapter_ranks) if cfg.dual_lora else None


def build_dual_lora_model(model_path: str, cfg, alpha: float) -> tuple[nn.Module, DualLoRALayout]:
    """Load ``model_path`` as GRPOTrainer would (``model_init_kwargs``) and wrap it with dual LoRA."""
    from trl.trainer.utils import create_model_from_path

    kwargs = dict(cfg.model_init_kwargs or {})
    kwargs.setdefault("trust_remote_code", cfg.trust_remote_code)
    if cfg.distributed_state.distributed_type in ("MULTI_GPU", "DEEPSPEED"):
        kwargs["device_map"] = None
    model = create_model_from_path(model_path, **kwargs)
    retain, forget = cfg.adapter_ranks
    layout = apply_dual_lora(model, retain, forget, alpha, cfg.lora_layer_start, cfg.lora_layer_end,
                             cfg.lora_layer_stride, include_lm_head=cfg.lora_lm_head)
    if cfg.gradient_checkpointing:
        model.enable_input_require_grads()  # frozen embeddings: reentrant checkpointing needs a grad input
    return model, layout


def routing_setup(
    run, cfg, reward_config, model_path: str, tokenizer, prompt_source: str
) -> tuple[str | nn.Module, dict]:
    """(model for GRPOTrainer, RoutingMixin keyword arguments) of a validated run; ``prompt_source`` is the
    ``load_prompts`` source of the training prompts, whose split "test" feeds the routing eval."""
    detector = check_run_routing(run, cfg, reward_config)
    kwargs = {"rh_detector": None if detector is None else (detector, reward_config.detector(detector))}
    if not cfg.dual_lora:
        return model_path, kwargs
    model, kwargs["dual_lora_layout"] = build_dual_lora_model(model_path, cfg, run.lora_alpha)
    if cfg.eval_routing_steps:
        from environments.stories import load_prompts

        prompts = load_prompts(prompt_source, tokenizer, run.prompt_length, "test", cfg.eval_routing_prompts, cfg.seed)
        kwargs["routing_eval_prompts"] = list(prompts["prompt"])
        kwargs["routing_eval_rewards"] = {n: reward_config.reward(n) for n in [run.reward, *run.eval_reward_names]}
    return model, kwargs


class AdaptersDisabledReference(nn.Module):
    """TRL's ``ref_model`` for a dual LoRA policy: the policy itself, run with both adapters off."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        object.__setattr__(self, "policy", policy)  # not a submodule: no second set of parameters

    def forward(self, *args, **kwargs):
        with adapters_disabled(self.policy):
            return self.policy(*args, **kwargs)


class _RoutingEvalCallback(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.eval_routing_steps == 0 or state.global_step == state.max_steps:
            self.trainer.run_routing_eval()
            control.should_log = True  # the eval metrics go out with this step's log
        return control


class RoutingMixin:
    """GRPOTrainer hooks for dual LoRA and gradient routing (see the module docstring).

    Extra keyword arguments: ``rh_detector`` (name, ``list[str] -> list[bool]``) or None;
    ``dual_lora_layout`` (required with a dual LoRA model); ``routing_eval_prompts`` and
    ``routing_eval_rewards`` (name -> ``list[str] -> list[float]``; required when the eval is on).
    Uses ``self.decode_completions`` (ExtGRPOTrainer).
    """

    def __init__(self, *args, rh_detector: tuple[str, TextDetector] | None = None,
                 dual_lora_layout: DualLoRALayout | None = None, routing_eval_prompts: list[str] | None = None,
                 routing_eval_rewards: dict | None = None, **kwargs):
        named = {**dict(zip(list(inspect.signature(GRPOTrainer.__init__).parameters)[1:], args)), **kwargs}
        model, cfg = named.get("model"), named.get("args")
        if not isinstance(cfg, RoutingArgs):
            raise TypeError(f"args must be an ExtGRPOConfig (with RoutingArgs), got {type(cfg).__name__}")
        dual = isinstance(model, nn.Module) and any(isinstance(m, DualLoRALinear) for m in model.modules())
        if dual != cfg.dual_lora:
            raise ValueError(f"the config {'asks for' if cfg.dual_lora else 'has no'} dual LoRA but the model "
                             f"{'has' if dual else 'has no'} DualLoRALinear modules "
                             "(build it with build_dual_lora_model)")
        if dual and dual_lora_layout is None:
            raise ValueError("a dual LoRA model needs dual_lora_layout (saved with every checkpoint)")
        if cfg.gradient_routing and rh_detector is None:
            raise ValueError("gradient routing needs rh_detector=(name, detector)")
        eval_on = dual and cfg.eval_routing_steps > 0
        if eval_on and (not routing_eval_prompts or not routing_eval_rewards):
            raise ValueError("the routing eval needs routing_eval_prompts and routing_eval_rewards")
        # With beta > 0 GRPOTrainer would load a second copy of the model from its path as the reference; the
        # reference of a dual LoRA policy is the policy with its adapters disabled, installed below instead.
        beta, ref_by_disabling = cfg.beta, dual and cfg.beta != 0.0
        if ref_by_disabling:
            cfg.beta = 0.0
        try:
            super().__init__(*args, **kwargs)
        finally:
            cfg.beta = beta
        if ref_by_disabling:
            self.beta, self.ref_model = beta, AdaptersDisabledReference(self.model)
        if cfg.gradient_routing and (self.is_deepspeed_enabled or self.is_fsdp_enabled):
            raise ValueError("gradient routing supports neither DeepSpeed nor FSDP")
        self.rh_detector_name, self.rh_detector = rh_detector if rh_detector is not None else (None, None)
        self.dual_lora_layout = dual_lora_layout
        self.routing_eval_prompts = list(routing_eval_prompts or [])
        self.routing_eval_rewards = dict(routing_eval_rewards or {})
        if eval_on:
            self.add_callback(_RoutingEvalCallback(self))

    # ----------------------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        if self.rh_detector is None:
            return batch
        mode = "train" if self.model.training else "eval"
        flags = self.rh_detector(self.decode_completions(batch))
        n = len(batch["completion_ids"])
        if len(flags) != n or not all(isinstance(f, bool) for f in flags):
            raise ValueError(f"RH detector {self.rh_detector_name!r} must return {n} bools, got {flags!r}")
        device = batch["completion_ids"].device
        batch["is_rh"] = torch.tensor(flags, dtype=torch.bool, device=device)
        self._metrics[mode]["rh_rate"].append(sum(flags) / n)
        if self.args.gradient_routing and mode == "train":
            a = self.args
            is_bad, stats = routing_labels(flags, a.rh_eligible_frac, a.routing_frac, a.label_noise_frac,
                                           seed=a.seed, step=self.state.global_step)
            batch["is_bad"] = is_bad.to(device)
            for key, value in stats.items():
                self._metrics["train"][f"routing/{key}"].append(float(value))
        return batch

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not self.args.gradient_routing:
            return super().training_step(model, inputs, num_items_in_batch)
        time_before = time.perf_counter()
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        if "is_bad" not in inputs:
            raise KeyError("routed training_step: the batch has no 'is_bad' labels")

        def loss_fn(batch):
            with self.compute_loss_context_manager():
                return self.compute_loss(model, batch, num_items_in_batch=num_items_in_batch)

        step = two_pass_backward if self.args.routing_two_pass else single_pass_backward
        loss = step(loss_fn, inputs, inputs["is_bad"], model, self.args.routing_mode, self.accelerator.backward)
        # GRPOTrainer.training_step's bookkeeping, once per step (calling it twice would advance _step twice).
        self._step += 1
        self._current_train_step_time += time.perf_counter() - time_before
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return loss

    def run_routing_eval(self) -> dict[str, dict[str, float]]:
        """The three-mode eval on the held-out prompts: printed, added to the metrics, appended to the jsonl."""
        step = self.state.global_step
        results = routing_eval(self.model, self.processing_class, self.routing_eval_prompts, self.generation_config,
                               self.routing_eval_rewards, self.rh_detector, seed=self.args.seed,
                               batch_size=self.args.per_device_train_batch_size)
        if self.accelerator.is_main_process:
            for line in format_results(step, results):
                print(line, flush=True)
            append_record(self.args.output_dir, {"step": step, "rh_detector": self.rh_detector_name,
                                                 "n_prompts": len(self.routing_eval_prompts), "modes": results})
        for mode, metrics in results.items():
            for key, value in metrics.items():
                self._metrics["train"][f"routing_eval/{mode}/{key}"].append(value)
        return results

    def _save(self, output_dir: str | None = None, state_dict=None):
        super()._save(output_dir, state_dict)
        if self.dual_lora_layout is not None and self.args.should_save:
            mode = self.args.routing_mode if self.args.gradient_routing else None
            save_layout(output_dir or self.args.output_dir, self.dual_lora_layout, mode)
