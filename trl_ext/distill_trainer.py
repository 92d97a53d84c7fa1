"""Trainer plumbing of teacher context distillation (seed 002; prime-rl fork 'contextual_learning'): the flags
(`DistillArgs`), the GRPOTrainer hooks (`DistillMixin`) and the pre-training student-vs-teacher eval
(`eval_baseline`). The math (teacher inputs, log-probs, reward composition, gate) lives in ``trl_ext.distill``.

One step with distillation on (``--teacher_tau > 0``, ``--student_tau > 0`` or ``--skip_verification``):
1. `_calculate_rewards`: the task reward as TRL computes it, kept for the composition; with
   ``--skip_verification`` no reward function is called (zeros go to TRL's bookkeeping only).
2. `_generate_and_score_completions` (the whole generation batch, groups intact): the teacher scores the
   agent tokens of the sampled completions (environment tokens are read, not scored) on ``context + prompt``
   (plain text) or on the chat prompt with the context as its system message (chat prompts, `teacher_messages`); the student's sampling log-probs are the behaviour log-probs
   of the batch when it has them (off-policy rollouts, vLLM), else TRL's ``old_per_token_logps``, else one
   no-grad forward of the policy (same temperature). ``distill_advantages`` replaces TRL's advantages (no std
   scaling). Token path: ``distill_lp_teacher`` [B, C] and ``distill_gate`` [B] join the batch dict, so TRL's
   shuffle and split keep them aligned.
3. Token path (``--no_use_full_reward_baseline``) in the loss: right after the loss computes the current
   log-probs, ``token_kl_bonus`` is added to the advantages of that micro-batch (the loss, TRL's or the
   off-policy one, reads the advantages after its log-prob forward).

The teacher, in order: ``--teacher_model`` (a second, frozen model: one more copy of its weights in memory);
else the policy with its adapters disabled (PEFT LoRA, dual LoRA: no second copy); else, full fine-tune with
``--beta > 0``, TRL's reference model (the initial weights it already holds). A full fine-tune with beta 0 and no
``--teacher_model`` has no teacher: an error, rather than a silent extra copy of the model.

``--adv_tau`` is one field shared with off-policy training. Here it weights the task reward inside the
advantages (both paths); the off-policy loss then uses the advantages as they are (its adv_tau is 1), as
prime-rl's loss does when the advantages already carry the taus.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn
from trl.data_utils import is_conversational
from trl.trainer.utils import pad

from trl_ext.distill import DistillConfig, build_teacher_inputs, distill_advantages, distill_metrics, encode_context
from trl_ext.distill import chat_teacher_prompt, teacher_batch, teacher_logprobs, teacher_messages, token_kl_bonus
from trl_ext.registry import ConfigError
from trl_ext.runs.rollouts import masked_sums

OFFPOLICY_ADV_TAU = 1.0
"""The off-policy loss's advantage weight while distilling: adv_tau is already inside the advantages."""


@dataclass
class DistillArgs:
    """Flags of teacher context distillation (mixed into ExtGRPOConfig; ``adv_tau`` is OffPolicyArgs')."""

    teacher_model: str = field(default="", metadata={
        "help": "Teacher: a local path, a hub id or 'builtin', loaded as a second frozen model. Empty: the policy "
                "with adapters disabled (LoRA), or TRL's reference model (full fine-tune, --beta > 0)."})
    teacher_context: str = field(default="", metadata={
        "help": "Text prepended to the student's prompt for the teacher (empty = standard distillation)."})
    teacher_tau: float = field(default=0.0, metadata={
        "help": "Weight of the teacher log-prob term: reward + teacher_tau * sum(log p_teacher)."})
    student_tau: float = field(default=0.0, metadata={
        "help": "Weight of the student log-prob term (an entropy bonus): reward - student_tau * sum(log p_student)."})
    use_full_reward_baseline: bool = field(default=True, metadata={
        "help": "KL terms in the sequence reward and its group baseline (advantages sum to 0 per group); "
                "--no_use_full_reward_baseline: task-only advantages plus the KL terms per token in the loss."})
    kl_only_incorrect: bool = field(default=False, metadata={
        "help": "Gate the KL terms by 1 - group mean task reward (task rewards in [0, 1]); an error without KL."})
    skip_verification: bool = field(default=False, metadata={
        "help": "Pure distillation: no task reward function is called (needs --adv_tau 0)."})
    eval_baseline: bool = field(default=False, metadata={
        "help": "Before training, sample the student (prompt) and the teacher (context + prompt) on held-out "
                "prompts and log the task reward and RH detector rates of both."})
    eval_baseline_prompts: int = field(default=64, metadata={
        "help": "Held-out prompts (split 'test') of --eval_baseline."})

    @property
    def distill_on(self) -> bool:
        return self.teacher_tau > 0 or self.student_tau > 0 or self.skip_verification

    def distill_config(self) -> DistillConfig:
        return DistillConfig(self.adv_tau, self.teacher_tau, self.student_tau, self.use_full_reward_baseline,
                             self.kl_only_incorrect, self.skip_verification, self.teacher_context)

    def validate_distill(self, teacher_available: bool = True) -> None:
        """Raise ConfigError on a bad combination; ``teacher_available`` is known once RunArgs are parsed."""
        for name in ("teacher_tau", "student_tau"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"--{name} must be a finite number >= 0, got {value}")
        if self.eval_baseline_prompts < 1:
            raise ConfigError(f"--eval_baseline_prompts must be >= 1, got {self.eval_baseline_prompts}")
        has_teacher_flag = bool(self.teacher_model or self.teacher_context)
        if self.eval_baseline and not (self.distill_on or has_teacher_flag):
            raise ConfigError("--eval_baseline compares the student with a teacher: set --teacher_context or "
                              "--teacher_model")
        if self.eval_baseline and self.use_vllm:
            raise ConfigError("--eval_baseline samples with transformers' generate: not with --use_vllm")
        if not self.distill_on:
            if self.kl_only_incorrect:
                raise ConfigError("--kl_only_incorrect needs --teacher_tau > 0 or --student_tau > 0: there is no KL "
                                  "term to gate")
            unused = {"--no_use_full_reward_baseline": not self.use_full_reward_baseline,
                      "--teacher_model/--teacher_context": has_teacher_flag and not self.eval_baseline}
            if any(unused.values()):
                raise ConfigError(f"{', '.join(k for k, v in unused.items() if v)} apply only with distillation "
                                  "(--teacher_tau > 0, --student_tau > 0 or --skip_verification)")
            return
        if self.teacher_tau == 0 and has_teacher_flag and not self.eval_baseline:
            raise ConfigError("--teacher_model/--teacher_context have no effect with --teacher_tau 0")
        self.distill_config().validate(self.num_generations, self.per_device_train_batch_size, teacher_available)
        if not self.temperature > 0:
            raise ConfigError(f"distillation scores log-probs at the sampling temperature: --temperature must be > 0, "
                              f"got {self.temperature}")
        if not self.use_full_reward_baseline and self.use_liger_kernel:
            raise ConfigError("--no_use_full_reward_baseline adds the KL terms in the loss: not with "
                              "--use_liger_kernel")

    def validate_offpolicy(self) -> None:
        """Off-policy's check, with adv_tau read as the distillation's task weight (see the module docstring)."""
        if not self.distill_on:
            return super().validate_offpolicy()
        adv_tau, self.adv_tau = self.adv_tau, OFFPOLICY_ADV_TAU
        try:
            super().validate_offpolicy()
        finally:
            self.adv_tau = adv_tau


def teacher_available(run, cfg) -> bool:
    """A teacher exists without --teacher_model when adapters can be disabled or TRL holds a reference model."""
    return bool(cfg.teacher_model) or run.lora_rank > 0 or cfg.dual_lora or cfg.beta > 0


def check_run_distill(run, cfg) -> None:
    """Checks that need RunArgs (adapters decide whether a default teacher exists)."""
    if cfg.eval_baseline and not run.reward:
        raise ConfigError("--eval_baseline scores story prompts with the --reward binding: not with --env")
    if cfg.teacher_model:
        from trl_ext.models import resolve_model_arg

        resolve_model_arg(cfg.teacher_model)
    needs = f"--teacher_tau {cfg.teacher_tau} > 0" if cfg.distill_on and cfg.teacher_tau > 0 else (
        "--eval_baseline" if cfg.eval_baseline else None)
    if needs and not teacher_available(run, cfg):
        raise ConfigError(f"{needs} needs a teacher: --teacher_model, adapters (--lora_rank or a dual LoRA config: "
                          "the base weights teach), or --beta > 0 (a full fine-tune's teacher is then TRL's reference "
                          "model, the initial weights)")
    if needs and not (cfg.teacher_model or run.lora_rank or cfg.dual_lora) and cfg.sync_ref_model:
        raise ConfigError("the teacher is TRL's reference model, which --sync_ref_model moves: set --teacher_model")
    cfg.validate_distill(teacher_available(run, cfg))


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
        if not on:
            return
        if self.accelerator.num_processes != 1:
            raise ConfigError("distillation computes group baselines on one process's batch: use a single process")
        if getattr(self, "offpolicy_cfg", None) is not None:
            self.offpolicy_cfg = replace(self.offpolicy_cfg, adv_tau=OFFPOLICY_ADV_TAU)

    # ------------------------------------------------------------------ teacher
    @contextmanager
    def teacher_scope(self):
        """The teacher model for the body (adapters disabled while it runs, when it is the policy)."""
        from accelerate.utils import is_peft_model

        from trl_ext.routing import DualLoRALinear, adapters_disabled

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
        with self.teacher_scope() as teacher:
            return teacher_logprobs(teacher, ids, mask, keep, self.temperature, self.args.per_device_train_batch_size,
                                    score_mask=_loss_mask(batch))  # fmt: skip

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

    # ------------------------------------------------------------------ rewards and advantages
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        if self.distill_cfg is None:
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._distill_task = None
        if self.distill_cfg.skip_verification:  # pure distillation: no reward function is called
            return torch.zeros(len(prompts), len(self.reward_funcs), device=self.accelerator.device)
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if torch.isnan(rewards).any():
            raise ValueError("a task reward function returned None: distillation needs a task reward for every sample")
        self._distill_task = (rewards * self.reward_weights.to(rewards.device).unsqueeze(0)).sum(1)
        return rewards

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        cfg = self.distill_cfg
        if cfg is None:
            return batch
        mode = "train" if self.model.training else "eval"
        mask = _loss_mask(batch)
        prompts = [row["prompt"] for row in inputs]
        lp_teacher = self.score_teacher(batch, prompts) if cfg.teacher_tau > 0 else None
        lp_student = self.student_sampling_logps(batch) if cfg.has_kl else None
        group = self.num_generations if mode == "train" else self.num_generations_eval
        task, self._distill_task = self._distill_task, None
        result = distill_advantages(task, lp_teacher, lp_student, mask, cfg, group)
        batch["advantages"] = result.advantages.to(batch["advantages"].dtype)
        columns = getattr(self, "rollout_columns", {})  # ExtGRPOTrainer's per-sample values for --save_rollouts
        for name, lp in (("teacher_logprob_sum", lp_teacher), ("student_logprob_sum", lp_student)):
            if lp is not None:
                columns[name] = masked_sums(lp, mask)
        if result.token_level:
            if lp_teacher is not None:
                batch["distill_lp_teacher"] = lp_teacher
            if result.gate is not None:
                batch["distill_gate"] = result.gate
        metrics = self._metrics[mode]
        for name, value in distill_metrics(result, lp_teacher, lp_student, mask).items():
            metrics[name].append(value)
        # the zero-signal monitor reads this: groups where neither the advantages nor a token bonus move the policy
        flat = result.advantages.view(-1, group)
        no_signal = (flat.amax(1) - flat.amin(1)).abs() <= 1e-6
        if result.token_level and cfg.has_kl:  # the per-token bonus moves every group whose gate is open
            gate = result.gate if result.gate is not None else torch.ones_like(result.advantages)
            no_signal &= gate.view(-1, group)[:, 0] == 0
        if metrics["frac_reward_zero_std"]:
            metrics["frac_reward_zero_std"][-1] = no_signal.float().mean().item()
        return batch

    # ------------------------------------------------------------------ token path: the KL bonus in the loss
    def _compute_loss(self, model, inputs):
        if self.distill_cfg is None or self.distill_cfg.use_full_reward_baseline:
            return super()._compute_loss(model, inputs)
        advantages = inputs["advantages"]
        self._distill_loss_inputs = inputs
        try:
            return super()._compute_loss(model, inputs)
        finally:  # the same micro-batch may be trained on again (num_iterations > 1): restore it
            inputs["advantages"] = advantages
            self._distill_loss_inputs = None

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        inputs, self._distill_loss_inputs = self._distill_loss_inputs, None
        if inputs is None:  # not the loss's own forward
            return out
        mask = _loss_mask(inputs)
        bonus = token_kl_bonus(inputs.get("distill_lp_teacher"), out[0], mask, self.distill_cfg,
                               inputs.get("distill_gate"))
        advantages = inputs["advantages"]
        inputs["advantages"] = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages) + bonus
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["distill/token_bonus"].append((bonus.sum() / mask.sum().clamp(min=1)).item())
        return out


def _loss_mask(batch: dict) -> torch.Tensor:
    return batch["completion_mask"] if "tool_mask" not in batch else batch["completion_mask"] * batch["tool_mask"]


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


# ---------------------------------------------------------------------------------- eval baseline
@torch.no_grad()
def eval_baseline(trainer, prompts: list[str], scorers: dict[str, callable]) -> dict[str, dict[str, float]]:
    """Student (prompt) vs teacher (context + prompt): one sample per prompt each, with the trainer's generation
    config, scored by every ``scorers`` entry (``list[str] -> list[float | bool]``, mean reported). Seeded by
    ``--seed`` without touching the training RNG. Prints one line per side and writes
    ``{output_dir}/eval_baseline.json``."""
    policy = trainer.accelerator.unwrap_model(trainer.model)
    ids = [torch.tensor(row, dtype=torch.long) for row in trainer._tokenize_prompts(prompts)[0]]
    device = trainer.accelerator.device
    prompt_ids = pad(ids, padding_value=trainer._tokenizer.pad_token_id, padding_side="left").to(device)
    prompt_mask = pad([torch.ones_like(row) for row in ids], padding_value=0, padding_side="left").to(device)
    results = {}
    was_training = policy.training
    policy.eval()
    try:
        for side in ("student", "teacher"):
            teacher_side = side == "teacher"
            scope = trainer.teacher_scope() if teacher_side else nullcontext(policy)
            x, m = trainer.teacher_prompt_ids(prompt_ids, prompt_mask) if teacher_side else (prompt_ids, prompt_mask)
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), scope as model:
                torch.manual_seed(trainer.args.seed)
                out = model.generate(input_ids=x, attention_mask=m, generation_config=trainer.generation_config)
            texts = trainer.processing_class.batch_decode(out[:, x.size(1):], skip_special_tokens=True)
            results[side] = {name: sum(float(v) for v in fn(texts)) / len(texts) for name, fn in scorers.items()}
            print(f"eval_baseline {side}: " + " ".join(f"{k}={v:.4f}" for k, v in results[side].items())
                  + f" | sample: {prompts[0]} ||| {texts[0]}", flush=True)
    finally:
        policy.train(was_training)
    Path(trainer.args.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(trainer.args.output_dir) / "eval_baseline.json").write_text(json.dumps(results, indent=2))
    return results


def run_eval_baseline(trainer, run, reward_config, source: str) -> dict[str, dict[str, float]]:
    """`eval_baseline` on ``--eval_baseline_prompts`` held-out prompts (``load_prompts(source, ...)``, split
    'test') with the task reward and the RH detector."""
    from environments.stories import load_prompts

    cfg = trainer.args
    prompts = load_prompts(source, trainer.processing_class, run.prompt_length, "test", cfg.eval_baseline_prompts,
                           cfg.seed)
    scorers = {f"task/{run.reward}": reward_config.reward(run.reward)}
    detector = getattr(cfg, "rh_detector", None) or reward_config.default_detector(run.reward)
    if detector is not None:
        scorers[f"rh/{detector}"] = reward_config.detector(detector)
    return eval_baseline(trainer, list(prompts["prompt"]), scorers)
