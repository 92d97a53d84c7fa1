"""`ExtGRPOTrainer`: TRL's GRPOTrainer with the project's features as components (``trl_ext/components.py``).

Plumbing only: this class keeps the one override of each TRL hook it changes, and each override calls that stage of
every component of the run, in order (the math lives in the feature subpackages). One generation batch
(`_generate_and_score_completions`), in this order; ``trl_ext/batch.py`` is the schema of the batch dict every stage
reads and extends, `trl_ext.components.BatchContext` what the stages hand each other beside it:

1. **rollout source** (`_prepare_inputs`, `_generate`, `_generate_single_turn`): TRL's generation, the fast sampler
   (``generation``), the environment loop (``env``: TRL's ``rollout_func``), vLLM (``vllm``) or the asynchronous
   generator thread (``offpolicy``), all into TRL's own batch building;
2. **rewards** (`_calculate_rewards`, called by TRL within 1): the reward functions (none under pure distillation),
   checked finite (`runs.faults`), each component's `rewards` stage (routing's base reward and detector flags), then
   `rewards_done` (distillation keeps the task reward);
3. **scorers** (`Component.score`): policy versions (off-policy), routing labels ``is_rh`` / ``is_bad``, teacher and
   student log-probs (distillation);
4. **estimator** (`trl_ext.estimator`): the one decision on the advantages (TRL's, ``--adv_estimator``,
   distillation's, then a routing arm), then `Component.estimated` (routing's trace);
5. **records**: ``--eval_rewards``, the zero-signal monitor, then `Component.record` (saved rollouts, token
   records), then the schema check.

Then per micro-batch: **loss** (`_compute_loss`): a component's loss (off-policy importance sampling) or TRL's,
inside every component's `around_loss` (distillation's token bonus, fed by `loss_logps` right after the loss's own
log-prob forward); **backward** (`training_step`): a component's (routing's routed backward) or TRL's; numeric faults
and checkpoints around it (`runs.lifecycle.RunLifecycle`).

Other hooks: `_tokenize_prompts` (plain-text prompts without special tokens: SimpleStories' tokenizer would append
[EOS]) and `log` (``[Sample @ step N] prompt ||| completion`` every logging step).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
from tqdm.auto import tqdm
from trl import GRPOTrainer
from trl.data_utils import is_conversational

from rewards.bound import score, trl_context
from trl_ext import compat
from trl_ext import components as comp
from trl_ext.batch import BatchContext, BatchFeatures, check_batch, check_context
from trl_ext.estimator import estimate_advantages, local_slice, weighted_rewards
from trl_ext.monitor import ZeroSignalMonitor
from trl_ext.runs.faults import NumericFault, check_rewards, guard_reward
from trl_ext.runs.lifecycle import RunLifecycle

TextReward = Callable[[list[str]], list[float]]


class ExtGRPOTrainer(RunLifecycle, GRPOTrainer):
    components = comp.Components([])  # a trainer built without __init__ (mocks, TRL's tests) has none
    batch_context: BatchContext | None = None
    _loss_inputs: dict | None = None

    def __init__(self, *args, eval_reward_funcs: dict[str, TextReward] | None = None,
                 reward_names: list[str] | None = None, **kwargs):
        """GRPOTrainer's arguments, the components' keyword arguments (routing: ``rh_detector``, ...; each
        component's `options`), ``eval_reward_funcs`` (name -> reward, logged, not optimised; a
        ``rewards.bound.BoundReward`` that reads more than texts gets the batch's TRL reward arguments) and
        ``reward_names`` (the names logged for ``reward_funcs``, instead of TRL's). Python-API conveniences
        (``trl_ext.api``): a builtin model name or path as ``model``, the tokenizer prepared, dual adapters built."""
        from trl_ext.api import trainer_arguments

        named = trainer_arguments(args, kwargs)
        self.batch_context = None
        """The generation batch's context while its stages run (`trl_ext.batch.BatchContext`)."""
        self._loss_inputs = None  # the micro-batch whose loss forward is next (`loss_logps`)
        self._loss_logps: torch.Tensor | None = None
        self.components = comp.build(self, named["args"], named)
        with ExitStack() as stack:
            for c in self.components:
                stack.enter_context(c.building(named))
            super().__init__(**named)
        if reward_names is not None:  # config binding names (TRL names a reward model by its checkpoint directory)
            if len(reward_names) != len(self.reward_func_names):
                raise ValueError(f"{len(reward_names)} reward_names for {len(self.reward_func_names)} reward functions")
            self.reward_func_names = list(reward_names)
        # A computed NaN / inf is caught at its source (None stays TRL's "not applicable"; `runs.faults`) and raised
        # after the gather (`check_reward_faults`)
        self._reward_faults: list[str] = []
        self.reward_funcs = [f if isinstance(f, torch.nn.Module) else guard_reward(f, name, self._reward_faults)
                             for f, name in zip(self.reward_funcs, self.reward_func_names, strict=True)]  # fmt: skip
        self.eval_reward_funcs = dict(eval_reward_funcs or {})
        self.zero_signal = ZeroSignalMonitor(self.args.zero_signal_patience)
        self._estimator_source = None  # the estimator stage's source of the last training batch (printed on change)
        for c in self.components:
            c.setup()
            for callback in c.callbacks():
                self.add_callback(callback)

    def checkpoint_state(self) -> dict:
        states = {c.name: s for c in self.components if (s := c.state())}
        return {"zero_signal": self.zero_signal.state(), **({"components": states} if states else {})}

    def load_checkpoint_state(self, state: dict) -> None:
        if "zero_signal" in state:
            self.zero_signal.load_state(state["zero_signal"])
        for c in self.components:
            if c.name in state.get("components", {}):
                c.load_state(state["components"][c.name])

    def metrics(self, mode: str | None = None) -> dict[str, list]:
        """TRL's metric lists of ``mode`` (default: the model's mode), which its ``log`` averages."""
        return compat.trl_metrics(self, mode)

    # ---------------------------------------------------------------------------------------- lifecycle
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        self.restore_run_state(resume_from_checkpoint)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            for c in reversed(list(self.components)):
                c.close()

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = self.components.first("create_optimizer", self.accelerator.unwrap_model(self.model))
        return super().create_optimizer(model)

    def _save(self, output_dir: str | None = None, state_dict=None):
        out = output_dir or self.args.output_dir
        if not any(c.save(out, state_dict) for c in self.components):
            super()._save(output_dir, state_dict)
        for c in self.components:
            c.saved(out)

    # ---------------------------------------------------------------------------------------- 1. rollout source
    def _prepare_inputs(self, generation_batch):
        if self.model.training and compat.new_generation_batch_due(self):
            rows = self.components.first("generation_rows", generation_batch)
            if rows is not None:
                compat.reset_buffered_inputs(self)  # TRL builds the batch from these rows
                generation_batch = rows
        return super()._prepare_inputs(generation_batch)

    def _generate(self, prompts):
        own = self.components.first("generate", prompts, self.batch_context)
        if own is None:
            return super()._generate(prompts)
        saved, self.rollout_func = self.rollout_func, lambda _prompts, _trainer: own  # TRL's hook for completions
        try:  # made elsewhere
            return super()._generate(prompts)
        finally:
            self.rollout_func = saved

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        out = self.components.first("generate_single_turn", prompt_ids, images, multimodal_fields, num_generations,
                                    has_tool_images)  # fmt: skip
        if out is not None:
            return out
        return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)

    def _tokenize_prompts(self, prompts: list):
        if is_conversational({"prompt": prompts[0]}):
            return super()._tokenize_prompts(prompts)
        prompt_ids = self.processing_class(text=prompts, add_special_tokens=False)["input_ids"]
        return prompt_ids, None, {}

    def decode_completions(self, batch: dict[str, Any]) -> list[str]:
        ids, mask = batch["completion_ids"], batch["completion_mask"].bool()
        return self.processing_class.batch_decode(
            [row[m].tolist() for row, m in zip(ids, mask, strict=True)], skip_special_tokens=True
        )

    # ---------------------------------------------------------------------------------------- 2. rewards
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        ctx = self.batch_context
        step = self.state.global_step + 1
        ctx.reward_context = trl_context(inputs, prompts, completions, completion_ids_list, self.state)
        if any(c.skips_rewards() for c in self.components):  # pure distillation: no reward function is called
            rewards = torch.zeros(len(prompts), len(self.reward_funcs), device=self.accelerator.device)
            ctx.rewards, ctx.local_rewards = rewards, rewards
            return rewards
        saved = self.environments  # a tool environment's instances reach TRL's reward functions as environments=
        self.environments = ctx.environments if ctx.environments is not None else saved
        try:
            rewards = GRPOTrainer._calculate_rewards(self, inputs, prompts, completions, completion_ids_list)
        except ValueError as e:  # TRL's check of the number of rewards (it names the function)
            raise NumericFault(f"step {step}: {e} First completion: {completions[0]!r}") from e
        finally:
            self.environments = saved
        for c in self.components:
            rewards = c.rewards(ctx, rewards, prompts, completions)
        n, rank = len(prompts), self.accelerator.process_index
        local = rewards[rank * n : (rank + 1) * n]
        self.check_reward_faults(rewards, local, list(completions), step)
        ctx.rewards, ctx.local_rewards = rewards, local
        for c in self.components:
            c.rewards_done(ctx)
        return rewards

    def check_reward_faults(self, rewards: torch.Tensor, local: torch.Tensor, completions: list, step: int) -> None:
        """`NumericFault` on every process at the same step (``rewards`` are gathered, ``local`` this process's rows):
        a computed NaN / inf (`runs.faults.guard_reward`'s record), a reward model's non-finite value, or a None that
        a feature of this run cannot use (`none_reward_refusal`)."""
        faults, self._reward_faults[:] = list(self._reward_faults), []
        none_ok = [not isinstance(f, torch.nn.Module) for f in self.reward_funcs]  # their NaN is a None
        nan = torch.isnan(rewards)
        bad = ~torch.isfinite(rewards) & ~(nan & torch.tensor(none_ok, device=rewards.device))
        if faults:  # first, whatever the base reward (routing's rewards stage) put in place of the marked value
            raise NumericFault(faults[0])
        refusal = self.none_reward_refusal() if bool(nan.any()) else None
        if not bool(bad.any()) and refusal is None:
            return
        if bool(bad.any()):
            check_rewards(local, list(self.reward_func_names), completions, step, none_ok)  # names the local row
            raise NumericFault(f"step {step}: a reward function returned a non-finite value on another process")
        if bool(torch.isnan(local).any()):
            row, col = torch.isnan(local).nonzero()[0].tolist()
            raise NumericFault(f"step {step}: reward function {self.reward_func_names[col]!r} returned None for "
                               f"completion {row} ({completions[row]!r}): {refusal}")
        raise NumericFault(f"step {step}: a reward function returned None on another process: {refusal}")

    def none_reward_refusal(self) -> str | None:
        """Why a reward of None (TRL's "not applicable") cannot be used by this run, or None: TRL's own advantages
        skip it (``nanmean``, ``nansum``), but the features that read every sample's reward need a value."""
        a = self.args
        features = [why for c in self.components if (why := c.needs_every_reward())]
        features += ["--adv_estimator"] * bool(a.adv_estimator)
        if not features:
            return None
        return (f"{', '.join(features)} need(s) a reward for every completion; None (not applicable) works with "
                "these off, as in TRL")

    # ---------------------------------------------------------------------------------------- the batch flow
    def _generate_and_score_completions(self, inputs):
        """Stages 1-5 of one generation batch (see the module docstring)."""
        mode = "train" if self.model.training else "eval"
        ctx = self.batch_context = BatchContext(rows=list(inputs), mode=mode,
                                                     first_row=self.accelerator.process_index * len(inputs))
        try:
            batch = GRPOTrainer._generate_and_score_completions(self, inputs)  # 1 and 2
            for c in self.components:  # 3: scorers
                c.score(batch, ctx)
            self._estimate(batch, ctx)  # 4
            self._record_batch(batch, ctx)  # 5
            for c in self.components:
                c.record(batch, ctx)
            check_batch(batch, self.batch_features(ctx))
            check_context(ctx, batch)
        finally:
            self.batch_context = None
        return batch

    def _estimate(self, batch: dict, ctx: BatchContext) -> None:
        train = ctx.mode == "train"
        group = self.num_generations if train else self.num_generations_eval
        rewards = weighted_rewards(ctx.rewards, self.reward_weights)
        estimate = estimate_advantages(rewards, group, env_estimator=self.args.adv_estimator, distill=ctx.distill,
                                       routing=ctx.routing_arm if train else None)
        if train and estimate.source != self._estimator_source:  # the run log names who decided them
            self._estimator_source = estimate.source
            print(f"advantages: {estimate.source} (step {self.state.global_step + 1})", flush=True)
        n, proc = len(ctx.rows), self.accelerator.process_index
        ctx.pre_advantages = batch["advantages"] if estimate.base is None else local_slice(estimate.base, proc, n)
        if estimate.advantages is not None:
            batch["advantages"] = local_slice(estimate.advantages, proc, n).to(batch["advantages"])
        ctx.advantages = estimate.advantages
        for c in self.components:
            c.estimated(batch, ctx)

    def batch_features(self, ctx: BatchContext) -> BatchFeatures:
        """Which optional keys this batch carries (`trl_ext.batch`), as the components decide."""
        keys: dict[str, bool] = {"env": bool(self.tools)}
        for c in self.components:
            for key, value in c.batch_keys(ctx).items():
                keys[key] = keys.get(key, False) or value
        return BatchFeatures(**keys)

    def _record_batch(self, batch: dict[str, Any], ctx: BatchContext) -> None:
        mode = ctx.mode
        if self.eval_reward_funcs:
            texts = self.decode_completions(batch)
            for name, fn in self.eval_reward_funcs.items():
                ctx.eval_rewards[name] = score(fn, texts, ctx.reward_context)
                values = torch.tensor(ctx.eval_rewards[name], dtype=torch.float32, device=self.accelerator.device)
                self.metrics(mode)[f"eval_rewards/{name}"].append(self.accelerator.gather(values).mean().item())
        if mode == "train":
            frac_zero = self.metrics("train")["frac_reward_zero_std"][-1]
            self.zero_signal.update(frac_zero, self.state.global_step + 1)
            self.metrics("train")["zero_spread_streak"].append(float(self.zero_signal.streak))

    # ---------------------------------------------------------------------------------------- loss and backward
    def _compute_loss(self, model, inputs):
        """Loss stage: a component's loss (off-policy importance sampling) or TRL's, inside every component's
        `around_loss`; `loss_logps` right after the loss's own log-prob forward."""
        with ExitStack() as stack:
            for c in self.components:
                stack.enter_context(c.around_loss(inputs))
            self._loss_inputs, self._loss_logps = inputs, None
            try:
                out = self.components.first("loss", model, inputs)
                if out is None:
                    out = GRPOTrainer._compute_loss(self, model, inputs), comp.LossTokens(self._loss_logps)
            finally:
                self._loss_inputs = self._loss_logps = None
            loss, tokens = out
            for c in self.components:
                c.loss_tokens(inputs, tokens)
            return loss

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        inputs, self._loss_inputs = self._loss_inputs, None
        if inputs is not None:  # the loss's own forward (its first call within `_compute_loss`)
            self._loss_logps = out[0].detach()
            for c in self.components:
                c.loss_logps(inputs, out[0])
        return out

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = self.components.first("backward", model, inputs, num_items_in_batch)
        if loss is None:
            loss = super().training_step(model, inputs, num_items_in_batch)
        self.check_loss(loss)
        for c in self.components:
            c.step_done()
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        step, sample = self.state.global_step, compat.trl_logs(self)
        if self.model.training and sample["prompt"] and self.accelerator.is_main_process and "loss" in logs:
            prompt, completion = sample["prompt"][-1], sample["completion"][-1]
            tqdm.write(f"[Sample @ step {step}] {prompt} ||| {completion}", file=sys.stdout)
            sys.stdout.flush()
        super().log(logs, start_time)
