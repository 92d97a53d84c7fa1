"""Trainer plumbing of teacher context distillation (seed 002; prime-rl fork 'contextual_learning'): the stages
`DistillMixin` gives ExtGRPOTrainer's batch flow (``trl_ext/trainer.py``). Flags: ``distill.args``; math:
``distill.advantages`` (reward composition) and ``distill.teacher`` (teacher inputs and log-probs);
``--eval_baseline``: ``distill.baseline``.

One step with distillation on (``--teacher_tau > 0``, ``--student_tau > 0`` or ``--skip_verification``):
1. reward stage (`distill_record_task`): the task reward as TRL computes it, kept for the composition; with
   ``--skip_verification`` no reward function is called (zeros go to TRL's bookkeeping only).
2. scorer stage (`distill_score`): the teacher scores this process's agent tokens
   of the sampled completions (environment tokens are read, not scored) on ``context + prompt`` (plain text) or
   on the chat prompt with the context as its system message (chat prompts, `teacher_messages`); the student's
   sampling log-probs are the behaviour log-probs of the batch when it has them (off-policy rollouts, vLLM), else
   TRL's ``old_per_token_logps``, else one no-grad forward of the policy (same temperature). Token path:
   ``distill_lp_teacher`` [B, C] and ``distill_gate`` [B] join the batch dict, so TRL's shuffle and split keep
   them aligned. The composition and its group baselines run on the whole generation batch, groups intact: with
   several processes the log-probs are gathered (TRL places a group's members wherever its sampler puts them).
3. estimator stage (``trl_ext.estimator``): distillation's advantages (no std scaling) replace TRL's, or a routing
   arm renormalises distillation's reward.
4. loss stage (`distill_token_bonus`, token path ``--no_use_full_reward_baseline``): right after the loss computes
   the current log-probs, ``token_kl_bonus`` is added to the advantages of that micro-batch (the loss, TRL's or
   the off-policy one, reads the advantages after its log-prob forward).

The teacher, in order: ``--teacher_model`` (a second, frozen model: one more copy of its weights in memory);
else the policy with its adapters disabled (PEFT LoRA, dual LoRA: no second copy); else, full fine-tune with
``--beta > 0``, TRL's reference model (the initial weights it already holds). A full fine-tune with beta 0 and no
``--teacher_model`` has no teacher: an error, rather than a silent extra copy of the model.

``--adv_tau`` weights the task reward inside the advantages (both paths). It is distillation's own flag: the
off-policy loss multiplies whatever advantages it gets by ``--loss_adv_tau`` (default 1), a separate flag.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
from torch import nn
from trl.data_utils import is_conversational

from trl_ext.batch import loss_mask
from trl_ext.distill.advantages import DistillAdvantages, distill_advantages, distill_metrics, token_kl_bonus
from trl_ext.distill.teacher import (
    build_teacher_inputs,
    chat_teacher_prompt,
    encode_context,
    teacher_batch,
    teacher_logprobs,
    teacher_messages,
)
from trl_ext.estimator import local_slice, weighted_rewards
from trl_ext.registry import ConfigError
from trl_ext.runs.rollouts import masked_sums


class DistillMixin:
    """GRPOTrainer hooks of context distillation (module docstring); pass-throughs when it is off."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        on = self.args.distill_on
        self.distill_cfg = self.args.distill_config() if on else None
        self.distill_teacher = None
        self._distill_task = None
        self._distill_loss_inputs = None
        self._distill_context_ids = []
        if on or self.args.eval_baseline:
            self._distill_context_ids = encode_context(self.processing_class, self.args.teacher_context)
            if self.args.teacher_model:
                self.distill_teacher = _load_teacher(self.args.teacher_model, self.model, self.accelerator.device)
        self.teacher_replicas = None  # --teacher_server_url: the teacher's vLLM servers (trl_ext.serve)
        if on and self.args.teacher_server_url:
            from trl_ext.serve.args import server_urls
            from trl_ext.serve.client import Replica
            from trl_ext.serve.engine import check_replicas

            self.teacher_replicas = [Replica(u, os.environ.get("VLLM_API_KEY"), self.args.vllm_request_timeout)
                                     for u in server_urls(self.args, teacher=True)]  # fmt: skip
            check_replicas(self.teacher_replicas, self.processing_class, None, "teacher server")

    # ------------------------------------------------------------------ teacher
    @contextmanager
    def teacher_scope(self):
        """The teacher model for the body (adapters disabled while it runs, when it is the policy)."""
        from accelerate.utils import is_peft_model

        from trl_ext.routing.adapters import DualLoRALinear, adapters_disabled

        if self.distill_teacher is not None:
            yield self.distill_teacher
            return
        model = self.accelerator.unwrap_model(self.model)
        if is_peft_model(model):
            with model.disable_adapter():
                yield model
        elif any(isinstance(m, DualLoRALinear) for m in model.modules()):
            with adapters_disabled(model):
                yield model
        elif self.ref_model is not None:
            yield self.ref_model
        else:
            raise ConfigError("no teacher: set --teacher_model, train adapters, or use --beta > 0 (reference model)")

    def teacher_prompt_ids(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
        """``context + prompt`` rows, left-padded (the teacher's prompt, as `build_teacher_inputs` builds it)."""
        empty = prompt_ids.new_zeros((prompt_ids.size(0), 0))
        ids, mask, _ = build_teacher_inputs(self._distill_context_ids, prompt_ids, prompt_mask, empty, empty,
                                            self._tokenizer.pad_token_id, self._tokenizer.bos_token_id)
        return ids, mask

    def score_teacher(self, batch: dict, prompts: list | None = None) -> torch.Tensor:
        """Teacher log-probs ``[B, C]`` of the batch's agent tokens (0 on environment tokens and padding).

        The teacher's prompt: for chat ``prompts`` (message lists), the messages with the context as their system
        message (`teacher_messages`) rendered by the chat template, then what followed the student's rendered
        messages in its prompt ids (`chat_teacher_prompt`); otherwise ``context + prompt`` ids."""
        chat = bool(self.args.teacher_context and prompts) and is_conversational({"prompt": prompts[0]})
        if chat:
            tok, context = self.processing_class, self.args.teacher_context

            def render(messages):
                text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                return tok(text, add_special_tokens=False)["input_ids"]

            rows = []
            for ids, m, p in zip(batch["prompt_ids"], batch["prompt_mask"], prompts, strict=True):
                teacher = chat_teacher_prompt(ids[m.bool()].tolist(), render(p), render(teacher_messages(p, context)))
                rows.append(torch.tensor(teacher))
            ids, mask, keep = teacher_batch(rows, batch["completion_ids"], batch["completion_mask"],
                                            self._tokenizer.pad_token_id)  # fmt: skip
        else:
            ids, mask, keep = build_teacher_inputs(
                self._distill_context_ids, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                batch["completion_mask"], self._tokenizer.pad_token_id, self._tokenizer.bos_token_id)
        if self.teacher_replicas is not None:  # temperature 1 (ServeArgs refuses another)
            from trl_ext.serve.engine import server_teacher_logprobs

            return server_teacher_logprobs(self.teacher_replicas, ids, mask, keep, score_mask=loss_mask(batch))
        with self.teacher_scope() as teacher:
            return teacher_logprobs(teacher, ids, mask, keep, self.temperature, self.args.per_device_train_batch_size,
                                    score_mask=loss_mask(batch))  # fmt: skip

    def student_sampling_logps(self, batch: dict) -> torch.Tensor:
        """Log-probs of the completions under the policy that sampled them (see the module docstring)."""
        for key in ("sampling_per_token_logps", "old_per_token_logps"):
            if batch.get(key) is not None:
                return batch[key]
        from trl.models.utils import disable_gradient_checkpointing

        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model, ids, mask, batch["completion_ids"].size(1), self.args.per_device_train_batch_size)
        return logps

    # ------------------------------------------------------------------ stages (called by ExtGRPOTrainer)
    @property
    def distill_skips_rewards(self) -> bool:
        """Pure distillation (``--skip_verification``): no reward function is called."""
        return self.distill_cfg is not None and self.distill_cfg.skip_verification

    def distill_record_task(self, rewards: torch.Tensor) -> None:
        """Reward stage: keep the weighted task reward of every sample for the composition."""
        self._distill_task = None
        if self.distill_cfg is not None and not self.distill_cfg.skip_verification:
            self._distill_task = weighted_rewards(rewards, self.reward_weights)  # finite: `runs.faults.check_rewards`

    def distill_score(self, batch: dict, inputs: list) -> DistillAdvantages | None:
        """Scorer stage: teacher log-probs of the agent tokens, the student's sampling log-probs, the composed
        rewards and distillation's advantages (the estimator uses them); the token path's ``distill_lp_teacher``
        and ``distill_gate`` join the batch dict; metrics and the saved-rollout sums."""
        cfg = self.distill_cfg
        if cfg is None:
            return None
        mode = "train" if self.model.training else "eval"
        mask = loss_mask(batch)
        prompts = [row["prompt"] for row in inputs]
        lp_teacher = self.score_teacher(batch, prompts) if cfg.teacher_tau > 0 else None
        self._distill_lp_teacher = lp_teacher  # the token records' teacher_logprob (runs.token_mixin)
        lp_student = self.student_sampling_logps(batch) if cfg.has_kl else None
        group = self.num_generations if mode == "train" else self.num_generations_eval
        task, self._distill_task = self._distill_task, None
        for name, lp in (("teacher_logprob_sum", lp_teacher), ("student_logprob_sum", lp_student)):
            if lp is not None:
                self.rollout_columns[name] = masked_sums(lp, mask)
        # Groups over the whole batch: TRL may place a group's members on several processes (``task`` is already
        # gathered, in process order), so the log-probs are gathered too, padded to the longest completion.
        all_teacher, all_student, all_mask = (self.gather_rows(t) for t in (lp_teacher, lp_student, mask))
        result = distill_advantages(task, all_teacher, all_student, all_mask, cfg, group)
        if result.token_level:
            if lp_teacher is not None:
                batch["distill_lp_teacher"] = lp_teacher
            if result.gate is not None:
                batch["distill_gate"] = local_slice(result.gate, self.accelerator.process_index, mask.size(0))
        for name, value in distill_metrics(result, all_teacher, all_student, all_mask).items():
            self._metrics[mode][name].append(value)
        return result

    def gather_rows(self, values: torch.Tensor | None) -> torch.Tensor | None:
        """``[n, C]`` rows of every process, in process order ``[n * processes, max C]`` (zero padding, outside
        every mask); the tensor itself on one process."""
        if values is None or self.accelerator.num_processes == 1:
            return values
        return self.accelerator.gather(self.accelerator.pad_across_processes(values, dim=1, pad_index=0))

    def distill_no_signal(self, advantages: torch.Tensor, result: DistillAdvantages, group: int) -> torch.Tensor:
        """Per group: neither the advantages nor a token bonus move the policy (the zero-signal monitor's input;
        the token path's bonus moves every group whose gate is open)."""
        flat = advantages.view(-1, group)
        no_signal = (flat.amax(1) - flat.amin(1)).abs() <= 1e-6
        if result.token_level and self.distill_cfg.has_kl:
            gate = result.gate if result.gate is not None else torch.ones_like(advantages)
            no_signal &= gate.view(-1, group)[:, 0] == 0
        return no_signal

    # ------------------------------------------------------------------ loss stage: the token path's KL bonus
    @contextmanager
    def distill_token_bonus(self, inputs: dict):
        """Around the loss: on the token path, the per-token bonus is added to this micro-batch's advantages right
        after the loss's own log-prob forward (`_get_per_token_logps_and_entropies`), for TRL's loss and the
        off-policy one alike; the advantages are restored after (the micro-batch may be trained on again)."""
        if self.distill_cfg is None or self.distill_cfg.use_full_reward_baseline:
            yield
            return
        advantages = inputs["advantages"]
        self._distill_loss_inputs = inputs
        try:
            yield
        finally:
            inputs["advantages"] = advantages
            self._distill_loss_inputs = None

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        inputs, self._distill_loss_inputs = self._distill_loss_inputs, None
        if inputs is None:  # not the loss's own forward
            return out
        mask = loss_mask(inputs)
        bonus = token_kl_bonus(inputs.get("distill_lp_teacher"), out[0], mask, self.distill_cfg,
                               inputs.get("distill_gate"))
        advantages = inputs["advantages"]
        inputs["advantages"] = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages) + bonus
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["distill/token_bonus"].append((bonus.sum() / mask.sum().clamp(min=1)).item())
        return out


def _load_teacher(name: str, policy: nn.Module, device) -> nn.Module:
    from transformers import AutoModelForCausalLM

    from trl_ext.models import model_source

    teacher = AutoModelForCausalLM.from_pretrained(model_source(name), dtype=next(policy.parameters()).dtype)
    teacher.to(device).eval().requires_grad_(False)
    student_vocab = policy.get_output_embeddings().weight.size(0)
    if teacher.get_output_embeddings().weight.size(0) != student_vocab:
        raise ValueError(f"--teacher_model {name!r} has a different vocabulary size than the student: the teacher "
                         "must score the student's token ids")
    return teacher
