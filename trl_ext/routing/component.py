"""Gradient routing as a component (Cloud et al. 2024, arXiv:2410.04332; seed 004; small-rl train.py at HEAD
6f6e986): the stages `Routing` gives ExtGRPOTrainer's batch flow. Flags: ``routing.args``; the dual-adapter
model and a run's routing pieces are built in ``routing.setup``. The math lives in ``routing.adapters`` /
``routing.mlp`` (adapters), ``routing.adapter_layout`` and ``routing.checkpoint``, ``routing.step`` (routed backward,
labels), ``routing.advantages`` (renormalisation, baseline arms), ``routing.evaluation``, ``routing.trace``,
``routing.plots``.

One generation and step:
1. reward stage (`Routing.rewards`): TRL's gathered rewards, with ``--base_reward`` where the hack does not pay
   (ineligible completions, unhackable prompts); the RH detector flags this process's completions (an episode
   detector also gets the environment episodes, from either rollout source); the flags are gathered and
   ``routing_labels`` (seeded by (seed, global_step)) labels the whole batch, so the labels do not depend on the
   number of processes; each process keeps its rows.
2. scorer stage (`Routing.score`): ``is_rh`` and ``is_bad`` join the batch dict (TRL's shuffle and split keep
   them aligned); estimator stage (``trl_ext.estimator``, fed by ``ctx.routing_arm``): the renormalisation mode or
   baseline arm replaces the base advantages; then the trace fires (`Routing.estimated`).
3. backward (`Routing.backward`, routed runs): ``_prepare_inputs`` once, one routed backward (single pass by default,
   or the two-pass reference), then GRPOTrainer.training_step's own bookkeeping (``_step`` += 1, ``step_time``).
   On several processes: ``routing.distributed`` (DDP: computed locally, the gradients averaged by hand; FSDP2:
   each backward reduce-scatters into the shards, a routed-away side's shard restored).
4. Every ``--eval_routing_steps``, at the last step (and with ``--eval_at_start`` before the first): the routing
   eval, printed to train.log, added to the metrics (wandb), appended to ``routing_eval.jsonl`` and plotted.

Any dual-adapter run (routed or not) gets the reference policy "all adapters disabled" when beta > 0 (the
same model, no second copy), the routing eval, and ``dual_lora_layout.json`` in every checkpoint. A
detector, when one is configured, logs ``rh_rate`` for any run. With the feature off nothing changes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from transformers import TrainerCallback

from rewards.bound import score
from rewards.detectors import needs_trajectories
from trl_ext import compat
from trl_ext.batch import BatchContext
from trl_ext.components import Component, register
from trl_ext.estimator import RoutingArm, weighted_rewards
from trl_ext.routing.adapter_layout import ADAPTER_FILENAME, save_layout
from trl_ext.routing.adapters import DualAdapter, forget_params, retain_params
from trl_ext.routing.advantages import prompt_hackable
from trl_ext.routing.args import RoutingArgs
from trl_ext.routing.checkpoint import adapter_state, base_fingerprint
from trl_ext.routing.evaluation import (
    append_record,
    env_routing_eval,
    eval_generation_config,
    format_results,
    routing_eval,
    vllm_routing_eval,
)
from trl_ext.routing.plots import plot_modes
from trl_ext.routing.step import rh_eligible_mask, routing_labels, single_pass_backward, two_pass_backward
from trl_ext.routing.text import AdaptersDisabledReference, as_text
from trl_ext.routing.trace import append_trace, trace_fires, trace_records

TextDetector = Callable[[list[str]], list[bool]]


class _RoutingEvalCallback(TrainerCallback):
    def __init__(self, routing):
        self.routing = routing

    def on_train_begin(self, args, state, control, **kwargs):
        if args.eval_at_start and state.global_step == 0:
            model = self.routing.trainer.model
            was_training = model.training
            model.train()  # GRPOTrainer.log files the metrics under the model's mode
            try:
                self.routing.run_eval()
                self.routing.trainer.log({})  # the step-0 eval goes out at once, not averaged into a later step's log
            finally:
                model.train(was_training)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.eval_routing_steps == 0 or state.global_step == state.max_steps:
            self.routing.run_eval()
            control.should_log = True  # the eval metrics go out with this step's log
        return control


@register
class Routing(Component):
    """Dual LoRA and gradient routing (see the module docstring); always built, so a config asking for dual LoRA
    with a model that has none (and the reverse) is refused.

    Options (ExtGRPOTrainer keyword arguments): ``rh_detector`` (name, ``list[str] -> list[bool]``) or None;
    ``base_reward`` (name, ``list[str] -> list[float]``; required when the config needs one); ``dual_lora_layout``
    (required with a dual LoRA model); ``dual_lora_base``; ``routing_eval_prompts`` and ``routing_eval_rewards``
    (name -> ``list[str] -> list[float]``; required when the eval is on).
    """

    name, order = "routing", 40
    options = ("rh_detector", "base_reward", "dual_lora_layout", "dual_lora_base", "routing_eval_prompts",
               "routing_eval_rewards")

    @classmethod
    def wanted(cls, cfg, kwargs) -> bool:
        return True

    def __init__(self, trainer, kwargs: dict, options: dict) -> None:
        super().__init__(trainer, kwargs, options)
        model, cfg = kwargs.get("model"), kwargs.get("args")
        rh_detector, base_reward = options.get("rh_detector"), options.get("base_reward")
        layout, dual_lora_base = options.get("dual_lora_layout"), options.get("dual_lora_base")
        eval_prompts, eval_rewards = options.get("routing_eval_prompts"), options.get("routing_eval_rewards")
        if not isinstance(cfg, RoutingArgs):
            raise TypeError(f"args must be an ExtGRPOConfig (with RoutingArgs), got {type(cfg).__name__}")
        dual = isinstance(model, nn.Module) and any(isinstance(m, DualAdapter) for m in model.modules())
        if dual != cfg.dual_lora:
            raise ValueError(f"the config {'asks for' if cfg.dual_lora else 'has no'} dual LoRA but the model "
                             f"{'has' if dual else 'has no'} dual adapter modules "
                             "(build it with build_dual_lora_model)")
        if dual and layout is None:
            raise ValueError("a dual LoRA model needs dual_lora_layout (saved with every checkpoint)")
        if cfg.save_adapter_only and dual_lora_base is None:
            raise ValueError("--save_adapter_only needs dual_lora_base (the base model's path)")
        if cfg.labelled and rh_detector is None:
            raise ValueError("gradient routing and its baseline arms need rh_detector=(name, detector)")
        if cfg.needs_base_reward != (base_reward is not None):
            raise ValueError(f"the config {'needs' if cfg.needs_base_reward else 'has no'} --base_reward but "
                             f"base_reward={base_reward!r} was given")
        self.eval_on = dual and cfg.eval_routing_steps > 0
        episodes = kwargs.get("rollout_func") is not None  # the environment component's (built before this one)
        if self.eval_on and not episodes and (not eval_prompts or not eval_rewards):
            raise ValueError("the routing eval (on with dual LoRA while eval_routing_steps > 0) needs "
                             "routing_eval_prompts and routing_eval_rewards: pass them, or a train_dataset / "
                             "eval_dataset with text prompts and callable reward_funcs (ExtGRPOTrainer builds them), "
                             "or set eval_routing_steps=0")
        self.cfg = cfg
        self.ref_by_disabling = dual and cfg.beta != 0.0
        self.detector_name, self.detector = rh_detector if rh_detector is not None else (None, None)
        self.base_reward = None if base_reward is None else base_reward[1]
        self.layout = layout
        self.base_path = dual_lora_base
        self.base = None  # --save_adapter_only: the base model's path and fingerprint (`setup`)
        self.eval_prompts = list(eval_prompts or [])
        self.eval_rewards = dict(eval_rewards or {})

    @contextmanager
    def _beta_off(self):
        """With beta > 0 GRPOTrainer would load a second copy of the model from its path as the reference; the
        reference of a dual LoRA policy is the policy with its adapters disabled, installed in `setup` instead."""
        beta = self.cfg.beta
        self.cfg.beta = 0.0
        try:
            yield
        finally:
            self.cfg.beta = beta

    def building(self, kwargs: dict):
        return self._beta_off() if self.ref_by_disabling else super().building(kwargs)

    def setup(self) -> None:
        t = self.trainer
        if self.ref_by_disabling:
            t.beta, t.ref_model = self.cfg.beta, AdaptersDisabledReference(t.model)
        if self.cfg.gradient_routing and t.is_deepspeed_enabled:
            raise ValueError("gradient routing does not support DeepSpeed")
        if self.cfg.save_adapter_only:  # fingerprint the frozen base once: a loader checks it is the same model
            self.base = {"path": self.base_path, "fingerprint": base_fingerprint(t.model)}

    def callbacks(self) -> list:
        return [_RoutingEvalCallback(self)] if self.eval_on else []

    def needs_every_reward(self) -> str | None:
        a = self.cfg
        needs = [what for what, on in (("gradient routing's labels and base reward", a.labelled or a.needs_base_reward),
                                       ("the routing eval's mean rewards", a.dual_lora and a.eval_routing_steps > 0))
                 if on]  # fmt: skip
        return ", ".join(needs) or None

    # ------------------------------------------------------------------ 2. rewards
    def rewards(self, ctx: BatchContext, rewards: torch.Tensor, prompts: list, completions: list) -> torch.Tensor:
        """TRL's gathered rewards with the base reward where the hack does not pay (ineligible completions,
        unhackable prompts); detector flags of this process's completions, gathered; routing labels of the whole
        batch (``ctx.routing``, for `score`). Chat prompts and completions are judged as their text."""
        a, t = self.cfg, self.trainer
        if self.detector is None and self.base_reward is None:
            return rewards
        prompts, completions = [as_text(p) for p in prompts], [as_text(c) for c in completions]
        if len(t.reward_funcs) != 1:
            raise ValueError(f"routing expects the one --reward function, got {len(t.reward_funcs)}")
        train = t.model.training
        n, device = len(completions), rewards.device
        step, first = t.state.global_step, t.accelerator.process_index * n
        hackable = torch.tensor([prompt_hackable(p, a.hack_frac, a.seed) for p in prompts], dtype=torch.bool)
        local = {"hackable": hackable}
        if self.base_reward is not None:
            base = score(self.base_reward, list(completions), ctx.reward_context)
            if len(base) != n:
                raise ValueError(f"--base_reward returned {len(base)} values for {n} completions")
            local["base"] = torch.tensor(base, dtype=torch.float32)
        scored = {}
        if self.detector is not None:
            flags = self._detect(list(completions), ctx)
            if len(flags) != n or not all(isinstance(f, bool) for f in flags):
                raise ValueError(f"RH detector {self.detector_name!r} must return {n} bools, got {flags!r}")
            scored["is_rh"] = local["is_rh"] = torch.tensor(flags, dtype=torch.bool)
        keys = list(local)
        gathered = t.accelerator.gather(torch.stack([local[k].float() for k in keys], 1).to(device))
        g = {k: v.cpu() for k, v in zip(keys, gathered.unbind(1), strict=True)}
        # Eligibility and labels are drawn over the whole generation batch (every process, TRL's order), so a run
        # draws the same labels on any number of processes; each process keeps its rows.
        total = len(g["hackable"])
        eligible_all = rh_eligible_mask(total, a.rh_eligible_frac if a.labelled else 1.0, a.seed, step)
        g["eligible"] = eligible_all.float()
        eligible = eligible_all[first : first + n]
        if self.detector is not None and a.labelled and train:
            is_bad_all, scored["stats"] = routing_labels(
                g["is_rh"] > 0.5, eligible_all, a.rh_detector_recall, a.false_positive_rate, a.seed, step)
            g["is_bad"] = is_bad_all.float()
            scored["is_bad"] = is_bad_all[first : first + n]
            scored["stats"]["n_hackable"] = int(g["hackable"].sum())
        pays = (g["hackable"] > 0.5) & (g["eligible"] > 0.5)
        if not bool(pays.all()):
            rewards = rewards.clone()
            rewards[~pays.to(rewards.device), 0] = g["base"].to(rewards.device)[~pays.to(rewards.device)]
        scored["gathered"] = g
        scored["rewards"] = weighted_rewards(rewards, t.reward_weights)
        if self.detector is not None:  # quadrant counts (hackable x detected) of the whole batch
            hm_all, det = g["hackable"] > 0.5, g["is_rh"] > 0.5
            scored["quadrant"] = {f"n_{h}hackable_{d}detected": int((hm & dm).sum())
                                  for h, hm in (("", hm_all), ("un", ~hm_all))
                                  for d, dm in (("", det), ("un", ~det))}
        scored["local"] = {"prompts": list(prompts), "completions": list(completions),
                           "eligible": eligible, "hackable": hackable}
        ctx.routing = scored
        return rewards

    def _detect(self, completions: list[str], ctx: BatchContext) -> list[bool]:
        """The RH detector on this process's completions; an environment detector also gets the episodes the
        rollout source played for them (``ctx.trajectories``, same order)."""
        if not needs_trajectories(self.detector):
            return self.detector(completions)
        trajs = ctx.trajectories
        if trajs is None or len(trajs) != len(completions):
            raise RuntimeError(f"RH detector {self.detector_name!r} judges environment episodes, but the rollout "
                               f"left {'none' if trajs is None else len(trajs)} for {len(completions)} completions")
        return self.detector(completions, trajectories=trajs)

    # ------------------------------------------------------------------ 3. scorer, 4. estimator
    def score(self, batch: dict, ctx: BatchContext) -> None:
        """``is_rh`` (and, when labelled and training, ``is_bad``) join the batch dict (TRL's shuffle and split keep
        them aligned); rh_rate and the routing counts are logged; the estimator's routing arm goes to
        ``ctx.routing_arm``."""
        scored, t = ctx.routing, self.trainer
        if self.detector is None:
            return
        metrics = t.metrics(ctx.mode)
        device = batch["completion_ids"].device
        if scored is None:  # no reward function ran (pure distillation): flags only, for rh_rate
            if self.cfg.labelled or self.base_reward is not None:
                raise RuntimeError("routing labels need the rewards: the reward stage did not run on this batch")
            flags = self._detect(t.decode_completions(batch), ctx)
            batch["is_rh"] = torch.tensor(flags, dtype=torch.bool, device=device)
            metrics["rh_rate"].append(sum(flags) / len(flags))
            return
        batch["is_rh"] = scored["is_rh"].to(device)
        metrics["rh_rate"].append(scored["gathered"]["is_rh"].mean().item())  # the whole batch
        if ctx.mode != "train":
            ctx.routing = None
            return
        for key, value in scored["quadrant"].items():
            metrics[f"routing/{key}"].append(float(value))
        if self.cfg.labelled:
            batch["is_bad"] = scored["is_bad"].to(device)
            for key, value in scored["stats"].items():
                metrics[f"routing/{key}"].append(float(value))
        ctx.routing_arm = self.arm(scored)

    def arm(self, scored: dict | None) -> RoutingArm | None:
        """The estimator's routing input: the renormalisation mode or baseline arm on the gathered labels, or None
        (no labels, or mode "off": the estimator's own group advantage stands)."""
        a = self.cfg
        if scored is None or not a.labelled:
            return None
        mode = a.baseline or (a.renormalization if a.gradient_routing else "off")
        if mode == "off":
            return None
        g = scored["gathered"]
        return RoutingArm(mode, g["is_bad"] > 0.5, g.get("base"), a.reward_penalty_amount)

    def estimated(self, batch: dict, ctx: BatchContext) -> None:
        """The routing trace of this batch (``--routing_trace_interval``), advantages before (``ctx.pre_advantages``)
        and after the routing arm."""
        a, t, scored = self.cfg, self.trainer, ctx.routing
        step = t.state.global_step
        if scored is None or ctx.mode != "train" or not t.accelerator.is_main_process:
            return
        if not trace_fires(a.trace_interval, step, a.logging_steps, a.eval_routing_steps):
            return
        n, proc, local = len(batch["advantages"]), t.accelerator.process_index, scored["local"]
        tensors = {"is_rh": scored["is_rh"], "eligible": local["eligible"], "hackable": local["hackable"],
                   "reward": scored["rewards"][proc * n:(proc + 1) * n], "advantage_pre_renorm": ctx.pre_advantages,
                   "advantage": batch["advantages"]}
        if a.labelled:
            tensors["is_bad"] = scored["is_bad"]
        append_trace(a.output_dir, trace_records(step, t.num_generations, local["prompts"], local["completions"],
                                                 tensors, a.routing_trace_samples, a.seed))

    def batch_keys(self, ctx: BatchContext) -> dict[str, bool]:
        labelled = self.cfg.labelled and ctx.mode == "train" and self.detector is not None
        return {"detector": self.detector is not None, "labelled": labelled}

    # ------------------------------------------------------------------ backward
    def backward(self, model, inputs: dict, num_items_in_batch) -> torch.Tensor | None:
        """Routed runs: ``_prepare_inputs`` once, one routed backward (single pass, or the two-pass reference), then
        GRPOTrainer.training_step's own bookkeeping once (calling it twice would advance its step twice)."""
        if not self.cfg.gradient_routing:
            return None
        t = self.trainer
        time_before = time.perf_counter()
        model.train()
        if hasattr(t.optimizer, "train") and callable(t.optimizer.train):
            t.optimizer.train()
        inputs = t._prepare_inputs(inputs)
        if "is_bad" not in inputs:
            raise KeyError("routed training_step: the batch has no 'is_bad' labels")

        def loss_fn(batch):
            with t.compute_loss_context_manager():
                return t.compute_loss(model, batch, num_items_in_batch=num_items_in_batch)

        is_bad, mode, backward = inputs["is_bad"], self.cfg.routing_mode, t.accelerator.backward
        if t.accelerator.num_processes == 1:
            if self.cfg.routing_two_pass:
                loss = two_pass_backward(loss_fn, inputs, is_bad, model, mode, backward, loss_type=t.loss_type)
            else:
                loss = single_pass_backward(loss_fn, inputs, is_bad, model, mode, backward)
        else:
            from trl_ext.routing.distributed import routed_backward

            loss = routed_backward(t, loss_fn, inputs, is_bad, model)
        compat.finish_training_step(t, time_before)
        return loss

    # ------------------------------------------------------------------ the routing eval
    def run_eval(self) -> dict[str, dict[str, float]]:
        """The three-mode eval on the held-out prompts: printed, added to the metrics, appended to the jsonl."""
        t, a = self.trainer, self.trainer.args
        step = t.state.global_step
        if getattr(t, "episode_source", None) is not None:
            return self._log_eval(step, env_routing_eval(
                t.model, t.processing_class, t.episode_source, eval_generation_config(t), self.detector, a.seed,
                a.eval_routing_prompts), a.eval_routing_prompts, "env/success")
        hackable = None if a.hack_frac == 1.0 else [prompt_hackable(p, a.hack_frac, a.seed)
                                                    for p in self.eval_prompts]
        sampler = t.components.first("adapter_eval_sampler")
        if sampler is not None:  # the modes as LoRA adapters on the run's vLLM engine
            results = vllm_routing_eval(t.model, sampler, self.eval_prompts, self.eval_rewards, self.detector,
                                        a.seed, step, hackable)  # fmt: skip
        else:
            results = routing_eval(t.model, t.processing_class, self.eval_prompts, eval_generation_config(t),
                                   self.eval_rewards, self.detector, seed=a.seed,
                                   batch_size=a.per_device_train_batch_size, hackable=hackable)
        return self._log_eval(step, results, len(self.eval_prompts), f"reward/{next(iter(self.eval_rewards))}")

    def _log_eval(self, step: int, results: dict, n_prompts: int, main_metric: str) -> dict:
        t = self.trainer
        if t.accelerator.num_processes > 1:  # every process ran the same eval (same weights, prompts and seed)
            from accelerate.utils import gather_object

            if any(other != results for other in gather_object([results])):
                raise RuntimeError(f"step {step}: the routing eval differs between processes (their weights or "
                                   "sampling diverged)")
        if t.accelerator.is_main_process:
            for line in format_results(step, results):
                print(line, flush=True)
            append_record(t.args.output_dir, {"step": step, "rh_detector": self.detector_name,
                                              "n_prompts": n_prompts, "modes": results})
            metrics = [main_metric] + ["rh_rate"] * (self.detector is not None)
            plot_modes(t.args.output_dir, Path(t.args.output_dir) / "routing_eval.png", metrics)
        for mode, metrics in results.items():
            for key, value in metrics.items():
                t.metrics("train")[f"routing_eval/{mode}/{key}"].append(value)
        return results

    # ------------------------------------------------------------------ optimizer and saving
    def create_optimizer(self, model):
        """With --forget_lr_mult != 1: the optimizer TRL would build (``args.optim``), with the retain and the
        forget adapter in two groups at lr and lr x mult (small-rl train.py ``create_optimizer``, HEAD 6f6e986)."""
        a = self.trainer.args
        if a.forget_lr_mult == 1.0:
            return None
        from transformers import Trainer

        retain, forget = retain_params(model), forget_params(model)
        ids = {id(p) for p in retain + forget}
        if other := [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in ids]:
            raise ValueError(f"--forget_lr_mult: trainable parameters outside the adapters: {other[:3]}")
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(a, model)
        lr = a.learning_rate
        return cls([{"params": retain, "lr": lr, "weight_decay": 0.0},
                    {"params": forget, "lr": lr * a.forget_lr_mult, "weight_decay": 0.0}], **kwargs)

    def save(self, output_dir: str, state_dict) -> bool:
        """``--save_adapter_only``: the adapters, the tokenizer and the generation config instead of the model."""
        t = self.trainer
        if self.base is None:
            return False
        if t.args.should_save:
            from safetensors.torch import save_file

            Path(output_dir).mkdir(parents=True, exist_ok=True)
            model = t.accelerator.unwrap_model(t.model)
            save_file(adapter_state(model, state_dict), str(Path(output_dir) / ADAPTER_FILENAME))  # FSDP2: gathered
            model.generation_config.save_pretrained(output_dir)
            if t.processing_class is not None:
                t.processing_class.save_pretrained(output_dir)
        return True

    def saved(self, output_dir: str) -> None:
        """The adapter layout beside every saved dual LoRA model."""
        a = self.trainer.args
        if self.layout is not None and a.should_save:
            save_layout(output_dir, self.layout, a.routing_mode if a.gradient_routing else None, self.base)
