"""Run directory names that hold every hyperparameter defining the run (seed 004's naming rule).

``{reward}_{model}_lr{lr}_b{beta}_bs{batch}_ng{generations}_{adapter}_st{steps}_s{seed}`` followed by
``_{field}{value}`` for every other defining field whose value differs from its default, sorted by
field name, so two runs that differ in any value (a sweep's fixed values included) never share a
directory. Fields that only steer logging or output are not defining (see `NOT_DEFINING`); the eval prompts
(``--eval_dataset``: an ``eval_`` field) do not define the training either.

A ``--dataset`` run has ``_data-{tag}`` after the model (`trl_ext.data.load.dataset_tag`: a file's stem, a directory's
name, a hub id's last part; never a path with slashes), and its other fields are compared with the default run on
the same dataset (train.py's build_plan), whose unset --num_prompts means every row. Two datasets with the same
tag share a name: the run directory's check (`runs.rundir.check_run_dir`) then refuses the second start.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from pathlib import PurePath

from trl_ext.data.load import dataset_tag

CORE_FIELDS = (
    "reward",
    "model",
    "learning_rate",
    "beta",
    "per_device_train_batch_size",
    "num_generations",
    "lora_rank",
    "lora_config",  # the dual LoRA ranks are in the adapter tag (dual_r{retain}f{forget})
    "retain_rank",
    "forget_rank",
    "max_steps",
    "num_train_epochs",  # with max_steps <= 0 (length_tag)
    "seed",
    "dataset",  # _data-{tag} after the model
)
NOT_DEFINING = {
    "output_dir", "run_name", "report_to", "no_wandb", "wandb_project", "rebuild_builtin", "eval_rewards",
    "zero_signal_patience", "num_completions_to_print", "disable_tqdm", "overwrite_output_dir",
    "resume_from_checkpoint", "overwrite_run", "generation_batch_size", "eval_routing_steps", "logging_dir",
    "do_eval", "per_device_eval_batch_size", "num_generations_eval",  # TRL's eval loop (--eval_dataset)
    "token_records_every",  # what the run writes, not what it trains (trl_ext.runs.token_records)
    "parallelism",  # run_config.yaml's launch.parallelism: read from the prepared model, it describes the run
    # where the servers are (trl_ext.serve): a resume may find them on other ports or hosts
    "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
    "vllm_request_timeout", "vllm_server_restart_timeout", "teacher_server_url",
    "vllm_weight_transfer", "vllm_weight_transfer_address",  # how the same weights reach the servers
    "vllm_lora_sync",  # how the same policy reaches vLLM: merged or as its adapters
}  # fmt: skip
NOT_IN_NAME = {"fsdp", "fsdp_config"}  # named by the launch tag (_fsdp2); a resume still compares them
NOT_DEFINING_PREFIXES = ("logging_", "log_", "save_", "hub_", "push_to_hub", "dataloader_", "eval_", "wandb_")
MAX_NAME = 200


def fmt_value(v) -> str:
    """Compact, filesystem-safe rendering: 1e-4 -> '1e-4', 0.02 -> '0.02', 'a/b' -> 'a-b'."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        if v != 0 and (abs(v) < 1e-2 or abs(v) >= 1e5):
            mantissa, exp = f"{v:e}".split("e")
            return f"{mantissa.rstrip('0').rstrip('.')}e{int(exp)}"
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        return "-".join(fmt_value(x) for x in v)
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", str(v)).strip("-")


def model_tag(model: str) -> str:
    return fmt_value(PurePath(model.rstrip("/")).name) if model != "builtin" else "builtin"


def is_defining(name: str) -> bool:
    """Whether a config field defines the run (logging and output fields do not)."""
    return name not in NOT_DEFINING and not name.startswith(NOT_DEFINING_PREFIXES)


def changed_fields(obj, default_obj) -> dict:
    """Fields of dataclass ``obj`` whose value differs from ``default_obj``'s."""
    out = {}
    for f in dataclasses.fields(obj):
        if not f.init:
            continue
        value, default = getattr(obj, f.name), getattr(default_obj, f.name)
        if value != default:
            out[f.name] = value
    return out


def length_tag(cfg) -> str:
    """``st{max_steps}``, or ``ep{num_train_epochs}`` for a run trained by epochs (max_steps <= 0)."""
    return f"st{cfg.max_steps}" if cfg.max_steps > 0 else f"ep{fmt_value(float(cfg.num_train_epochs))}"


def run_name(run, cfg, default_run, default_cfg, adapter: str) -> str:
    """Directory name of a run (``run``: RunArgs, ``cfg``: ExtGRPOConfig, defaults to compare with)."""
    data = f"_data-{fmt_value(dataset_tag(run.dataset))}" if getattr(run, "dataset", None) else ""
    core = (
        f"{run.reward}_{model_tag(run.model)}{data}"
        f"_lr{fmt_value(float(cfg.learning_rate))}_b{fmt_value(float(cfg.beta))}"
        f"_bs{cfg.per_device_train_batch_size}_ng{cfg.num_generations}_{adapter}_{length_tag(cfg)}_s{cfg.seed}"
    )
    extras = {**changed_fields(run, default_run), **changed_fields(cfg, default_cfg)}
    parts = [f"{k}{fmt_value(v)}" for k, v in sorted(extras.items())
             if k not in CORE_FIELDS and k not in NOT_IN_NAME and is_defining(k)]
    name = "_".join([core, *parts])
    if len(name) > MAX_NAME:  # keep names within filesystem limits; the hash keeps them distinct
        digest = hashlib.sha1(name.encode()).hexdigest()[:10]
        name = f"{name[: MAX_NAME - 11]}_{digest}"
    return name
