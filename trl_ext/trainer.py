"""`ExtGRPOTrainer`: TRL's GRPOTrainer with the project's hooks. Plumbing only; the math lives in
the feature modules (routing, importance, distill, advantages).

Hooks overridden:
- `_tokenize_prompts`: plain-text prompts are tokenized with ``add_special_tokens=False``
  (SimpleStories' tokenizer appends [EOS] otherwise, and generation would start after an EOS).
- `_generate_and_score_completions`: decodes the completions once and logs the `--eval_rewards`
  components and the zero-reward-spread monitor.
- `_calculate_rewards`: every reward must be a finite number (`runs.faults`: a NaN/inf reward stops the run,
  naming the function, the step and the completion; TRL would count it as 0).
- `log`: prints ``[Sample @ step N] prompt ||| completion`` every logging step.
- With ``--save_rollouts``, every scored batch is written to ``{run_dir}/rollouts/`` (`runs.rollouts`).
Checkpoints, resume and numeric faults of the loss and gradient norm: `runs.mixin.CheckpointMixin`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from tqdm.auto import tqdm
from trl import GRPOTrainer
from trl.data_utils import is_conversational

from trl_ext.distill.trainer import DistillMixin
from trl_ext.env.trainer import EnvMixin
from trl_ext.generation.trainer import GenerationMixin
from trl_ext.monitor import ZeroSignalMonitor
from trl_ext.offpolicy.trainer import OffPolicyMixin
from trl_ext.routing.trainer import RoutingMixin
from trl_ext.runs import rollouts
from trl_ext.runs.faults import NumericFault, check_rewards
from trl_ext.runs.mixin import CheckpointMixin

TextReward = Callable[[list[str]], list[float]]


class ExtGRPOTrainer(CheckpointMixin, DistillMixin, RoutingMixin, OffPolicyMixin, EnvMixin, GenerationMixin,
                     GRPOTrainer):
    def __init__(self, *args, eval_reward_funcs: dict[str, TextReward] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.eval_reward_funcs = dict(eval_reward_funcs or {})
        self.zero_signal = ZeroSignalMonitor(self.args.zero_signal_patience)
        self.rollout_columns: dict[str, list] = {}
        """Per-sample values that feature mixins add for the saved rollouts (cleared for every batch)."""
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

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        step = self.state.global_step + 1
        try:
            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        except ValueError as e:  # TRL's check of the number of rewards (it names the function)
            raise NumericFault(f"step {step}: {e} First completion: {completions[0]!r}") from e
        n, rank = len(prompts), self.accelerator.process_index
        local = rewards[rank * n : (rank + 1) * n]
        check_rewards(local, list(self.reward_func_names), list(completions), step)
        self._local_rewards = local
        return rewards

    def _generate_and_score_completions(self, inputs):
        self.rollout_columns = {}
        batch = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        eval_values = {}
        if self.eval_reward_funcs:
            texts = self.decode_completions(batch)
            for name, fn in self.eval_reward_funcs.items():
                eval_values[name] = fn(texts)
                values = torch.tensor(eval_values[name], dtype=torch.float32)
                self._metrics[mode][f"eval_rewards/{name}"].append(values.mean().item())
        if self._rollout_features is not None and mode == "train":
            self.write_rollouts(batch, eval_values)
        if mode == "train":
            frac_zero = self._metrics["train"]["frac_reward_zero_std"][-1]
            self.zero_signal.update(frac_zero, self.state.global_step + 1)
            self._metrics["train"]["zero_spread_streak"].append(float(self.zero_signal.streak))
        return batch

    def write_rollouts(self, batch: dict[str, Any], eval_values: dict[str, list]) -> None:
        """Write this batch's samples to ``{run_dir}/rollouts/`` (schema: `trl_ext.runs.rollouts`)."""
        tok, mask = self.processing_class, batch["completion_mask"]
        trained = mask if "tool_mask" not in batch else mask * batch["tool_mask"]
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
        cols: dict[str, list] = {
            "step": [self.state.global_step + 1] * n, "sample": list(range(n)),
            "group": [i // self.num_generations for i in range(n)], "prompt": prompts, "completion": completions,
            "segments": segments, "reward": (rewards * weights).nansum(1).double().tolist(),
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
        path = rollouts.shard_path(self.args.output_dir, self.state.global_step + 1, self.accelerator.process_index)
        rollouts.write_shard(path, cols, self._rollout_features)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        step = self.state.global_step
        if self.model.training and self._logs["prompt"] and self.accelerator.is_main_process and "loss" in logs:
            prompt, completion = self._logs["prompt"][-1], self._logs["completion"][-1]
            tqdm.write(f"[Sample @ step {step}] {prompt} ||| {completion}", file=sys.stdout)
            sys.stdout.flush()
        super().log(logs, start_time)
