"""train.py: parse and validate everything (exit 2 on a config error, before any model is loaded),
then build the run directory, the prompts, the rewards and the trainer, and train."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from transformers import HfArgumentParser

from trl_ext.assembly import Build, resolve
from trl_ext.config import TRAIN_DEFAULTS, ExtGRPOConfig, RunArgs
from trl_ext.data.load import load_run_data
from trl_ext.data.register import prompt_source  # noqa: F401  (the story prompts' source: evaluate.py reads it here)
from trl_ext.models import BUILTIN_MODELS, model_source, load_tokenizer, prepare_tokenizer, resolve_model_arg
from trl_ext.naming import run_name
from trl_ext.registry import ConfigError


@dataclass
class Plan:
    """A fully validated run, before anything heavy is loaded."""

    run: RunArgs
    cfg: ExtGRPOConfig
    reward_config: object  # rewards.config.RewardConfig
    run_dir: Path
    argv: list[str]
    resume: Path | None = None  # the complete checkpoint a resumed run continues from (`runs.rundir.check_run_dir`)
    train_data: object = None  # trl_ext.data.load.PromptData of --dataset (loaded once, at parse time)
    eval_data: object = None  # trl_ext.data.load.PromptData of --eval_dataset
    assembly: object = None  # trl_ext.assembly.Assembly: the run's prompt source, generation sources and features
    flags: dict | None = None  # the flags given, recipes' and command line's (run_config.yaml's `flags`)
    origin: Path | None = None  # the run whose run_config.yaml is this run's recipe (`trl_ext.runs.recipe`)


def parser() -> HfArgumentParser:
    """train.py's parser: `RunArgs` and `ExtGRPOConfig`, flags grouped by feature in --help (`trl_ext.cli_help`)."""
    from transformers.hf_argparser import string_to_bool

    from trl_ext.cli_help import group_flags
    from trl_ext.compat import parser_actions

    p = group_flags(HfArgumentParser((RunArgs, ExtGRPOConfig), allow_abbrev=False), ExtGRPOConfig)
    p.set_defaults(**TRAIN_DEFAULTS)  # the seed's validated values of TRL's fields (the Python API keeps TRL's)
    for action in parser_actions(p):  # `bool | None = None` fields (TRL's bf16 ...): a bare --flag means true
        if action.type is string_to_bool and action.nargs is None:
            action.nargs, action.const = "?", True
    return p


def adapter_tag(run: RunArgs, cfg: ExtGRPOConfig) -> str:
    from trl_ext.routing.args import dual_lora_tag

    return dual_lora_tag(cfg) or (f"lora_r{run.lora_rank}" if run.lora_rank else "full")


def build_plan(argv: list[str]) -> Plan:
    """Parse ``argv`` and validate the run; raises ConfigError (argparse itself exits 2 on bad flags)."""
    from rewards.config import load_reward_config
    from trl_ext.launch.processes import name_tag
    from trl_ext.launch.sharding import sharding_tag
    from trl_ext.api import check_trainer_arguments
    from trl_ext.runs.recipe import expand, given_flags

    typed, p = list(argv), parser()  # one parser for the whole plan: parsing does not change it
    argv, recipes = expand(typed, p)  # recipes' flags first, the command line's last (trl_ext.runs.recipe)
    # Several processes (torchrun) or sharding (FSDP, DeepSpeed): the registered parts a flag engages refuse what they
    # do not support while the flags parse (config.py -> trl_ext.launch); the allowed runs run as one DDP run.
    run, cfg, unknown = p.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if unknown:
        raise ConfigError(f"unknown arguments: {' '.join(unknown)} (see train.py --help)")
    check_training_length(cfg)
    from trl_ext.vllm.args import lora_sync_plan

    lora_sync_plan(cfg, run.lora_rank)  # --vllm_lora_sync adapter on a policy vLLM cannot serve as LoRA: exit 2
    resolve_model_arg(run.model)
    assembly = resolve(run, cfg)  # the run's parts (trl_ext.assembly): prompt source, generation sources, features
    assembly.check_args(run, cfg)
    config_path = Path(run.config)
    if not config_path.is_file():
        raise ConfigError(f"--config file does not exist: {config_path}")
    reward_config = load_reward_config(config_path)
    for name in [run.reward] * bool(run.reward) + run.eval_reward_names:
        reward_config.reward(name)
    train_data, eval_data = load_run_data(run, cfg, BUILTIN_MODELS)  # files load here: every data error exits 2
    plan = Plan(run=run, cfg=cfg, reward_config=reward_config, run_dir=None, argv=typed, train_data=train_data,
                eval_data=eval_data, assembly=assembly, flags=given_flags(argv, p))  # fmt: skip
    assembly.check(plan)  # with the rewards, the data and --model's config (LoRA targets, architectures)
    try:  # the Python API's refusals, here before any model loads
        check_trainer_arguments(cfg, adapters=run.lora_rank > 0)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    base_args, named = assembly.prompts.naming(run, cfg)  # the default run the name is compared with
    default_run, default_cfg = p.parse_args_into_dataclasses(args=base_args)
    name = cfg.run_name or (run_name(named, cfg, default_run, default_cfg, adapter_tag(run, cfg)) + name_tag()
                            + sharding_tag(cfg))  # fmt: skip
    plan.run_dir = Path(cfg.output_dir) / name
    cfg.run_name = name
    cfg.output_dir = str(plan.run_dir)
    for recipe in recipes:
        if recipe.origin is not None:
            check_reproduces(plan, recipe)
    return plan


def check_reproduces(plan: Plan, recipe) -> None:
    """A run's own run_config.yaml as the recipe (`trl_ext.runs.recipe`): not into that run's directory, and its flags
    alone must still resolve to the saved run's run-defining values and launch; the start weights are checked when
    the model is resolved (`runs.provenance.start_weights`)."""
    import yaml

    from trl_ext.launch.processes import launch_record
    from trl_ext.naming import is_defining
    from trl_ext.runlog import resolved_config
    from trl_ext.runs.checkpoints import config_differences
    from trl_ext.runs.recipe import recipe_argv

    if plan.run_dir.resolve() == recipe.origin.resolve():
        raise ConfigError(f"{recipe.path} would run again in its own run directory {recipe.origin}: pass --output_dir "
                          "DIR (the same run name under DIR) or --run_name NAME")
    alone = build_plan(recipe_argv(recipe, parser()))
    current = yaml.safe_load(yaml.safe_dump(resolved_config(alone.run, alone.cfg, extra=launch_record())))
    diffs = config_differences(recipe.saved, current, is_defining, labels=("the run", "its flags now"))
    if diffs:
        raise ConfigError(f"{recipe.path}: the recorded flags no longer resolve to the run they record (a default or "
                          f"the launch changed): {'; '.join(diffs)}; pass the run's values as flags, or launch it as "
                          "it was launched")
    plan.origin = recipe.origin


def check_training_length(cfg: ExtGRPOConfig) -> None:
    """--max_steps >= 1, or -1 (HF's Trainer reads any value <= 0 as "by epochs": train.py accepts -1 alone);
    --num_train_epochs counts only with -1 (HF's Trainer ignores it while max_steps > 0, and train.py's max_steps is
    2000 unless given): a ConfigError rather than an ignored flag."""
    if cfg.max_steps == 0 or cfg.max_steps < -1:
        raise ConfigError(f"--max_steps must be >= 1, or -1 to train by --num_train_epochs; got {cfg.max_steps}")
    (epochs,) = (f.default for f in dataclasses.fields(cfg) if f.name == "num_train_epochs")
    if cfg.max_steps > 0 and cfg.num_train_epochs != epochs:
        raise ConfigError(f"--num_train_epochs {cfg.num_train_epochs:g} would be ignored: --max_steps {cfg.max_steps} "
                          "decides the length; pass --max_steps -1 to train by epochs")


def check_start(plan: Plan) -> Plan:
    """How the run starts in its directory (fresh, resumed, or over a run moved aside); ConfigError otherwise."""
    from trl_ext.launch.processes import launch_record, on_main
    from trl_ext.runlog import resolved_config
    from trl_ext.runs.rundir import check_run_dir

    # The main process decides (the others would see its fresh directory as "a run already there"); every rank
    # receives the outcome, a refusal included.
    plan.resume = on_main(check_run_dir, plan.run_dir, plan.cfg.resume_from_checkpoint, plan.run.overwrite_run,
                          resolved_config(plan.run, plan.cfg, extra=launch_record()))
    return plan


def setup_wandb(plan: Plan) -> None:
    """wandb (offline without an API key); a resumed run continues the same wandb run (its id is kept in the run
    directory's ``wandb_run_id``)."""
    if plan.run.no_wandb:
        plan.cfg.report_to = []
        return
    plan.cfg.report_to = ["wandb"]
    os.environ.setdefault("WANDB_PROJECT", plan.run.wandb_project)
    os.environ.setdefault("WANDB_DIR", str(plan.run_dir))
    id_file = plan.run_dir / "wandb_run_id"
    if plan.resume is not None and id_file.is_file():
        run_id = id_file.read_text().strip()
    else:
        run_id = uuid.uuid4().hex[:8]  # wandb's own id format: 8 characters of [0-9a-z]
        id_file.write_text(run_id)
    os.environ["WANDB_RUN_ID"] = run_id
    os.environ["WANDB_RESUME"] = "allow"
    has_key = bool(os.environ.get("WANDB_API_KEY")) or "api.wandb.ai" in _netrc_text()
    if not has_key and "WANDB_MODE" not in os.environ:
        os.environ["WANDB_MODE"] = "offline"
        print("wandb: no API key found, logging offline (sync later with `wandb sync`)", flush=True)


def _netrc_text() -> str:
    path = Path.home() / ".netrc"
    return path.read_text() if path.is_file() else ""


def run_training(plan: Plan) -> int:
    from transformers import set_seed

    from trl_ext.launch.processes import barrier
    from trl_ext.runs.preemption import PreemptionCallback, preemption_handler
    from trl_ext.runs.provenance import start_weights
    from trl_ext.runs.rundir import add_launch_header, start_on_main
    from trl_ext.trainer import ExtGRPOTrainer

    run, cfg = plan.run, plan.cfg
    code = plan.assembly.run_alone(plan)  # a part that trains by itself (SFT mode)
    if code is not None:
        return code
    tee = start_on_main(plan, prepare=setup_wandb)  # only the main process writes the run directory and wandb
    main_process = tee is not None
    if not main_process:
        cfg.report_to = []
    barrier()  # the run directory exists before any rank trains
    set_seed(cfg.seed)  # adapters built before the trainer (dual LoRA) are initialised from the run's seed

    model_path = model_source(run.model, rebuild=run.rebuild_builtin)
    tokenizer = prepare_tokenizer(load_tokenizer(model_path))
    build = assemble(plan, model_path, tokenizer, main_process)
    trainer = ExtGRPOTrainer(model=build.model, **build.kwargs)
    add_launch_header(plan, trainer)  # train.log's launch line, once the model is prepared
    # recorded, or checked on a resume (ConfigError: exit 2)
    start_weights(plan, model_path, trainer.components.distill.teacher if trainer.components.distill else None)
    plan.assembly.before_train(build, trainer)  # --eval_baseline: the main process samples it, the others wait
    with preemption_handler() as flag:  # SIGTERM: a checkpoint at the next step boundary, then exit 0
        preemption = PreemptionCallback(flag, trainer.accelerator)
        trainer.add_callback(preemption)
        return train_and_summarise(plan, trainer, preemption, tee)


def assemble(plan: Plan, model_path: str, tokenizer, main_process: bool = True) -> Build:
    """The trainer's model and keyword arguments, built by the run's parts: the prompt source's dataset and rewards,
    then each generation source's and feature's contribution (dual LoRA's model, PEFT LoRA, TRL's eval dataset ...)."""
    run, cfg, rc = plan.run, plan.cfg, plan.reward_config
    kwargs = {"args": cfg, "processing_class": tokenizer, "eval_dataset": None, "peft_config": None,
              "eval_reward_funcs": {name: rc.reward(name) for name in run.eval_reward_names}}  # fmt: skip
    build = Build(plan=plan, model_path=model_path, tokenizer=tokenizer, main_process=main_process, kwargs=kwargs)
    plan.assembly.build_prompts(build)
    for label, data in (("train", plan.train_data), ("eval", plan.eval_data)):
        if data is not None and main_process:
            print(f"{label} prompts: {data.describe()}", flush=True)
    plan.assembly.contribute(build)
    return build


def train_and_summarise(plan: Plan, trainer, preemption, tee) -> int:
    """Train; the main process writes run_summary.json (status done, preempted or numeric_fault); the exit code."""
    from trl_ext.runs.faults import NumericFault

    cfg, main_process = plan.cfg, tee is not None
    start = time.time()
    try:
        trainer.train(resume_from_checkpoint=str(plan.resume) if plan.resume else None)
    except NumericFault as e:
        print(f"train.py: numeric fault: {e}", file=sys.stderr, flush=True)
        summary = {"status": "numeric_fault", "run_name": cfg.run_name, "error": str(e),
                   "steps": trainer.state.global_step, **restarts_of(plan.run_dir)}
        if main_process:
            (plan.run_dir / "run_summary.json").write_text(json.dumps(summary, indent=2))
            tee.close()
        return 1
    steps = trainer.state.global_step
    preempted = preemption.stopped_at is not None and steps < trainer.state.max_steps
    summary = {
        "status": "done",
        "run_name": cfg.run_name,
        "steps": steps,
        **(preemption.summary(plan.run_dir, steps) if preempted else {}),
        "wall_s": round(time.time() - start, 1),
        "final_log": next((h for h in reversed(trainer.state.log_history) if "reward" in h), {}),
        **restarts_of(plan.run_dir),
    }
    if main_process:
        (plan.run_dir / "run_summary.json").write_text(json.dumps(summary, indent=2))
        if preempted:
            print(preemption.notice(steps, trainer.state.max_steps, plan.run_dir), flush=True)
        else:
            print(f"done: {plan.run_dir}", flush=True)
        tee.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        plan = check_start(build_plan(argv))
    except ConfigError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    try:
        return run_training(plan)
    except ConfigError as e:  # a refusal that needs the model resolved (a resume from other start weights)
        print(f"train.py: error: {e}", file=sys.stderr)
        from trl_ext.launch.processes import is_main

        if is_main() and plan.run_dir.is_dir():  # a launcher reads it: not a crash to restart (trl_ext.serve.watch)
            path = plan.run_dir / "run_summary.json"
            summary = {"status": "config_error", "run_name": plan.cfg.run_name, "error": str(e)}
            if path.is_file():  # the summary this run's last attempt wrote (a preemption's resume advice): kept
                text = path.read_text()
                try:
                    summary["previous"] = json.loads(text)
                except ValueError:
                    summary["previous"] = text
            path.write_text(json.dumps(summary, indent=2))
        return 2


def restarts_of(run_dir) -> dict:
    """run_summary.json's ``restarts``: the launcher's restarts of the run's parts (`trl_ext.runs.restarts`), if
    any."""
    from trl_ext.runs.restarts import read_restarts

    restarts = read_restarts(run_dir)
    return {"restarts": restarts} if restarts else {}
