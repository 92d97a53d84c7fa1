"""Configuration: every project default and every new field, each documented once.

`RunArgs` holds what a run is made of (model, reward, prompts, adapters, logging destinations);
`ExtGRPOConfig` extends TRL's `GRPOConfig` with the trainer extensions; TRL's own fields keep TRL's defaults (a
drop-in GRPOConfig), and train.py applies the project's validated defaults (`TRAIN_DEFAULTS`: seed 004's sweep, beta
0.02, batch 32, 16 generations, lr 1e-5, 2000 steps). Every GRPOConfig / TrainingArguments field is a train.py flag.

All validation lives in ``__post_init__``: a bad combination raises `ConfigError` while the command
line is parsed, before any model is loaded (the CLIs map it to exit code 2).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

from trl import GRPOConfig

from environments.stories import BUILTIN_PROMPTS
from trl_ext.data.load import DEFAULT_PROMPT_COLUMN, DEFAULT_SPLIT
from trl_ext.distill.args import DistillArgs
from trl_ext.env.args import EnvArgs
from trl_ext.estimator import check_estimator_flags
from trl_ext.generation.args import GenerationArgs
from trl_ext.launch.processes import check_cfg_processes, check_run_processes, multi_process_settings
from trl_ext.launch.sharding import check_cfg_sharding
from trl_ext.models.arch import LoraTargets
from trl_ext.offpolicy.args import OffPolicyArgs
from trl_ext.registry import ConfigError
from trl_ext.routing.args import RoutingArgs
from trl_ext.sft import SFTArgs
from trl_ext.serve.args import ServeArgs
from trl_ext.vllm.args import VLLMArgs

PROMPT_SOURCES = (BUILTIN_PROMPTS, "simplestories")
DEFAULT_PROMPT_LENGTH = 8  # story prompt prefix tokens (--prompt_length unset)
DEFAULT_NUM_PROMPTS = 2048  # story prompts drawn / --env levels (--num_prompts unset)
DEFAULT_LORA_ALPHA = 16.0  # PEFT LoRA and explicit dual LoRA ranks; presets carry their own (routing/step.py)


@dataclass
class RunArgs:
    """What a run is made of; parsed next to `ExtGRPOConfig` by train.py."""

    _argument_group_name = "run: model, reward, prompts, adapters, logging (train.py)"  # train.py --help group (cli_help.py)

    reward: str = field(default=None, metadata={"help": "Reward binding name from --config (required)."})
    model: str = field(
        default="builtin",
        metadata={
            "help": "'builtin' (the embedded offline SimpleStories-shaped model, built on first use), its variants "
            "'builtin_mood' (stories titled 'A happy story.' carry that mood: context distillation) and "
            "'builtin_env' (--env), 'builtin_search' (--env search: pretrained on imperfect search episodes), a hub "
            "id such as SimpleStories/SimpleStories-1.25M, or a local path."
        },
    )
    config: str = field(default="config.yaml", metadata={"help": "YAML file binding reward and detector names."})
    prompts: str | None = field(
        default=None,
        metadata={
            "help": "Story prompt source: 'builtin' (held-out part of the builtin corpus) or 'simplestories' (the "
            "SimpleStories dataset: train split for training, test split for eval). Unset: 'builtin' for "
            "--model builtin/builtin_mood, 'simplestories' for any other model (pass 'builtin' for checkpoints of builtin runs)."
        },
    )
    prompt_length: int | None = field(default=None, metadata={
        "help": f"Story prompt prefix length in tokens (unset: {DEFAULT_PROMPT_LENGTH}); not with --dataset, whose "
                "prompts are used as written."})
    num_prompts: int | None = field(default=None, metadata={
        "help": f"Training prompts (the trainer cycles them). Unset: {DEFAULT_NUM_PROMPTS} story prompts or --env "
                "levels; every row of --dataset. With --dataset: its first N rows (more than it has is an error)."})
    dataset: str | None = field(default=None, metadata={
        "help": "Training prompts from a file (.jsonl, .json, .csv, .parquet), a save_to_disk directory or a hub id "
                "(datasets.load_dataset), instead of the story prompts: the --prompt_column is TRL's prompt, every "
                "other column reaches the reward functions as a keyword argument (trl_ext/data/load.py)."})
    dataset_split: str | None = field(default=None, metadata={
        "help": f"Split of --dataset trained on, datasets' split syntax (train, test, train[:90%]; unset: "
                f"{DEFAULT_SPLIT!r}, a file's only split)."})
    prompt_column: str | None = field(default=None, metadata={
        "help": f"Column of --dataset / --eval_dataset holding the prompts (unset: {DEFAULT_PROMPT_COLUMN!r}): text, "
                "or conversational messages (a list of {'role', 'content'} dicts; needs a chat template)."})
    eval_dataset: str | None = field(default=None, metadata={
        "help": "Prompts of TRL's eval loop (GRPOTrainer's eval_dataset; same formats as --dataset): needs "
                "--eval_strategy steps|epoch, which needs it."})
    eval_dataset_split: str | None = field(default=None, metadata={
        "help": f"Split of --eval_dataset (unset: {DEFAULT_SPLIT!r}); when --eval_dataset is --dataset it must "
                "differ from --dataset_split."})
    eval_rewards: str = field(
        default="",
        metadata={"help": "Comma-separated reward bindings logged on every logging step (not optimised)."},
    )
    lora_rank: int = field(default=0, metadata={
        "help": "PEFT LoRA rank on --lora_target_modules (unset: every linear layer of the decoder blocks); 0 = full "
                "fine-tune."})
    lora_target_modules: str | None = field(default=None, metadata={
        "help": "Comma-separated module names adapted by --lora_rank (PEFT LoRA) and by dual LoRA, matched as PEFT "
                "matches target_modules (a module path equal to NAME or ending in .NAME). Unset: every linear layer "
                "of the decoder blocks (Llama: q/k/v/o/gate/up/down_proj; Phi-3: qkv_proj, o_proj, gate_up_proj, "
                "down_proj; GPT-2: c_attn, attn.c_proj, c_fc, mlp.c_proj). A name the model lacks is an error that "
                "lists the model's names."})
    lora_alpha: float | None = field(default=None, metadata={
        "help": f"LoRA alpha (scaling alpha/rank). Unset: {DEFAULT_LORA_ALPHA:g} for --lora_rank and explicit "
        "--retain_rank/--forget_rank; a --lora_config preset's own alpha (alpha = rank, as small-rl)."})
    no_wandb: bool = field(default=False, metadata={"help": "Disable wandb (it runs offline when no API key is set)."})
    wandb_project: str = field(default="trl-ext", metadata={"help": "wandb project name."})
    rebuild_builtin: bool = field(default=False, metadata={"help": "Rebuild the builtin model before training."})
    lora_alpha_explicit: bool = field(default=False, init=False, repr=False)  # set by __post_init__
    # Set by train.py's build_plan from --model's structure (routing.args.check_run_adapters); None: no LoRA.
    lora_targets: LoraTargets | None = field(default=None, init=False, repr=False)
    overwrite_run: bool = field(default=False, metadata={
        "help": "Start over in a run directory that already holds a run: the old directory is renamed to "
                "{run_dir}.old-{timestamp} (nothing is deleted). Without it such a start is an error."})

    def __post_init__(self):
        check_run_processes(self)  # several processes (torchrun): features not yet verified there
        if self.prompts is not None and self.prompts not in PROMPT_SOURCES:
            raise ConfigError(f"--prompts must be one of {', '.join(PROMPT_SOURCES)}, got {self.prompts!r}")
        self.check_prompt_data()
        if self.prompt_length is not None and self.prompt_length < 1:
            raise ConfigError(f"--prompt_length must be >= 1, got {self.prompt_length}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ConfigError(f"--num_prompts must be >= 1, got {self.num_prompts}")
        if self.dataset is None:  # story prompts (or --env levels): unset resolves here, consumers read numbers
            self.prompt_length = DEFAULT_PROMPT_LENGTH if self.prompt_length is None else self.prompt_length
            self.num_prompts = DEFAULT_NUM_PROMPTS if self.num_prompts is None else self.num_prompts
        if self.lora_rank < 0:
            raise ConfigError(f"--lora_rank must be >= 0, got {self.lora_rank}")
        if self.lora_target_modules is not None and not all(self.lora_target_names):
            raise ConfigError(f"--lora_target_modules must be comma-separated names, got {self.lora_target_modules!r}")
        # Unset resolves here, so consumers read a number; whether it was given decides a preset's alpha.
        self.lora_alpha_explicit = self.lora_alpha is not None
        if self.lora_alpha is None:
            self.lora_alpha = DEFAULT_LORA_ALPHA
        if self.lora_alpha <= 0:
            raise ConfigError(f"--lora_alpha must be > 0, got {self.lora_alpha}")

    @property
    def lora_target_names(self) -> list[str] | None:
        """--lora_target_modules as a list (None: unset, every linear layer of the decoder blocks)."""
        if self.lora_target_modules is None:
            return None
        return [n.strip() for n in self.lora_target_modules.split(",")]

    def check_prompt_data(self) -> None:
        """--dataset / --eval_dataset flags that contradict or would be ignored; resolves the unset split and
        column of a given dataset (the data itself is checked by train.py's build_plan, trl_ext/data/load.py)."""
        if self.dataset is not None:
            if self.prompts is not None:
                raise ConfigError("--dataset and --prompts exclude each other (--prompts picks the story prompts)")
            if self.prompt_length is not None:
                raise ConfigError("--prompt_length cuts story prompts; --dataset prompts are used as written")
        for flag, value, needs, needed in (
            ("--dataset_split", self.dataset_split, self.dataset, "--dataset"),
            ("--eval_dataset_split", self.eval_dataset_split, self.eval_dataset, "--eval_dataset"),
            ("--prompt_column", self.prompt_column, self.dataset or self.eval_dataset, "--dataset or --eval_dataset"),
        ):
            if value is not None and needs is None:
                raise ConfigError(f"{flag} {value} would be ignored: it needs {needed}")
        for flag, value in (("--dataset", self.dataset), ("--eval_dataset", self.eval_dataset),
                            ("--dataset_split", self.dataset_split), ("--eval_dataset_split", self.eval_dataset_split),
                            ("--prompt_column", self.prompt_column)):
            if value is not None and not value.strip():
                raise ConfigError(f"{flag} must not be empty")
        if self.eval_dataset is not None and self.dataset is not None and self.eval_dataset == self.dataset \
                and (self.eval_dataset_split or DEFAULT_SPLIT) == (self.dataset_split or DEFAULT_SPLIT):
            split = self.dataset_split or DEFAULT_SPLIT
            raise ConfigError(f"--eval_dataset is --dataset and both use split {split!r}: the eval prompts would be "
                              "the training prompts; pass --eval_dataset_split (e.g. test, or train[90%:] with "
                              "--dataset_split train[:90%])")
        if self.dataset is not None:
            self.dataset_split = self.dataset_split or DEFAULT_SPLIT
        if self.eval_dataset is not None:
            self.eval_dataset_split = self.eval_dataset_split or DEFAULT_SPLIT
        if self.dataset is not None or self.eval_dataset is not None:
            self.prompt_column = self.prompt_column or DEFAULT_PROMPT_COLUMN

    @property
    def eval_reward_names(self) -> list[str]:
        return [n.strip() for n in self.eval_rewards.split(",") if n.strip()]


def _trl_default(name: str):
    """GRPOConfig's default of the field ``name`` (the one place it is defined: TRL)."""
    (f,) = (f for f in dataclasses.fields(GRPOConfig) if f.name == name)
    return f.default


# train.py's defaults of TRL / transformers fields: seed 004's validated values (beta 0.02, batch 32, 16 generations,
# lr 1e-5, 2000 steps, the grpo loss), fp32 without activation checkpointing (TRL defaults bf16 and
# gradient checkpointing on, even on CPU), runs under output/. The Python API keeps TRL's own defaults (a drop-in
# GRPOConfig); `train_config` gives these to a script. docs/coming-from-trl.md lists both.
TRAIN_DEFAULTS: dict[str, object] = {
    "learning_rate": 1e-5, "beta": 0.02, "per_device_train_batch_size": 32, "per_device_eval_batch_size": 32,
    "num_generations": 16, "max_steps": 2000, "max_completion_length": 64, "loss_type": "grpo",
    "logging_steps": 10, "save_steps": 500, "seed": 42, "bf16": False, "activation_checkpointing": False,
    "output_dir": "output",
}  # fmt: skip


def train_config(**overrides) -> ExtGRPOConfig:
    """The ExtGRPOConfig train.py builds: `TRAIN_DEFAULTS`, then ``overrides``."""
    return ExtGRPOConfig(**{**TRAIN_DEFAULTS, **overrides})


@dataclass
class ExtGRPOConfig(DistillArgs, RoutingArgs, OffPolicyArgs, EnvArgs, SFTArgs, ServeArgs, VLLMArgs, GenerationArgs,
                    GRPOConfig):
    """`trl.GRPOConfig` with the project's defaults and extension fields."""

    _argument_group_name = "monitoring and saved rollouts (trl_ext)"  # train.py --help group (cli_help.py)

    # --- TRL's fields with the project's aliases (TRL's defaults: train.py's own are TRAIN_DEFAULTS) ---
    learning_rate: float = field(default=_trl_default("learning_rate"), metadata={
        "help": "AdamW learning rate.", "aliases": ["--lr"]})
    per_device_train_batch_size: int = field(default=_trl_default("per_device_train_batch_size"), metadata={
        "help": "Completions per optimizer step and device.", "aliases": ["--batch_size"]})
    num_generations: int | None = field(default=_trl_default("num_generations"), metadata={
        "help": "Completions per prompt (group size; RAGEN's n_rollout).", "aliases": ["--n_rollout"]})

    # --- extensions ---
    zero_signal_patience: int = field(
        default=5,
        metadata={
            "help": "Warn loudly after this many consecutive steps in which every group has zero reward spread "
            "(no learning signal: loss is exactly 0)."
        },
    )

    save_rollouts: bool = field(
        default=False,
        metadata={
            "help": "Write every trained sample (prompt, completion or transcript, rewards, advantage, labels, "
            "teacher/student log-prob sums, policy versions) to {run_dir}/rollouts/ as parquet shards, one per step."
        },
    )
    token_records_every: int = field(
        default=0,
        metadata={
            "help": "With --save_rollouts: every N-th step, also one row per completion token (policy version, "
            "behaviour and trainer log-probs, ratio, the mask or clip that acted, advantage, teacher log-prob, "
            "adapter side) in {run_dir}/rollouts/tokens/ (trl_ext.runs.token_records); 0 = none."
        },
    )

    def __post_init__(self):
        check_cfg_processes(self)  # before TrainingArguments starts a process group
        check_cfg_sharding(self)  # FSDP / DeepSpeed: only the plain runs, until the features are verified there
        if self.resume_from_checkpoint is not None and not self.resume_from_checkpoint.strip():
            raise ConfigError("--resume_from_checkpoint needs a checkpoint path or 'latest'")
        if not self.learning_rate > 0:
            raise ConfigError(f"--lr must be > 0, got {self.learning_rate}")
        if self.num_generations < 2:
            raise ConfigError(f"--num_generations must be >= 2 (GRPO needs a group), got {self.num_generations}")
        if self.beta < 0:
            raise ConfigError(f"--beta must be >= 0, got {self.beta}")
        if self.zero_signal_patience < 1:
            raise ConfigError(f"--zero_signal_patience must be >= 1, got {self.zero_signal_patience}")
        if self.token_records_every < 0:
            raise ConfigError(f"--token_records_every must be >= 0, got {self.token_records_every}")
        if self.token_records_every and not self.save_rollouts:
            raise ConfigError("--token_records_every needs --save_rollouts (a token row joins its completion's row)")
        if self.token_records_every and self.num_iterations != 1:
            raise ConfigError(f"--token_records_every records one loss per token: not with --num_iterations "
                              f"{self.num_iterations}")
        self.validate_extensions()
        multi_process_settings(self)  # several processes on CPU: gloo, so the Trainer sees a distributed run
        try:
            super().__post_init__()
        except ValueError as e:  # TRL's own checks (e.g. generation batch not divisible by num_generations)
            alias = " (--batch_size is per_device_train_batch_size)" if "per_device_train_batch_size" in str(e) else ""
            raise ConfigError(f"{e}{alias}") from e


    def validate_extensions(self) -> None:
        """Every feature subpackage's checks of its own flags (ConfigError)."""
        self.validate_routing()
        self.validate_distill()
        self.validate_offpolicy()
        self.validate_env()
        self.validate_sft()
        self.validate_vllm()
        self.validate_serve()
        self.validate_generation()
        arm = self.baseline or (self.renormalization if self.gradient_routing else None)
        check_estimator_flags(adv_estimator=self.adv_estimator, distill_on=self.distill_on, routing_arm=arm)

    @classmethod
    def from_grpo_config(cls, args: GRPOConfig) -> ExtGRPOConfig:
        """A plain ``trl.GRPOConfig`` as an ExtGRPOConfig with every extension off: its (already validated and
        resolved) values as they are, the extension fields at their defaults. Not by re-running ``__post_init__``:
        that would see resolved pairs such as ``generation_batch_size`` and ``steps_per_generation`` as both set."""
        ext = cls.__new__(cls)
        ext.__dict__.update({k: copy.deepcopy(v) if isinstance(v, (list, dict)) or dataclasses.is_dataclass(v) else v
                             for k, v in args.__dict__.items()})  # fmt: skip  (the caller's lists stay its own)
        for f in dataclasses.fields(cls):
            if f.name not in args.__dict__:
                setattr(ext, f.name, f.default_factory() if f.default is dataclasses.MISSING else f.default)
        ext.validate_extensions()
        return ext
