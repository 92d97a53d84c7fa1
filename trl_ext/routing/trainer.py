"""Gradient routing in the trainer (Cloud et al. 2024, arXiv:2410.04332; seed 004; small-rl train.py at HEAD
6f6e986): the stages `RoutingMixin` gives ExtGRPOTrainer's batch flow. Flags: ``routing.args``; the dual-adapter
model and a run's routing pieces are built in ``routing.setup``. The math lives in ``routing.adapters`` /
``routing.mlp`` (adapters), ``routing.layout`` and ``routing.checkpoint``, ``routing.step`` (routed backward, labels),
``routing.advantages`` (renormalisation, baseline arms), ``routing.evaluation``, ``routing.trace``,
``routing.plots``.

One generation and step:
1. reward stage (`routing_rewards`): TRL's gathered rewards, with ``--base_reward`` where the hack does not pay
   (ineligible completions, unhackable prompts); the RH detector flags this process's completions (an episode
   detector also gets the environment episodes, from either rollout source); the flags are gathered and
   ``routing_labels`` (seeded by (seed, global_step)) labels the whole batch, so the labels do not depend on the
   number of processes; each process keeps its rows.
2. scorer stage (`routing_labels_stage`): ``is_rh`` and ``is_bad`` join the batch dict (TRL's shuffle and split keep
   them aligned); estimator stage (``trl_ext.estimator``, fed by `routing_arm`): the renormalisation mode or
   baseline arm replaces the base advantages; then the trace fires (`routing_trace_stage`).
3. backward (`training_step`, routed runs): ``_prepare_inputs`` once, one routed backward (single pass by default,
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

import inspect
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from transformers import TrainerCallback
from trl import GRPOTrainer

from rewards.bound import score
from rewards.detectors import needs_trajectories
from trl_ext.estimator import RoutingArm, weighted_rewards
from trl_ext.routing.adapters import DualAdapter, adapters_disabled, forget_params, retain_params
from trl_ext.routing.advantages import prompt_hackable
from trl_ext.routing.args import RoutingArgs
from trl_ext.routing.checkpoint import adapter_state, base_fingerprint
from trl_ext.routing.evaluation import (
    append_record,
    env_routing_eval,
    eval_generation_config,
    format_results,
    routing_eval,
)
from trl_ext.routing.layout import ADAPTER_FILENAME, DualLoRALayout, save_layout
from trl_ext.routing.plots import plot_modes
from trl_ext.routing.step import rh_eligible_mask, routing_labels, single_pass_backward, two_pass_backward
from trl_ext.routing.trace import append_trace, trace_fires, trace_records

TextDetector = Callable[[list[str]], list[bool]]


def _message_text(m: dict) -> str:
    """A message's content, then its tool calls (TRL's tool loop) as ``call NAME({"arg": ...})``."""
    calls = [f"call {c['function']['name']}({json.dumps(c['function']['arguments'])})"
             for c in m.get("tool_calls") or []]
    return " ".join(part for part in (m.get("content") or "", *calls) if part)


def as_text(x) -> str:
    """A prompt or completion as text: plain text as is; chat messages (TRL's conversational format) as their
    contents, each after its role (``"system: ...\nuser: ..."``; a completion's one assistant message: its
    content), tool calls written ``call NAME(JSON arguments)`` (`_message_text`), so detectors, base rewards and
    the per-prompt hackability draw see text either way."""
    if isinstance(x, str):
        return x
    if len(x) == 1 and x[0].get("role") == "assistant":
        return _message_text(x[0])
    return "\n".join(f"{m['role']}: {_message_text(m)}" for m in x)


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

    def on_train_begin(self, args, state, control, **kwargs):
        if args.eval_at_start and state.global_step == 0:
            model = self.trainer.model
            was_training = model.training
            model.train()  # GRPOTrainer.log files the metrics under the model's mode
            try:
                self.trainer.run_routing_eval()
                self.trainer.log({})  # the step-0 eval goes out at once, not averaged into a later step's log
            finally:
                model.train(was_training)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.eval_routing_steps == 0 or state.global_step == state.max_steps:
            self.trainer.run_routing_eval()
            control.should_log = True  # the eval metrics go out with this step's log
        return control


class RoutingMixin:
    """GRPOTrainer hooks for dual LoRA and gradient routing (see the module docstring).

    Extra keyword arguments: ``rh_detector`` (name, ``list[str] -> list[bool]``) or None; ``base_reward``
    (name, ``list[str] -> list[float]``; required when the config needs one);
    ``dual_lora_layout`` (required with a dual LoRA model); ``routing_eval_prompts`` and
    ``routing_eval_rewards`` (name -> ``list[str] -> list[float]``; required when the eval is on).
    Uses ``self.decode_completions`` (ExtGRPOTrainer).
    """

    def __init__(self, *args, rh_detector: tuple[str, TextDetector] | None = None,
                 base_reward: tuple[str, Callable[[list[str]], list[float]]] | None = None,
                 dual_lora_layout: DualLoRALayout | None = None, dual_lora_base: str | None = None,
                 routing_eval_prompts: list[str] | None = None,
                 routing_eval_rewards: dict | None = None, **kwargs):
        named = {**dict(zip(list(inspect.signature(GRPOTrainer.__init__).parameters)[1:], args)), **kwargs}
        model, cfg = named.get("model"), named.get("args")
        if not isinstance(cfg, RoutingArgs):
            raise TypeError(f"args must be an ExtGRPOConfig (with RoutingArgs), got {type(cfg).__name__}")
        dual = isinstance(model, nn.Module) and any(isinstance(m, DualAdapter) for m in model.modules())
        if dual != cfg.dual_lora:
            raise ValueError(f"the config {'asks for' if cfg.dual_lora else 'has no'} dual LoRA but the model "
                             f"{'has' if dual else 'has no'} dual adapter modules "
                             "(build it with build_dual_lora_model)")
        if dual and dual_lora_layout is None:
            raise ValueError("a dual LoRA model needs dual_lora_layout (saved with every checkpoint)")
        if cfg.save_adapter_only and dual_lora_base is None:
            raise ValueError("--save_adapter_only needs dual_lora_base (the base model's path)")
        if cfg.labelled and rh_detector is None:
            raise ValueError("gradient routing and its baseline arms need rh_detector=(name, detector)")
        if cfg.needs_base_reward != (base_reward is not None):
            raise ValueError(f"the config {'needs' if cfg.needs_base_reward else 'has no'} --base_reward but "
                             f"base_reward={base_reward!r} was given")
        eval_on = dual and cfg.eval_routing_steps > 0
        if eval_on and not cfg.env and (not routing_eval_prompts or not routing_eval_rewards):
            raise ValueError("the routing eval (on with dual LoRA while eval_routing_steps > 0) needs "
                             "routing_eval_prompts and routing_eval_rewards: pass them, or a train_dataset / "
                             "eval_dataset with text prompts and callable reward_funcs (ExtGRPOTrainer builds them), "
                             "or set eval_routing_steps=0")
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
        if cfg.gradient_routing and self.is_deepspeed_enabled:
            raise ValueError("gradient routing does not support DeepSpeed")
        self.rh_detector_name, self.rh_detector = rh_detector if rh_detector is not None else (None, None)
        self.base_reward = None if base_reward is None else base_reward[1]
        self._routing_scored = None  # what _calculate_rewards found, for this generation's batch
        self.dual_lora_layout = dual_lora_layout
        self.dual_lora_base = None
        if cfg.save_adapter_only:  # fingerprint the frozen base once: a loader checks it is the same model
            self.dual_lora_base = {"path": dual_lora_base, "fingerprint": base_fingerprint(self.model)}
        self.routing_eval_prompts = list(routing_eval_prompts or [])
        self.routing_eval_rewards = dict(routing_eval_rewards or {})
        if eval_on:
            self.add_callback(_RoutingEvalCallback(self))

    # ----------------------------------------------------------------------------------------
    def routing_rewards(self, rewards: torch.Tensor, prompts: list, completions: list) -> torch.Tensor:
        """Reward stage: TRL's gathered rewards with the base reward where the hack does not pay (ineligible
        completions, unhackable prompts); detector flags of this process's completions, gathered; routing labels of
        the whole batch (kept for `routing_labels_stage`). Chat prompts and completions are judged as their text."""
        self._routing_scored = None
        a = self.args
        if self.rh_detector is None and self.base_reward is None:
            return rewards
        prompts, completions = [as_text(p) for p in prompts], [as_text(c) for c in completions]
        if len(self.reward_funcs) != 1:
            raise ValueError(f"routing expects the one --reward function, got {len(self.reward_funcs)}")
        train = self.model.training
        n, device = len(completions), rewards.device
        step, first = self.state.global_step, self.accelerator.process_index * n
        hackable = torch.tensor([prompt_hackable(p, a.hack_frac, a.seed) for p in prompts], dtype=torch.bool)
        local = {"hackable": hackable}
        if self.base_reward is not None:
            base = score(self.base_reward, list(completions), getattr(self, "reward_context", None))
            if len(base) != n:
                raise ValueError(f"--base_reward returned {len(base)} values for {n} completions")
            local["base"] = torch.tensor(base, dtype=torch.float32)
        scored = {}
        if self.rh_detector is not None:
            flags = self._detect(list(completions))
            if len(flags) != n or not all(isinstance(f, bool) for f in flags):
                raise ValueError(f"RH detector {self.rh_detector_name!r} must return {n} bools, got {flags!r}")
            scored["is_rh"] = local["is_rh"] = torch.tensor(flags, dtype=torch.bool)
        keys = list(local)
        gathered = self.accelerator.gather(torch.stack([local[k].float() for k in keys], 1).to(device))
        g = {k: v.cpu() for k, v in zip(keys, gathered.unbind(1), strict=True)}
        # Eligibility and labels are drawn over the whole generation batch (every process, TRL's order), so a run
        # draws the same labels on any number of processes; each process keeps its rows.
        total = len(g["hackable"])
        eligible_all = rh_eligible_mask(total, a.rh_eligible_frac if a.labelled else 1.0, a.seed, step)
        g["eligible"] = eligible_all.float()
        eligible = eligible_all[first : first + n]
        if self.rh_detector is not None and a.labelled and train:
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
        scored["rewards"] = weighted_rewards(rewards, self.reward_weights)
        if self.rh_detector is not None:  # quadrant counts (hackable x detected) of the whole batch
            hm_all, det = g["hackable"] > 0.5, g["is_rh"] > 0.5
            scored["quadrant"] = {f"n_{h}hackable_{d}detected": int((hm & dm).sum())
                                  for h, hm in (("", hm_all), ("un", ~hm_all))
                                  for d, dm in (("", det), ("un", ~det))}
        scored["local"] = {"prompts": list(prompts), "completions": list(completions),
                           "eligible": eligible, "hackable": hackable}
        self._routing_scored = scored
        return rewards

    def _detect(self, completions: list[str]) -> list[bool]:
        """The RH detector on this process's completions; an environment detector also gets the episodes that
        ``env.trainer.env_rollout`` played for them (``_env_trajectories``, same order)."""
        if not needs_trajectories(self.rh_detector):
            return self.rh_detector(completions)
        trajs, self._env_trajectories = getattr(self, "_env_trajectories", None), None
        if trajs is None or len(trajs) != len(completions):
            raise RuntimeError(f"RH detector {self.rh_detector_name!r} judges environment episodes, but the rollout "
                               f"left {'none' if trajs is None else len(trajs)} for {len(completions)} completions")
        return self.rh_detector(completions, trajectories=trajs)

    def routing_labels_stage(self, batch: dict) -> dict | None:
        """Scorer stage: ``is_rh`` (and, when labelled and training, ``is_bad``) join the batch dict (TRL's shuffle
        and split keep them aligned); rh_rate and the routing counts are logged. Returns what `routing_rewards`
        found (the estimator's routing inputs, `routing_arm`), or None."""
        scored, self._routing_scored = self._routing_scored, None
        if self.rh_detector is None:
            return None
        mode = "train" if self.model.training else "eval"
        device = batch["completion_ids"].device
        if scored is None:  # no reward function ran (pure distillation): flags only, for rh_rate
            if self.args.labelled or self.base_reward is not None:
                raise RuntimeError("routing labels need the rewards: _calculate_rewards did not run on this batch")
            flags = self._detect(self.decode_completions(batch))
            batch["is_rh"] = torch.tensor(flags, dtype=torch.bool, device=device)
            self._metrics[mode]["rh_rate"].append(sum(flags) / len(flags))
            return None
        batch["is_rh"] = scored["is_rh"].to(device)
        self._metrics[mode]["rh_rate"].append(scored["gathered"]["is_rh"].mean().item())  # the whole batch
        if mode != "train":
            return None
        for key, value in scored["quadrant"].items():
            self._metrics["train"][f"routing/{key}"].append(float(value))
        if self.args.labelled:
            batch["is_bad"] = scored["is_bad"].to(device)
            for key, value in scored["stats"].items():
                self._metrics["train"][f"routing/{key}"].append(float(value))
        return scored

    def routing_arm(self, scored: dict | None) -> RoutingArm | None:
        """The estimator's routing input: the renormalisation mode or baseline arm on the gathered labels, or None
        (no labels, or mode "off": the estimator's own group advantage stands)."""
        a = self.args
        if scored is None or not a.labelled:
            return None
        mode = a.baseline or (a.renormalization if a.gradient_routing else "off")
        if mode == "off":
            return None
        g = scored["gathered"]
        return RoutingArm(mode, g["is_bad"] > 0.5, g.get("base"), a.reward_penalty_amount)

    def routing_trace_stage(self, batch: dict, scored: dict | None, pre: torch.Tensor) -> None:
        """After the estimator: the routing trace of this batch (``--routing_trace_interval``), advantages before
        (``pre``) and after the routing arm."""
        a, step = self.args, self.state.global_step
        if scored is None or not self.accelerator.is_main_process:
            return
        if not trace_fires(a.trace_interval, step, a.logging_steps, a.eval_routing_steps):
            return
        n, proc, local = len(batch["advantages"]), self.accelerator.process_index, scored["local"]
        tensors = {"is_rh": scored["is_rh"], "eligible": local["eligible"], "hackable": local["hackable"],
                   "reward": scored["rewards"][proc * n:(proc + 1) * n], "advantage_pre_renorm": pre,
                   "advantage": batch["advantages"]}
        if a.labelled:
            tensors["is_bad"] = scored["is_bad"]
        append_trace(a.output_dir, trace_records(step, self.num_generations, local["prompts"], local["completions"],
                                                 tensors, a.routing_trace_samples, a.seed))

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

        is_bad, mode, backward = inputs["is_bad"], self.args.routing_mode, self.accelerator.backward
        if self.accelerator.num_processes == 1:
            if self.args.routing_two_pass:
                loss = two_pass_backward(loss_fn, inputs, is_bad, model, mode, backward, loss_type=self.loss_type)
            else:
                loss = single_pass_backward(loss_fn, inputs, is_bad, model, mode, backward)
        else:
            from trl_ext.routing.distributed import routed_backward

            loss = routed_backward(self, loss_fn, inputs, is_bad, model)
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
        a = self.args
        if a.env:
            return self._log_routing_eval(step, env_routing_eval(
                self.model, self.processing_class, a, eval_generation_config(self), self.rh_detector, a.seed,
                a.eval_routing_prompts), a.eval_routing_prompts, "env/success")
        hackable = None if a.hack_frac == 1.0 else [prompt_hackable(p, a.hack_frac, a.seed)
                                                    for p in self.routing_eval_prompts]
        results = routing_eval(self.model, self.processing_class, self.routing_eval_prompts, eval_generation_config(self),
                               self.routing_eval_rewards, self.rh_detector, seed=a.seed,
                               batch_size=a.per_device_train_batch_size, hackable=hackable)
        return self._log_routing_eval(step, results, len(self.routing_eval_prompts),
                                      f"reward/{next(iter(self.routing_eval_rewards))}")

    def _log_routing_eval(self, step: int, results: dict, n_prompts: int, main_metric: str) -> dict:
        if self.accelerator.num_processes > 1:  # every process ran the same eval (same weights, prompts and seed)
            from accelerate.utils import gather_object

            if any(other != results for other in gather_object([results])):
                raise RuntimeError(f"step {step}: the routing eval differs between processes (their weights or "
                                   "sampling diverged)")
        if self.accelerator.is_main_process:
            for line in format_results(step, results):
                print(line, flush=True)
            append_record(self.args.output_dir, {"step": step, "rh_detector": self.rh_detector_name,
                                                 "n_prompts": n_prompts, "modes": results})
            metrics = [main_metric] + ["rh_rate"] * (self.rh_detector is not None)
            plot_modes(self.args.output_dir, Path(self.args.output_dir) / "routing_eval.png", metrics)
        for mode, metrics in results.items():
            for key, value in metrics.items():
                self._metrics["train"][f"routing_eval/{mode}/{key}"].append(value)
        return results

    def create_optimizer(self):
        """With --forget_lr_mult != 1: the optimizer TRL would build (``args.optim``), with the retain and the
        forget adapter in two groups at lr and lr x mult (small-rl train.py ``create_optimizer``, HEAD 6f6e986)."""
        if self.optimizer is None and self.args.forget_lr_mult != 1.0:
            from transformers import Trainer

            model = self.accelerator.unwrap_model(self.model)
            retain, forget = retain_params(model), forget_params(model)
            ids = {id(p) for p in retain + forget}
            if other := [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in ids]:
                raise ValueError(f"--forget_lr_mult: trainable parameters outside the adapters: {other[:3]}")
            cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(self.args, model)
            lr = self.args.learning_rate
            self.optimizer = cls([{"params": retain, "lr": lr, "weight_decay": 0.0},
                                  {"params": forget, "lr": lr * self.args.forget_lr_mult, "weight_decay": 0.0}],
                                 **kwargs)
        return super().create_optimizer()

    def _save(self, output_dir: str | None = None, state_dict=None):
        out = output_dir or self.args.output_dir
        if self.dual_lora_base is None:
            super()._save(output_dir, state_dict)
        elif self.args.should_save:  # adapter-only: the adapters, the tokenizer and the generation config
            from safetensors.torch import save_file

            Path(out).mkdir(parents=True, exist_ok=True)
            model = self.accelerator.unwrap_model(self.model)
            save_file(adapter_state(model, state_dict), str(Path(out) / ADAPTER_FILENAME))  # FSDP2: the gathered dict
            model.generation_config.save_pretrained(out)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(out)
        if self.dual_lora_layout is not None and self.args.should_save:
            mode = self.args.routing_mode if self.args.gradient_routing else None
            save_layout(out, self.dual_lora_layout, mode, self.dual_lora_base)
