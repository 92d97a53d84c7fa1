"""`ExtGRPOTrainer`: TRL's GRPOTrainer with the project's hooks. Plumbing only; the math lives in
the feature modules (routing, importance, distill, advantages).

Hooks overridden:
- `_tokenize_prompts`: plain-text prompts are tokenized with ``add_special_tokens=False``
  (SimpleStories' tokenizer appends [EOS] otherwise, and generation would start after an EOS).
- `_generate_and_score_completions`: decodes the completions once and logs the `--eval_rewards`
  components and the zero-reward-spread monitor.
- `log`: prints ``[Sample @ step N] prompt ||| completion`` every logging step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from tqdm.auto import tqdm
from trl import GRPOTrainer
from trl.data_utils import is_conversational

from trl_ext.distill_trainer import DistillMixin
from trl_ext.env_trainer import EnvMixin
from trl_ext.monitor import ZeroSignalMonitor
from trl_ext.offpolicy_trainer import OffPolicyMixin
from trl_ext.routing_trainer import RoutingMixin

TextReward = Callable[[list[str]], list[float]]


class ExtGRPOTrainer(DistillMixin, RoutingMixin, OffPolicyMixin, EnvMixin, GRPOTrainer):
    def __init__(self, *args, eval_reward_funcs: dict[str, TextReward] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.eval_reward_funcs = dict(eval_reward_funcs or {})
        self.zero_signal = ZeroSignalMonitor(self.args.zero_signal_patience)

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

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        if self.eval_reward_funcs:
            texts = self.decode_completions(batch)
            for name, fn in self.eval_reward_funcs.items():
                values = torch.tensor(fn(texts), dtype=torch.float32)
                self._metrics[mode][f"eval_rewards/{name}"].append(values.mean().item())
        if mode == "train":
            frac_zero = self._metrics["train"]["frac_reward_zero_std"][-1]
            self.zero_signal.update(frac_zero, self.state.global_step + 1)
            self._metrics["train"]["zero_spread_streak"].append(float(self.zero_signal.streak))
        return batch

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        step = self.state.global_step
        if self.model.training and self._logs["prompt"] and self.accelerator.is_main_process and "loss" in logs:
            prompt, completion = self._logs["prompt"][-1], self._logs["completion"][-1]
            tqdm.write(f"[Sample @ step {step}] {prompt} ||| {completion}", file=sys.stdout)
            sys.stdout.flush()
        super().log(logs, start_time)
