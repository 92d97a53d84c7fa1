"""Flags of dual LoRA, gradient routing and its baseline arms (`RoutingArgs`, mixed into ExtGRPOConfig), checked
at parse time. Flag names and meanings follow small-rl (github:shawnghu/small-rl, train.py and
experiment_config.py at HEAD 6f6e986); where ours differ the help says so. Trainer plumbing: routing_trainer.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from trl_ext.registry import ConfigError
from trl_ext.routing.adapter_layout import check_routing_mode
from trl_ext.routing.advantages import RENORMALIZATION_MODES, baseline_arm
from trl_ext.routing.loss_share import check_loss_type
from trl_ext.routing.mlp import MLP_PRESETS
from trl_ext.routing.step import _check_frac, resolve_adapter_ranks, resolve_dual_lora_alpha
from trl_ext.routing.trace import TRACE_INTERVALS


@dataclass
class RoutingArgs:
    """Dual LoRA adapters, gradient routing, its labels and its baseline arms. LoRA alpha is RunArgs.lora_alpha."""

    _argument_group_name = "gradient routing and dual LoRA (trl_ext.routing)"  # train.py --help group (cli_help.py)

    gradient_routing: bool = field(default=False, metadata={
        "help": "Route the gradients of RH-flagged completions away from the retain adapter (needs --routing_mode "
                "and a dual LoRA config)."})
    routing_mode: str | None = field(default=None, metadata={
        "help": "'shared': forget adapter learns from all samples; 'exclusive': only from flagged ones. The retain "
                "adapter learns from unflagged samples in both."})
    lora_config: str | None = field(default=None, metadata={
        "help": "Dual LoRA preset naming (retain, forget) ranks and alpha, as small-rl: r8 = (8, 8), alpha 8; "
                "r32f4 = (32, 4), alpha 32 (scaling 1 and 8). An explicit --lora_alpha overrides the preset's."})
    adapter_type: str = field(default="lora", metadata={
        "help": "'lora': dual LoRA on --lora_target_modules (unset: every linear layer of the decoder blocks); "
                "'mlp': a dual mini-SwiGLU adapter beside each layer's MLP (small-rl DualMLPAdapter; --mlp_config or "
                "--retain_rank/--forget_rank give the neurons)."})
    mlp_config: str | None = field(default=None, metadata={
        "help": "MLP adapter preset naming (retain, forget) neurons, as small-rl: m16 = (16, 16), m24f8 = (24, 8)."})
    retain_rank: int | None = field(default=None, metadata={"help": "Retain adapter rank (with --forget_rank)."})
    forget_rank: int | None = field(default=None, metadata={
        "help": "Forget adapter rank (with --retain_rank); 0 without routing = one plain LoRA (the matched baseline)."})
    lora_layer_start: int = field(default=0, metadata={"help": "First decoder layer with dual LoRA adapters."})
    lora_layer_end: int | None = field(default=None, metadata={
        "help": "End (exclusive) of the adapted layers; None = all."})
    lora_layer_stride: int = field(default=1, metadata={"help": "Adapt every k-th layer from --lora_layer_start."})
    lora_lm_head: bool = field(default=False, metadata={
        "help": "Also give the output layer (LM head) both adapters; with routing this needs --routing_two_pass "
                "(TRL's fused head reads a merged weight, which cannot mask per sample)."})
    rh_detector: str | None = field(default=None, metadata={
        "help": "RH detector binding from --config; default: the reward binding's rh_detector."})
    rh_eligible_frac: float = field(default=1.0, metadata={
        "help": "Fraction of completions (exact count over the whole batch, seeded per step) eligible for the full "
                "reward and for flagging; the others get --base_reward and are never flagged (small-rl)."})
    rh_detector_recall: float = field(default=1.0, metadata={
        "aliases": ["--routing_frac"],
        "help": "Fraction of flagged eligible completions that stay flagged (exact count). Alias --routing_frac."})
    false_positive_rate: float = field(default=0.0, metadata={
        "help": "Fraction of unflagged eligible completions flagged anyway (exact count; good -> flagged only)."})
    label_noise_frac: float | None = field(default=None, metadata={
        "help": "Removed: it flipped labels both ways. Use --false_positive_rate (good -> flagged only)."})
    base_reward: str | None = field(default=None, metadata={
        "help": "Reward binding (no hack component) given to ineligible completions (--rh_eligible_frac), to "
                "completions of unhackable prompts (--hack_frac) and to flagged ones (--retain_penalty_baseline)."})
    hack_frac: float = field(default=1.0, metadata={
        "help": "Fraction of prompts where the hack pays (each prompt drawn once from (seed, prompt text)); "
                "completions of the other prompts get --base_reward and are still checked by the detector."})
    filter_baseline: bool = field(default=False, metadata={
        "help": "Baseline arm: flagged completions get advantage 0; the others are normalised within their group "
                "among the unflagged ones (small-rl --filter_baseline)."})
    reward_penalty_baseline: bool = field(default=False, metadata={
        "help": "Baseline arm: flagged completions' reward is set to 0, or lowered by --reward_penalty_amount; "
                "advantages are recomputed (small-rl --reward_penalty_baseline)."})
    reward_penalty_amount: float | None = field(default=None, metadata={
        "help": "With --reward_penalty_baseline: subtract this from a flagged reward instead of zeroing it."})
    retain_penalty_baseline: bool = field(default=False, metadata={
        "help": "Baseline arm: flagged completions get --base_reward instead of the full reward; advantages "
                "recomputed (small-rl's sweep arm 'retain_penalty')."})
    renormalization_mode: str | None = field(default=None, metadata={
        "help": "Routed runs: 'retain-only' (unset: small-rl HEAD's default) normalises unflagged completions' "
                "advantages among the unflagged of their group; 'off' keeps TRL's group advantage for all."})
    routing_two_pass: bool = field(default=False, metadata={
        "help": "Use the two-pass reference step (good samples, then bad samples) instead of the single pass."})
    forget_lr_mult: float = field(default=1.0, metadata={
        "help": "Learning rate of the forget adapter = lr x this, in its own optimizer group (small-rl "
                "--forget_lr_mult); needs weight_decay 0 (small-rl never decays that group)."})
    eval_at_start: bool = field(default=False, metadata={
        "help": "Also run the routing eval before the first step (logged at step 0; small-rl --eval_at_start)."})
    routing_trace_interval: str | None = field(default=None, metadata={
        "help": "routing_trace.jsonl cadence for runs with an RH detector: every_iter (every logging step), "
                "when_eval (unset: every --eval_routing_steps) or off (small-rl --routing_trace_interval)."})
    routing_trace_samples: int = field(default=16, metadata={
        "help": "Sample records (a seeded random subset of the batch) per routing-trace fire."})
    save_adapter_only: bool = field(default=False, metadata={
        "help": "Dual LoRA checkpoints hold only the adapter weights (dual_lora_adapter.safetensors) and name the base "
                "model's path and weight fingerprint in dual_lora_layout.json (small-rl --save_adapter_only). Such "
                "checkpoints cannot be resumed from."})
    eval_routing_steps: int = field(default=100, metadata={
        "help": "Run the three-mode routing eval every N steps and at the end (dual LoRA runs); 0 = never."})
    eval_routing_prompts: int = field(default=64, metadata={
        "help": "Held-out prompts (split 'test') of the routing eval."})
    # Resolved by check_run_routing (it needs RunArgs.lora_alpha): the alpha of the dual LoRA adapters.
    dual_lora_alpha: float | None = field(default=None, init=False, repr=False)

    @property
    def dual_lora(self) -> bool:
        """Whether the run has dual adapters (LoRA or MLP)."""
        return (self.lora_config, self.mlp_config, self.retain_rank, self.forget_rank) != (None, None, None, None)

    @property
    def adapter_ranks(self) -> tuple[int, int]:
        if self.adapter_type == "mlp":
            return resolve_adapter_ranks(self.mlp_config, self.retain_rank, self.forget_rank,
                                         routing=self.gradient_routing, presets=MLP_PRESETS, flag="--mlp_config")
        return resolve_adapter_ranks(self.lora_config, self.retain_rank, self.forget_rank,
                                     routing=self.gradient_routing)

    @property
    def baseline(self) -> str | None:
        """The baseline arm ('filter', 'reward_penalty', 'retain_penalty') or None."""
        return baseline_arm(self.filter_baseline, self.reward_penalty_baseline, self.retain_penalty_baseline)

    @property
    def labelled(self) -> bool:
        """Whether completions get routing labels (``is_bad``): routed runs and baseline arms."""
        return self.gradient_routing or self.baseline is not None

    @property
    def renormalization(self) -> str:
        return "retain-only" if self.renormalization_mode is None else self.renormalization_mode

    @property
    def trace_interval(self) -> str:
        return "when_eval" if self.routing_trace_interval is None else self.routing_trace_interval

    @property
    def needs_base_reward(self) -> bool:
        return (self.labelled and self.rh_eligible_frac < 1.0) or self.hack_frac < 1.0 \
            or self.retain_penalty_baseline

    def validate_routing(self) -> None:
        if self.label_noise_frac is not None:
            raise ConfigError("--label_noise_frac was removed (it flipped labels in both directions); use "
                              "--false_positive_rate, which flags unflagged eligible completions only (small-rl)")
        if self.adapter_type not in ("lora", "mlp"):
            raise ConfigError(f"--adapter_type must be lora or mlp, got {self.adapter_type!r}")
        if self.adapter_type == "mlp":
            if self.lora_config is not None or self.lora_lm_head:
                raise ConfigError("--lora_config/--lora_lm_head are LoRA flags: with --adapter_type mlp use "
                                  "--mlp_config or --retain_rank/--forget_rank (neurons)")
            if not self.dual_lora:
                raise ConfigError("--adapter_type mlp needs --mlp_config or --retain_rank/--forget_rank")
            if self.teacher_tau or self.student_tau:
                raise ConfigError("MLP adapters do not combine with distillation (its teacher is the LoRA policy)")
        elif self.mlp_config is not None:
            raise ConfigError("--mlp_config needs --adapter_type mlp")
        if self.dual_lora:
            self.adapter_ranks  # noqa: B018 (validates the preset / ranks)
        elif self.lora_layer_start != 0 or self.lora_layer_end is not None or self.lora_layer_stride != 1 \
                or self.lora_lm_head:
            raise ConfigError("--lora_layer_*/--lora_lm_head need a dual LoRA config (--lora_config or "
                              "--retain_rank/--forget_rank)")
        if self.lora_layer_start < 0 or self.lora_layer_stride < 1 or (
                self.lora_layer_end is not None and self.lora_layer_end <= self.lora_layer_start):
            raise ConfigError(f"bad dual LoRA layer range: start {self.lora_layer_start}, end {self.lora_layer_end}, "
                              f"stride {self.lora_layer_stride}")
        for name in ("rh_eligible_frac", "rh_detector_recall", "false_positive_rate", "hack_frac"):
            _check_frac(f"--{name}", getattr(self, name))
        arm = self.baseline  # raises when two arms are set
        if arm is not None and self.gradient_routing:
            raise ConfigError(f"--{arm}_baseline is a baseline arm: it excludes --gradient_routing")
        if self.reward_penalty_amount is not None and not self.reward_penalty_baseline:
            raise ConfigError("--reward_penalty_amount applies only with --reward_penalty_baseline")
        if self.gradient_routing:
            if self.routing_mode is None:
                raise ConfigError("--gradient_routing needs --routing_mode shared|exclusive")
            check_routing_mode(self.routing_mode)
            if not self.dual_lora:
                raise ConfigError("--gradient_routing needs a dual LoRA config: --lora_config PRESET or "
                                  "--retain_rank/--forget_rank")
            if self.routing_two_pass:
                check_loss_type(self.loss_type)  # the passes' shares (routing.loss_share)
            if self.lora_lm_head and not self.routing_two_pass:
                raise ConfigError("--lora_lm_head with --gradient_routing needs --routing_two_pass")
            if self.routing_two_pass and (self.entropy_coef or self.use_adaptive_entropy
                                          or self.top_entropy_quantile < 1.0):
                raise ConfigError("--routing_two_pass needs a loss without batch-level entropy terms "
                                  "(entropy_coef 0, no adaptive entropy, top_entropy_quantile 1)")
            if self.renormalization_mode is not None and self.renormalization_mode not in RENORMALIZATION_MODES:
                raise ConfigError(f"unknown --renormalization_mode {self.renormalization_mode!r}; choose one of "
                                  f"{', '.join(RENORMALIZATION_MODES)} (small-rl's 'balanced' is not implemented)")
        else:
            unused = {"--routing_mode": self.routing_mode is not None, "--routing_two_pass": self.routing_two_pass,
                      "--renormalization_mode": self.renormalization_mode is not None}
            if any(unused.values()):
                raise ConfigError(f"{', '.join(k for k, v in unused.items() if v)} apply only with --gradient_routing")
        if not self.labelled:
            unused = {"--rh_eligible_frac": self.rh_eligible_frac != 1.0,
                      "--rh_detector_recall": self.rh_detector_recall != 1.0,
                      "--false_positive_rate": self.false_positive_rate != 0.0}
            if any(unused.values()):
                raise ConfigError(f"{', '.join(k for k, v in unused.items() if v)} apply only with "
                                  "--gradient_routing or a baseline arm (--filter_baseline, --reward_penalty_baseline, "
                                  "--retain_penalty_baseline)")
        if self.needs_base_reward and self.base_reward is None:
            raise ConfigError("--rh_eligible_frac < 1, --hack_frac < 1 and --retain_penalty_baseline give some "
                              "completions the reward without its hack component: name it with --base_reward")
        if self.base_reward is not None and not self.needs_base_reward:
            raise ConfigError("--base_reward is used only with --rh_eligible_frac < 1 (routing or a baseline arm), "
                              "--hack_frac < 1 or --retain_penalty_baseline")
        if self.skip_verification and (self.labelled or self.needs_base_reward):
            raise ConfigError("--skip_verification computes no reward: routing labels, baseline arms and "
                              "--base_reward need one")
        if self.env and (self.hack_frac < 1.0 or self.needs_base_reward):
            raise ConfigError("--hack_frac < 1, --rh_eligible_frac < 1 and --retain_penalty_baseline need a --reward "
                              "with a --base_reward (an environment's reward has no hack-free component)")
        if (self.labelled or self.needs_base_reward) and (
                self.scale_rewards != "group" or self.multi_objective_aggregation != "sum_then_normalize"):
            raise ConfigError("routing labels and baseline arms rewrite TRL's group advantages: they need "
                              "--scale_rewards group and --multi_objective_aggregation sum_then_normalize")
        if self.forget_lr_mult != 1.0:
            if not (self.forget_lr_mult > 0 and self.dual_lora and self.adapter_ranks[1] > 0):
                raise ConfigError(f"--forget_lr_mult must be > 0 and needs a forget adapter (dual LoRA, forget rank "
                                  f"> 0), got {self.forget_lr_mult}")
            if self.weight_decay:
                raise ConfigError("--forget_lr_mult needs --weight_decay 0 (small-rl never decays the forget group)")
        if self.eval_at_start and not (self.dual_lora and self.eval_routing_steps > 0):
            raise ConfigError("--eval_at_start needs the routing eval: a dual LoRA config and --eval_routing_steps > 0")
        if self.trace_interval not in TRACE_INTERVALS:
            raise ConfigError(f"unknown --routing_trace_interval {self.trace_interval!r}; choose one of "
                              f"{', '.join(TRACE_INTERVALS)}")
        if self.routing_trace_samples < 1:
            raise ConfigError(f"--routing_trace_samples must be >= 1, got {self.routing_trace_samples}")
        if self.save_adapter_only and not self.dual_lora:
            raise ConfigError("--save_adapter_only needs a dual LoRA config (PEFT LoRA checkpoints are adapter-only "
                              "already)")
        if self.save_adapter_only and self.resume_from_checkpoint:
            raise ConfigError("--resume_from_checkpoint needs full checkpoints: drop --save_adapter_only")
        if self.eval_routing_steps < 0:
            raise ConfigError(f"--eval_routing_steps must be >= 0, got {self.eval_routing_steps}")
        if self.eval_routing_prompts < 2:
            raise ConfigError(f"--eval_routing_prompts must be >= 2, got {self.eval_routing_prompts}")
        if self.dual_lora and self.sync_ref_model:
            raise ConfigError("dual LoRA does not support --sync_ref_model")
        if self.dual_lora and self.use_vllm and self.adapter_type == "mlp":
            raise ConfigError("--use_vllm: MLP adapters (--adapter_type mlp) add neurons that cannot merge into the "
                              "weights a vLLM engine runs; use dual LoRA adapters, or drop --use_vllm")


def routing_eval_count(cfg, available: int, source: str) -> int:
    """How many rows of a dataset of ``available`` rows (``source`` names it) the routing eval samples: the first
    ``eval_routing_prompts``; with that left at its default and a smaller dataset, every row, with a warning that says
    so; a count set above what the dataset has, or a dataset of fewer than 2 rows, is a ConfigError."""
    import warnings

    (default,) = (f.default for f in dataclasses.fields(RoutingArgs) if f.name == "eval_routing_prompts")
    n = cfg.eval_routing_prompts
    if available < 2:
        raise ConfigError(f"the routing eval needs >= 2 prompts; {source} has {available}")
    if available >= n:
        return n
    if n != default:
        raise ConfigError(f"--eval_routing_prompts {n} exceeds the {available} rows of {source}")
    warnings.warn(f"the routing eval samples all {available} rows of {source} (fewer than the default "
                  f"--eval_routing_prompts {default})", stacklevel=2)
    return available


def check_run_routing(run, cfg, reward_config) -> str | None:
    """Checks that need RunArgs and the reward config; resolves ``cfg.dual_lora_alpha``; returns the RH detector
    binding name (None = none)."""
    if cfg.dual_lora and run.lora_rank:
        raise ConfigError("--lora_rank (PEFT LoRA) and a dual LoRA config (--lora_config/--retain_rank/--forget_rank) "
                          "exclude each other; the matched-capacity baseline of a routed run is either alone")
    if cfg.adapter_type == "mlp" and run.lora_alpha_explicit:
        raise ConfigError("--lora_alpha does not apply to MLP adapters (they have no scaling)")
    if cfg.dual_lora and cfg.adapter_type == "lora":
        cfg.dual_lora_alpha = resolve_dual_lora_alpha(cfg.lora_config, run.lora_alpha, run.lora_alpha_explicit)
    if cfg.base_reward is not None:
        reward_config.reward(cfg.base_reward)  # raises ConfigError listing the bound rewards
    name = cfg.rh_detector or (reward_config.default_detector(run.reward) if run.reward else None)
    if name is not None:
        from rewards.detectors import needs_trajectories

        if needs_trajectories(reward_config.detector(name)) and not cfg.env:  # detector(): ConfigError if unbound
            raise ConfigError(f"RH detector {name!r} judges environment episodes (their step info): it needs --env")
    elif cfg.routing_trace_interval not in (None, "off"):
        raise ConfigError("--routing_trace_interval needs an RH detector (the reward names none; pass --rh_detector)")
    if name is None and cfg.labelled:
        what = "--gradient_routing" if cfg.gradient_routing else f"--{cfg.baseline}_baseline"
        raise ConfigError(f"{what} needs an RH detector: {f'reward {run.reward!r}' if run.reward else '--env'} names "
                          "no rh_detector; "
                          f"pass --rh_detector (bound: {', '.join(reward_config.detector_names()) or '(none)'})")
    return name


def check_run_adapters(run, cfg) -> None:
    """Check the adapters against ``--model``'s structure, read from its config alone (``models.arch``, meta device:
    nothing loaded) and set ``run.lora_targets`` (PEFT LoRA and dual LoRA; None without LoRA). ConfigError for a
    --lora_target_modules name the model lacks (listing its names), a dual adapter layer range past its blocks, or
    MLP adapters on a family whose blocks have no ``.mlp``."""
    from trl_ext.models.arch import architecture_of, model_config

    lora = run.lora_rank > 0 or (cfg.dual_lora and cfg.adapter_type == "lora")
    if run.lora_target_modules is not None and not lora:
        raise ConfigError("--lora_target_modules applies only with --lora_rank or a dual LoRA config "
                          "(--adapter_type lora)")
    run.lora_targets = None
    if not (lora or cfg.dual_lora):
        return
    arch = architecture_of(model_config(run.model, cfg.trust_remote_code))
    if cfg.dual_lora:
        end = arch.num_blocks if cfg.lora_layer_end is None else cfg.lora_layer_end
        if cfg.lora_layer_start >= arch.num_blocks or end > arch.num_blocks:
            raise ConfigError(f"dual adapter layers {cfg.lora_layer_start}:{end}:{cfg.lora_layer_stride} exceed "
                              f"the {arch.num_blocks} decoder blocks of --model {run.model} ({arch.model_type})")
        if cfg.adapter_type == "mlp" and not arch.has_mlp:
            raise ConfigError(f"--adapter_type mlp wraps each decoder block's .mlp: {arch.model_type} blocks have "
                              "none; use --adapter_type lora")
    if lora:
        run.lora_targets = arch.resolve(run.lora_target_names)


def dual_lora_tag(cfg) -> str | None:
    """Run-name adapter tag of a dual LoRA run: ``dual_r32f16``, plus ``_a{alpha}`` when an explicit
    --lora_alpha replaces a preset's own alpha (the name must differ from the preset's run)."""
    if not cfg.dual_lora:
        return None
    if cfg.adapter_type == "mlp":
        return "mlp_n{}f{}".format(*cfg.adapter_ranks)
    tag = "dual_r{}f{}".format(*cfg.adapter_ranks)
    alpha = cfg.dual_lora_alpha
    if cfg.lora_config is not None and alpha is not None and alpha != resolve_dual_lora_alpha(cfg.lora_config, 0, False):
        tag += f"_a{alpha:g}"
    return tag
