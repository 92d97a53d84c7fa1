"""`ExtGRPOTrainer`: TRL's GRPOTrainer with the project's features, composed by one explicit batch flow. Plumbing
only: each stage is a feature's method, the math lives in the feature subpackages (routing, offpolicy, distill, env).

One generation batch (`_generate_and_score_completions`), in this order; ``trl_ext/batch.py`` is the schema of the
batch dict every stage reads and extends:
1. **rollout source**: TRL's generation (``--generation_backend trl|fast``: `generation.trainer`), the environment
   loop (``--env``: `env.trainer.env_rollout`, TRL's ``rollout_func``), or the asynchronous generator thread
   (``--max_async_level >= 1``: `offpolicy.trainer`, either of the two), all into TRL's own batch building;
2. **rewards** (`_calculate_rewards`, called by TRL within 1): the reward functions (none under pure distillation),
   checked finite (`runs.faults`), routing's base reward where the hack does not pay and its detector flags, the
   task reward kept for distillation;
3. **scorers**: policy versions (off-policy), routing labels ``is_rh`` / ``is_bad``, teacher and student
   log-probs (distillation);
4. **estimator** (`trl_ext.estimator`): the one decision on the advantages (TRL's, ``--adv_estimator``,
   distillation's, then a routing arm); combinations that would leave one unused are parse-time errors;
5. **records**: ``--eval_rewards``, the zero-signal monitor, ``--save_rollouts`` and its token records
   (``--token_records_every``, `runs.token_mixin`), the schema check.

Then per micro-batch: **loss** (`_compute_loss`): TRL's, or the off-policy importance-sampling loss, with
distillation's token bonus around either; **backward** (`training_step`): routing's routed backward when on;
numeric faults and checkpoints around it (`runs.mixin.CheckpointMixin`).

Other hooks: `_tokenize_prompts` (plain-text prompts without special tokens: SimpleStories' tokenizer would append
[EOS]) and `log` (``[Sample @ step N] prompt ||| completion`` every logging step).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from tqdm.auto import tqdm
from trl import GRPOTrainer
from trl.data_utils import is_conversational

from rewards.bound import score, trl_context
from trl_ext.batch import BatchFeatures, check_batch, loss_mask
from trl_ext.distill.trainer import DistillMixin
from trl_ext.env.episodes import episode_columns
from trl_ext.env.trainer import EnvMixin
from trl_ext.estimator import estimate_advantages, local_slice, weighted_rewards
from trl_ext.generation.trainer import GenerationMixin
from trl_ext.monitor import ZeroSignalMonitor
from trl_ext.offpolicy.trainer import OffPolicyMixin
from trl_ext.routing.trainer import RoutingMixin
from trl_ext.runs import rollouts
from trl_ext.runs.faults import NumericFault, check_rewards, guard_reward
from trl_ext.runs.mixin import CheckpointMixin
from trl_ext.runs.token_mixin import TokenRecordsMixin
from trl_ext.vllm.trainer import VLLMMixin

TextReward = Callable[[list[str]], list[float]]


class ExtGRPOTrainer(TokenRecordsMixin, CheckpointMixin, DistillMixin, RoutingMixin, VLLMMixin, OffPolicyMixin,
                     EnvMixin, GenerationMixin, GRPOTrainer):
    def __init__(self, *args, eval_reward_funcs: dict[str, TextReward] | None = None,
                 reward_names: list[str] | None = None, **kwargs):
        """GRPOTrainer's arguments, the feature mixins' keyword arguments (routing: ``rh_detector``, ...),
        ``eval_reward_funcs`` (name -> reward, logged, not optimised; a ``rewards.bound.BoundReward`` that reads more
        than texts gets the batch's TRL reward arguments) and ``reward_names`` (the names logged for
        ``reward_funcs``, instead of TRL's). Python-API conveniences
        (``trl_ext.api``): a builtin model name or path as ``model``, the tokenizer prepared, dual adapters built."""
        from trl_ext.api import trainer_arguments

        super().__init__(**trainer_arguments(args, kwargs))
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
        self.reward_context: dict[str, Any] = {}
        """TRL's reward keyword arguments of the current batch (`rewards.bound.trl_context`), for the eval rewards
        and routing's base reward."""
        self.zero_signal = ZeroSignalMonitor(self.args.zero_signal_patience)
        self.rollout_columns: dict[str, list] = {}
        """Per-sample values that feature mixins add for the saved rollouts (cleared for every batch)."""
        self._estimator_source = None
        """The estimator stage's source of the last training batch (printed when it changes)."""
        self._rollout_features = None
        if self.args.save_rollouts:
            self._rollout_features = rollouts.features(list(self.reward_func_names), list(self.eval_reward_funcs))

    def checkpoint_state(self) -> dict:
        return {**super().checkpoint_state(), "zero_signal": self.zero_signal.state()}

    def load_checkpoint_state(self, state: dict) -> None:
        super().load_checkpoint_state(state)
        if "zero_signal" in state:
            self.zero_signal.load_state(state["zero_signal"])

    # ----------------------------------------------------------------------------------------
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

    # ---------------------------------------------------------------------------------------- the batch flow
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """Stage 2: rewards (see the module docstring)."""
        step = self.state.global_step + 1
        self.reward_context = trl_context(inputs, prompts, completions, completion_ids_list, self.state)
        if self.distill_skips_rewards:  # pure distillation: no reward function is called
            rewards = torch.zeros(len(prompts), len(self.reward_funcs), device=self.accelerator.device)
            self._rewards_per_func, self._local_rewards = rewards, rewards
            return rewards
        try:
            rewards = GRPOTrainer._calculate_rewards(self, inputs, prompts, completions, completion_ids_list)
        except ValueError as e:  # TRL's check of the number of rewards (it names the function)
            raise NumericFault(f"step {step}: {e} First completion: {completions[0]!r}") from e
        rewards = self.routing_rewards(rewards, prompts, completions)
        n, rank = len(prompts), self.accelerator.process_index
        local = rewards[rank * n : (rank + 1) * n]
        self.check_reward_faults(rewards, local, list(completions), step)
        self._local_rewards = local
        self._rewards_per_func = rewards
        self.distill_record_task(rewards)
        return rewards

    def check_reward_faults(self, rewards: torch.Tensor, local: torch.Tensor, completions: list, step: int) -> None:
        """`NumericFault` on every process at the same step (``rewards`` are gathered, ``local`` this process's rows):
        a computed NaN / inf (`runs.faults.guard_reward`'s record), a reward model's non-finite value, or a None that
        a feature of this run cannot use (`none_reward_refusal`)."""
        faults, self._reward_faults[:] = list(self._reward_faults), []
        none_ok = [not isinstance(f, torch.nn.Module) for f in self.reward_funcs]  # their NaN is a None
        nan = torch.isnan(rewards)
        bad = ~torch.isfinite(rewards) & ~(nan & torch.tensor(none_ok, device=rewards.device))
        if faults:  # first, whatever the base reward (routing_rewards) put in place of the marked value
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
        features = [name for name, on in (
            ("gradient routing's labels and base reward", a.labelled or a.needs_base_reward),
            ("distillation's task reward", a.distill_on), ("--adv_estimator", bool(a.adv_estimator)),
            ("the environment's reward", bool(a.env)),
            ("the routing eval's mean rewards", a.dual_lora and a.eval_routing_steps > 0),
        ) if on]  # fmt: skip
        if not features:
            return None
        return (f"{', '.join(features)} need(s) a reward for every completion; None (not applicable) works with "
                "these off, as in TRL")

    def _generate_and_score_completions(self, inputs):
        """Stages 1-5 of one generation batch (see the module docstring)."""
        self.rollout_columns = episode_columns(inputs) if self.args.env else {}  # saved rollouts: env, env_seed
        self._env_rows = inputs  # the environment source reads each row's env_seed (same order as the prompts)
        batch = GRPOTrainer._generate_and_score_completions(self, inputs)  # 1 and 2
        mode = "train" if self.model.training else "eval"
        self.offpolicy_versions_stage(batch)  # 3: scorers
        scored = self.routing_labels_stage(batch)
        distill = self.distill_score(batch, inputs)
        group = self.num_generations if mode == "train" else self.num_generations_eval
        rewards = weighted_rewards(self._rewards_per_func, self.reward_weights)
        estimate = estimate_advantages(rewards, group, env_estimator=self.args.adv_estimator, distill=distill,
                                       routing=self.routing_arm(scored) if mode == "train" else None)  # 4
        if mode == "train" and estimate.source != self._estimator_source:  # the run log names who decided them
            self._estimator_source = estimate.source
            print(f"advantages: {estimate.source} (step {self.state.global_step + 1})", flush=True)
        n, proc = len(inputs), self.accelerator.process_index
        pre = batch["advantages"] if estimate.base is None else local_slice(estimate.base, proc, n)
        if estimate.advantages is not None:
            batch["advantages"] = local_slice(estimate.advantages, proc, n).to(batch["advantages"])
        self.routing_trace_stage(batch, scored, pre)
        if distill is not None and self._metrics[mode]["frac_reward_zero_std"]:  # whole batch: groups intact
            no_signal = self.distill_no_signal(estimate.advantages, distill, group)
            self._metrics[mode]["frac_reward_zero_std"][-1] = no_signal.float().mean().item()
        self._record_batch(batch, mode)  # 5
        check_batch(batch, self.batch_features(mode))
        return batch

    def batch_features(self, mode: str) -> BatchFeatures:
        """Which optional keys this trainer's batches carry (`trl_ext.batch`)."""
        a, d = self.args, self.distill_cfg
        token_path = d is not None and not d.use_full_reward_baseline
        return BatchFeatures(
            env=bool(a.env) or bool(self.tools), offpolicy=self._pending_rollout is not None, detector=self.rh_detector is not None,
            labelled=a.labelled and mode == "train" and self.rh_detector is not None,
            distill_teacher_tokens=token_path and d.teacher_tau > 0, distill_gate=token_path and d.kl_only_incorrect,
        )

    def _record_batch(self, batch: dict[str, Any], mode: str) -> None:
        eval_values = {}
        if self.eval_reward_funcs:
            texts = self.decode_completions(batch)
            for name, fn in self.eval_reward_funcs.items():
                eval_values[name] = score(fn, texts, self.reward_context)
                values = torch.tensor(eval_values[name], dtype=torch.float32, device=self.accelerator.device)
                self._metrics[mode][f"eval_rewards/{name}"].append(self.accelerator.gather(values).mean().item())
        if self._rollout_features is not None and mode == "train":
            self.write_rollouts(batch, eval_values)
        if mode == "train":
            frac_zero = self._metrics["train"]["frac_reward_zero_std"][-1]
            self.zero_signal.update(frac_zero, self.state.global_step + 1)
            self._metrics["train"]["zero_spread_streak"].append(float(self.zero_signal.streak))

    def _compute_loss(self, model, inputs):
        """Loss stage: TRL's loss, or the off-policy importance-sampling loss (k >= 1), with distillation's
        token-path bonus around either."""
        with self.distill_token_bonus(inputs):
            if self.offpolicy_loss_on:
                return self.offpolicy_loss(model, inputs)
            with self.capture_trl_loss(inputs):  # --token_records_every: the rows this loss trains
                loss = GRPOTrainer._compute_loss(self, model, inputs)
            return loss

    def write_rollouts(self, batch: dict[str, Any], eval_values: dict[str, list]) -> None:
        """Write this batch's samples to ``{run_dir}/rollouts/`` (schema: `trl_ext.runs.rollouts`)."""
        tok, mask = self.processing_class, batch["completion_mask"]
        trained = loss_mask(batch)
        n = mask.size(0)
        rows = lambda ids, m: [r[k].tolist() for r, k in zip(ids, m.bool(), strict=True)]  # noqa: E731
        prompts = tok.batch_decode(rows(batch["prompt_ids"], batch["prompt_mask"]), skip_special_tokens=True)
        ids = rows(batch["completion_ids"], mask)
        completions = tok.batch_decode(ids, skip_special_tokens=True)
        if "tool_mask" in batch:  # turn boundaries of environment transcripts
            decode = lambda x: tok.decode(x, skip_special_tokens=True)  # noqa: E731
            segments = [rollouts.split_segments(i, t, decode) for i, t in zip(ids, rows(trained, mask), strict=True)]
        else:
            segments = [[{"source": "agent", "text": text}] for text in completions]
        rewards = self._local_rewards
        weights = self.reward_weights.to(rewards.device)
        first = self.accelerator.process_index * n  # this process's rows of the generation batch (TRL's order)
        cols: dict[str, list] = {
            "step": [self.state.global_step + 1] * n, "sample": list(range(first, first + n)),
            "group": [(first + i) // self.num_generations for i in range(n)], "prompt": prompts,
            "completion": completions,
            "segments": segments, "reward": rollouts.weighted_reward(rewards, weights).tolist(),
            **{f"reward/{name}": rewards[:, j].double().tolist() for j, name in enumerate(self.reward_func_names)},
            **{f"eval_reward/{name}": [float(v) for v in values] for name, values in eval_values.items()},
            "advantage": rollouts.sequence_values(batch["advantages"].detach(), trained),
            "completion_tokens": trained.sum(1).long().tolist(),
        }  # fmt: skip
        for key in ("is_rh", "is_bad"):
            cols[key] = batch[key].bool().tolist() if key in batch else [None] * n
        if "behaviour_versions" in batch:
            v, m = batch["behaviour_versions"], trained.bool()
            cols["policy_version_min"] = torch.where(m, v, torch.iinfo(v.dtype).max).amin(1).tolist()
            cols["policy_version_max"] = torch.where(m, v, torch.iinfo(v.dtype).min).amax(1).tolist()
        for key, values in self.rollout_columns.items():
            cols[key] = values
        for key in rollouts.OPTIONAL_COLUMNS:
            cols.setdefault(key, [None] * n)
        if self.token_records_due():  # --token_records_every: this step's token rows (`runs.token_mixin`)
            self.start_token_records(batch, cols, first)
        if self.accelerator.num_processes > 1:  # one shard per step, written by the main process
            from accelerate.utils import gather_object

            cols = {key: gather_object(values) for key, values in cols.items()}
            if not self.accelerator.is_main_process:
                return
        path = rollouts.shard_path(self.args.output_dir, self.state.global_step + 1)
        rollouts.write_shard(path, cols, self._rollout_features)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        step = self.state.global_step
        if self.model.training and self._logs["prompt"] and self.accelerator.is_main_process and "loss" in logs:
            prompt, completion = self._logs["prompt"][-1], self._logs["completion"][-1]
            tqdm.write(f"[Sample @ step {step}] {prompt} ||| {completion}", file=sys.stdout)
            sys.stdout.flush()
        super().log(logs, start_time)
