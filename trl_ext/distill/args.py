"""The flags of teacher context distillation (`DistillArgs`, mixed into ExtGRPOConfig) and the checks that need
the run's adapters (`check_run_distill`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trl_ext.distill.advantages import DistillConfig
from trl_ext.launch.processes import launched_processes
from trl_ext.registry import ConfigError


@dataclass
class DistillArgs:
    """Flags of teacher context distillation (mixed into ExtGRPOConfig)."""

    _argument_group_name = "context distillation (trl_ext.distill)"  # train.py --help group (cli_help.py)

    adv_tau: float = field(default=1.0, metadata={
        "help": "Weight of the task (verifier) reward in the distillation reward (seed 002's trainer.loss.adv_tau); "
                "0 = pure distillation. The off-policy loss's own advantage weight is --loss_adv_tau."})

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
            if self.adv_tau != 1.0:
                raise ConfigError(f"--adv_tau {self.adv_tau} weights the task reward of distillation: it needs "
                                  "--teacher_tau > 0, --student_tau > 0 or --skip_verification (the off-policy "
                                  "loss's advantage weight is --loss_adv_tau)")
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
        processes, _ = launched_processes()  # groups are formed over the global batch (TRL's sampler)
        self.distill_config().validate(self.num_generations, self.per_device_train_batch_size * processes,
                                       teacher_available)
        if not self.temperature > 0:
            raise ConfigError(f"distillation scores log-probs at the sampling temperature: --temperature must be > 0, "
                              f"got {self.temperature}")
        if not self.use_full_reward_baseline and self.use_liger_kernel:
            raise ConfigError("--no_use_full_reward_baseline adds the KL terms in the loss: not with "
                              "--use_liger_kernel")


def has_teacher(cfg, adapters: bool) -> bool:
    """Whether the run has a teacher: --teacher_model, a teacher server (--teacher_server_url: layout.py moves
    --teacher_model onto it), adapters that can be disabled (``adapters``: PEFT LoRA, or dual LoRA), or TRL's
    reference model (beta > 0). The one answer train.py's plan and the Python API give."""
    return bool(cfg.teacher_model or cfg.teacher_server_url) or adapters or cfg.dual_lora or cfg.beta > 0


def teacher_available(run, cfg) -> bool:
    """`has_teacher` of a train.py run (its adapters: --lora_rank)."""
    return has_teacher(cfg, run.lora_rank > 0)


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
