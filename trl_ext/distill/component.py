"""Teacher context distillation as a component (seed 002; prime-rl fork 'contextual_learning'): the stages
`Distillation` gives ExtGRPOTrainer's batch flow (``trl_ext/trainer.py``). Flags: ``distill.args``; math:
``distill.advantages`` (reward composition) and ``distill.teacher`` (teacher inputs and log-probs);
``--eval_baseline``: ``distill.baseline``.

One step with distillation on (``--teacher_tau > 0``, ``--student_tau > 0`` or ``--skip_verification``):
1. reward stage (`Distillation.rewards_done`): the task reward as TRL computes it, kept for the composition; with
   ``--skip_verification`` no reward function is called (zeros go to TRL's bookkeeping only).
2. scorer stage (`Distillation.score`): the teacher scores this process's agent tokens
   of the sampled completions (environment tokens are read, not scored) on ``context + prompt`` (plain text) or
   on the chat prompt with the context as its system message (chat prompts, `teacher_messages`); the student's
   sampling log-probs are the behaviour log-probs of the batch when it has them (off-policy rollouts, vLLM), else
   TRL's ``old_per_token_logps``, else one no-grad forward of the policy (same temperature). Token path:
   ``distill_lp_teacher`` [B, C] and ``distill_gate`` [B] join the batch dict, so TRL's shuffle and split keep
   them aligned. The composition and its group baselines run on the whole generation batch, groups intact: with
   several processes the log-probs are gathered (TRL places a group's members wherever its sampler puts them).
3. estimator stage (``trl_ext.estimator``): distillation's advantages (no std scaling) replace TRL's, or a routing
   arm renormalises distillation's reward.
4. loss stage (`Distillation.around_loss` and `loss_logps`, token path ``--no_use_full_reward_baseline``): right
   after the loss computes the current log-probs, ``token_kl_bonus`` is added to the advantages of that micro-batch (the loss, TRL's or
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

from trl_ext import compat
from trl_ext.batch import BatchContext, loss_mask
from trl_ext.components import Component, register
from trl_ext.distill.advantages import distill_advantages, distill_metrics, token_kl_bonus
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


@register
class Distillation(Component):
    """Context distillation (module docstring); with ``--eval_baseline`` alone it holds the teacher only."""

    name, order = "distill", 50

    @classmethod
    def wanted(cls, cfg, kwargs) -> bool:
        return bool(cfg.distill_on or cfg.eval_baseline)

    def __init__(self, trainer, kwargs: dict, options: dict) -> None:
        super().__init__(trainer, kwargs, options)
        cfg = kwargs["args"]
        self.cfg = cfg.distill_config() if cfg.distill_on else None
        self.teacher = None  # --teacher_model: a second, frozen model
        self.teacher_replicas = None  # --teacher_server_url: the teacher's vLLM servers (trl_ext.serve)
        self.context_ids: list[int] = []
        self.task = None  # the weighted task reward of the batch (reward stage -> scorer stage)
        self._bonus = False  # the next loss forward adds the token bonus (`around_loss`)

    def setup(self) -> None:
        t, a = self.trainer, self.trainer.args
        self.context_ids = encode_context(t.processing_class, a.teacher_context)
        if a.teacher_model:
            self.teacher = _load_teacher(a.teacher_model, t.model, t.accelerator.device)
        if self.cfg is not None and a.teacher_server_url:
            from trl_ext.serve.args import server_urls
            from trl_ext.serve.client import Replica, check_replicas

            self.teacher_replicas = [Replica(u, os.environ.get("VLLM_API_KEY"), a.vllm_request_timeout,
                                             a.vllm_server_restart_timeout)
                                     for u in server_urls(a, teacher=True)]  # fmt: skip
            check_replicas(self.teacher_replicas, t.processing_class, None, "teacher server")

    def needs_every_reward(self) -> str | None:
        return "distillation's task reward" if self.cfg is not None else None

    # ------------------------------------------------------------------ teacher
    @contextmanager
    def teacher_scope(self):
        """The teacher model for the body (adapters disabled while it runs, when it is the policy)."""
        from accelerate.utils import is_peft_model

        from trl_ext.routing.adapters import DualLoRALinear, adapters_disabled

        if self.teacher is not None:
            yield self.teacher
            return
        t = self.trainer
        model = t.accelerator.unwrap_model(t.model)
        if is_peft_model(model):
            with model.disable_adapter():
                yield model
        elif any(isinstance(m, DualLoRALinear) for m in model.modules()):
            with adapters_disabled(model):
                yield model
        elif t.ref_model is not None:
            yield t.ref_model
        else:
            raise ConfigError("no teacher: set --teacher_model, train adapters, or use --beta > 0 (reference model)")

    def teacher_prompt_ids(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
        """``context + prompt`` rows, left-padded (the teacher's prompt, as `build_teacher_inputs` builds it)."""
        tok = compat.trl_tokenizer(self.trainer)
        empty = prompt_ids.new_zeros((prompt_ids.size(0), 0))
        ids, mask, _ = build_teacher_inputs(self.context_ids, prompt_ids, prompt_mask, empty, empty,
                                            tok.pad_token_id, tok.bos_token_id)
        return ids, mask

    def score_teacher(self, batch: dict, prompts: list | None = None, render_kwargs: list[dict] | None = None
                      ) -> torch.Tensor:  # fmt: skip
        """Teacher log-probs ``[B, C]`` of the batch's agent tokens (0 on environment tokens and padding).

        The teacher's prompt: for chat ``prompts`` (message lists), the messages with the context as their system
        message (`teacher_messages`) rendered by the chat template (with each row's ``render_kwargs``: a tool
        episode's tools and template), then what followed the student's rendered messages in its prompt ids
        (`chat_teacher_prompt`); otherwise ``context + prompt`` ids. In a multi-turn episode the context is thus
        in the system message before the first turn, and the teacher reads the whole transcript after it, tool
        results included, token for token as the student did: each agent token is scored on the history that
        produced it, with the context the student lacked as the only difference."""
        t, a = self.trainer, self.trainer.args
        pad_id = compat.trl_tokenizer(t).pad_token_id
        chat = bool(a.teacher_context and prompts) and is_conversational({"prompt": prompts[0]})
        if chat:
            tok, context = t.processing_class, a.teacher_context

            def render(messages, kwargs):
                text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
                return tok(text, add_special_tokens=False)["input_ids"]

            rows, kws = [], render_kwargs or [{}] * len(prompts)
            for ids, m, p, kw in zip(batch["prompt_ids"], batch["prompt_mask"], prompts, kws, strict=True):
                teacher = chat_teacher_prompt(ids[m.bool()].tolist(), render(p, kw),
                                              render(teacher_messages(p, context), kw))
                rows.append(torch.tensor(teacher))
            ids, mask, keep = teacher_batch(rows, batch["completion_ids"], batch["completion_mask"], pad_id)
        else:
            ids, mask, keep = build_teacher_inputs(
                self.context_ids, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                batch["completion_mask"], pad_id, compat.trl_tokenizer(t).bos_token_id)
        if self.teacher_replicas is not None:  # temperature 1 (ServeArgs refuses another)
            from trl_ext.serve.teacher import server_teacher_logprobs

            return server_teacher_logprobs(self.teacher_replicas, ids, mask, keep, score_mask=loss_mask(batch))
        with self.teacher_scope() as teacher:
            return teacher_logprobs(teacher, ids, mask, keep, t.temperature, a.per_device_train_batch_size,
                                    score_mask=loss_mask(batch))  # fmt: skip

    def student_sampling_logps(self, batch: dict) -> torch.Tensor:
        """Log-probs of the completions under the policy that sampled them (see the module docstring)."""
        for key in ("sampling_per_token_logps", "old_per_token_logps"):
            if batch.get(key) is not None:
                return batch[key]
        from trl.models.utils import disable_gradient_checkpointing

        t = self.trainer
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        with torch.no_grad(), disable_gradient_checkpointing(t.model, t.args.gradient_checkpointing_kwargs):
            logps, _, _ = compat.per_token_logps(t, t.model, ids, mask, batch["completion_ids"].size(1),
                                                 t.args.per_device_train_batch_size)
        return logps

    # ------------------------------------------------------------------ 2. rewards, 3. scorer
    def skips_rewards(self) -> bool:
        """Pure distillation (``--skip_verification``): no reward function is called."""
        return self.cfg is not None and self.cfg.skip_verification

    def rewards_done(self, ctx: BatchContext) -> None:
        """Keep the weighted task reward of every sample for the composition."""
        self.task = None
        if self.cfg is not None and not self.cfg.skip_verification:
            self.task = weighted_rewards(ctx.rewards, self.trainer.reward_weights)  # finite: `runs.faults`

    def score(self, batch: dict, ctx: BatchContext) -> None:
        """Teacher log-probs of the agent tokens (``ctx.teacher_logprobs``), the student's sampling log-probs, the
        composed rewards and distillation's advantages (``ctx.distill``, for the estimator); the token path's
        ``distill_lp_teacher`` and ``distill_gate`` join the batch dict; metrics and the saved-rollout sums."""
        cfg, t = self.cfg, self.trainer
        if cfg is None:
            return
        mask = loss_mask(batch)
        prompts, kwargs = [row["prompt"] for row in ctx.rows], None
        if ctx.episode_prompts is not None:  # tool episodes: the messages and tools their prompts were rendered with
            prompts, kwargs = [p for p, _ in ctx.episode_prompts], [kw for _, kw in ctx.episode_prompts]
        lp_teacher = self.score_teacher(batch, prompts, kwargs) if cfg.teacher_tau > 0 else None
        ctx.teacher_logprobs = lp_teacher
        lp_student = self.student_sampling_logps(batch) if cfg.has_kl else None
        group = t.num_generations if ctx.mode == "train" else t.num_generations_eval
        task, self.task = self.task, None
        for name, lp in (("teacher_logprob_sum", lp_teacher), ("student_logprob_sum", lp_student)):
            if lp is not None:
                ctx.columns[name] = masked_sums(lp, mask)
        # Groups over the whole batch: TRL may place a group's members on several processes (``task`` is already
        # gathered, in process order), so the log-probs are gathered too, padded to the longest completion.
        all_teacher, all_student, all_mask = (self.gather_rows(x) for x in (lp_teacher, lp_student, mask))
        result = distill_advantages(task, all_teacher, all_student, all_mask, cfg, group)
        if result.token_level:
            if lp_teacher is not None:
                batch["distill_lp_teacher"] = lp_teacher
            if result.gate is not None:
                batch["distill_gate"] = local_slice(result.gate, t.accelerator.process_index, mask.size(0))
        metrics = t.metrics(ctx.mode)
        for name, value in distill_metrics(result, all_teacher, all_student, all_mask).items():
            metrics[name].append(value)
        ctx.distill = result

    def gather_rows(self, values: torch.Tensor | None) -> torch.Tensor | None:
        """``[n, C]`` rows of every process, in process order ``[n * processes, max C]`` (zero padding, outside
        every mask); the tensor itself on one process."""
        acc = self.trainer.accelerator
        if values is None or acc.num_processes == 1:
            return values
        return acc.gather(acc.pad_across_processes(values, dim=1, pad_index=0))

    def estimated(self, batch: dict, ctx: BatchContext) -> None:
        """The zero-signal monitor's input: per group, neither the advantages nor a token bonus move the policy (the
        token path's bonus moves every group whose gate is open)."""
        result, zero_std = ctx.distill, self.trainer.metrics(ctx.mode)["frac_reward_zero_std"]
        if result is None or not zero_std:  # whole batch: groups intact
            return
        group = self.trainer.num_generations if ctx.mode == "train" else self.trainer.num_generations_eval
        flat = ctx.advantages.view(-1, group)
        no_signal = (flat.amax(1) - flat.amin(1)).abs() <= 1e-6
        if result.token_level and self.cfg.has_kl:
            gate = result.gate if result.gate is not None else torch.ones_like(ctx.advantages)
            no_signal &= gate.view(-1, group)[:, 0] == 0
        zero_std[-1] = no_signal.float().mean().item()

    def batch_keys(self, ctx: BatchContext) -> dict[str, bool]:
        d = self.cfg
        token_path = d is not None and not d.use_full_reward_baseline
        return {"distill_teacher_tokens": token_path and d.teacher_tau > 0,
                "distill_gate": token_path and d.kl_only_incorrect}

    # ------------------------------------------------------------------ loss stage: the token path's KL bonus
    @contextmanager
    def around_loss(self, inputs: dict):
        """On the token path, the per-token bonus is added to this micro-batch's advantages right after the loss's
        own log-prob forward (`loss_logps`), for TRL's loss and the off-policy one alike; the advantages are
        restored after (the micro-batch may be trained on again)."""
        if self.cfg is None or self.cfg.use_full_reward_baseline:
            yield
            return
        advantages = inputs["advantages"]
        self._bonus = True
        try:
            yield
        finally:
            inputs["advantages"] = advantages
            self._bonus = False

    def loss_logps(self, inputs: dict, logps: torch.Tensor) -> None:
        if not self._bonus:
            return
        self._bonus = False
        mask = loss_mask(inputs)
        bonus = token_kl_bonus(inputs.get("distill_lp_teacher"), logps, mask, self.cfg, inputs.get("distill_gate"))
        advantages = inputs["advantages"]
        inputs["advantages"] = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages) + bonus
        self.trainer.metrics()["distill/token_bonus"].append((bonus.sum() / mask.sum().clamp(min=1)).item())


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
