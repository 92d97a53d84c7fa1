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

from trl_ext.models.builtin_env import BUILTIN_ENV
from trl_ext.models.builtin_search import BUILTIN_SEARCH
from trl_ext.config import ExtGRPOConfig, RunArgs
from trl_ext.data import load_run_data
from trl_ext.models import BUILTIN_MODELS, STORY_MODELS, model_source, load_tokenizer, prepare_tokenizer, resolve_model_arg
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
    train_data: object = None  # trl_ext.data.PromptData of --dataset (loaded once, at parse time)
    eval_data: object = None  # trl_ext.data.PromptData of --eval_dataset


def parser() -> HfArgumentParser:
    return HfArgumentParser((RunArgs, ExtGRPOConfig))


def adapter_tag(run: RunArgs, cfg: ExtGRPOConfig) -> str:
    from trl_ext.routing.args import dual_lora_tag

    return dual_lora_tag(cfg) or (f"lora_r{run.lora_rank}" if run.lora_rank else "full")


def build_plan(argv: list[str]) -> Plan:
    """Parse ``argv`` and validate the run; raises ConfigError (argparse itself exits 2 on bad flags)."""
    from rewards.config import load_reward_config
    from trl_ext.distill.args import check_run_distill
    from trl_ext.env.mixture import env_tag
    from trl_ext.launch.processes import name_tag
    from trl_ext.routing.args import check_run_adapters, check_run_routing

    # Several processes (torchrun): features not yet verified there are refused while the flags parse
    # (config.py -> trl_ext.launch.processes); the allowed ones run as one DDP run.
    run, cfg, unknown = parser().parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if unknown:
        raise ConfigError(f"unknown arguments: {' '.join(unknown)} (see train.py --help)")
    resolve_model_arg(run.model)
    check_env_run(run, cfg)
    config_path = Path(run.config)
    if not config_path.is_file():
        raise ConfigError(f"--config file does not exist: {config_path}")
    reward_config = load_reward_config(config_path)
    for name in [run.reward] * bool(run.reward) + run.eval_reward_names:
        reward_config.reward(name)
    train_data, eval_data = load_run_data(run, cfg, BUILTIN_MODELS)  # files load here: every data error exits 2
    check_reward_inputs(run, cfg, reward_config, train_data)
    check_run_routing(run, cfg, reward_config)  # story and --env runs alike (an env detector needs --env)
    check_run_adapters(run, cfg)  # LoRA targets and adapter layers against --model's structure (its config only)
    check_generation_backend(run, cfg)
    check_offpolicy_dropout(run, cfg)
    check_run_distill(run, cfg)
    base_args = ["--reward", run.reward] if run.reward else ["--env", cfg.env]
    base_args += ["--dataset", run.dataset] if run.dataset else []  # compared with the default run on the same data
    default_run, default_cfg = parser().parse_args_into_dataclasses(args=base_args)
    named = run if run.reward else dataclasses.replace(run, reward=f"{cfg.mode}-{env_tag(cfg.env)}")
    name = cfg.run_name or run_name(named, cfg, default_run, default_cfg, adapter_tag(run, cfg)) + name_tag()
    run_dir = Path(cfg.output_dir) / name
    cfg.run_name = name
    cfg.output_dir = str(run_dir)
    return Plan(run=run, cfg=cfg, reward_config=reward_config, run_dir=run_dir, argv=list(argv),
                train_data=train_data, eval_data=eval_data)


def check_reward_inputs(run: RunArgs, cfg: ExtGRPOConfig, reward_config, data=None) -> None:
    """The rewards' dataset columns against the prompts' (``data``: --dataset's `trl_ext.data.PromptData`; the story
    prompts have none but "prompt"); a reward that reads more than texts cannot score --eval_baseline's text-only
    samples."""
    if cfg.env:
        return
    names = [run.reward, *run.eval_reward_names, *[cfg.base_reward] * (cfg.base_reward is not None)]
    columns, source = (data.reward_columns, f"--dataset {data.source}") if data else ((), "the story prompts")
    reward_config.check_columns(names, columns, source)
    if cfg.eval_baseline and reward_config.reward(run.reward).needs_context():
        raise ConfigError(f"--eval_baseline scores completion texts alone: reward binding {run.reward!r} reads "
                          "prompts or dataset columns (a TRL-signature function or a reward model)")  # fmt: skip


def check_generation_backend(run: RunArgs, cfg: ExtGRPOConfig) -> None:
    """``--generation_backend fast`` (synchronous runs and the off-policy generator alike) on an architecture it
    computes exactly, read from ``--model``'s config alone (`generation.families.fast_backend_refusal`)."""
    if cfg.generation_backend != "fast":
        return
    from trl_ext.generation.families import fast_backend_refusal
    from trl_ext.models.arch import model_config

    reason = fast_backend_refusal(model_config(run.model, cfg.trust_remote_code), disable_dropout=cfg.disable_dropout)
    if reason is not None:
        raise ConfigError(f"--generation_backend fast: {reason}")


def check_offpolicy_dropout(run: RunArgs, cfg: ExtGRPOConfig) -> None:
    """With ``--max_async_level >= 1`` the generator samples without dropout while the trainer's forward (training
    mode) applies it: the importance ratio would differ from 1 at lag 0 and the masks would drop tokens for no lag.
    Module dropouts (GPT-2's ``resid_pdrop`` ...) need ``--disable_dropout`` (TRL zeroes them); a functional attention
    dropout (``attention_dropout``, which ``--disable_dropout`` leaves on) must be 0 in the model's config."""
    if cfg.max_async_level < 1:
        return
    from trl_ext.generation.families import FUNCTIONAL_DROPOUTS
    from trl_ext.models.arch import architecture_of, model_config

    config = model_config(run.model, cfg.trust_remote_code)
    functional = [f"{k}={getattr(config, k)}" for k in FUNCTIONAL_DROPOUTS if getattr(config, k, 0.0)]
    if functional:
        raise ConfigError(f"--max_async_level >= 1: --model's config sets {', '.join(functional)}, which the trainer's "
                          "forward applies and the generator does not (the importance ratio would not be 1 at lag 0; "
                          "--disable_dropout does not reach it): set it to 0 in the model's config.json")
    modules = () if cfg.disable_dropout else architecture_of(config).dropouts
    if modules:
        raise ConfigError(f"--max_async_level >= 1: --model has active dropout ({', '.join(modules[:3])}"
                          f"{', ...' if len(modules) > 3 else ''}), which the trainer's forward applies and the "
                          "generator does not (the importance ratio would not be 1 at lag 0): pass --disable_dropout")


def check_env_run(run: RunArgs, cfg: ExtGRPOConfig) -> None:
    """--env replaces --reward (the environment's reward is the reward) and needs a tokenizer for its text."""
    if not cfg.env:
        if not run.reward:
            raise ConfigError("--reward is required (a reward binding name from --config), or --env")
        if run.model in (BUILTIN_ENV, BUILTIN_SEARCH):
            raise ConfigError(f"--model {run.model} is an environments' model: use it with --env")
        return
    if run.reward or run.eval_reward_names:
        raise ConfigError("--env and --reward/--eval_rewards exclude each other: the environment gives the reward")
    if cfg.max_async_level > 0 and cfg.no_think_rl:
        raise ConfigError("--no_think_rl rewrites the sampled answer, so its tokens have no behaviour log-probs: it "
                          "needs --max_async_level 0")  # fmt: skip
    if run.model in STORY_MODELS:
        raise ConfigError(f"--env needs --model {BUILTIN_ENV} (or an instruct model): the {run.model} model's "
                          "tokenizer has no symbols for the environments' text (< > _ * # digits)")  # fmt: skip
    if run.model == BUILTIN_SEARCH and set(cfg.env_names) != {"search"}:
        raise ConfigError(f"--model {BUILTIN_SEARCH} was pretrained on search episodes only (its tokenizer lacks "
                          f"the other environments' symbols): use it with --env search, or --model {BUILTIN_ENV}")


def prompt_source(run: RunArgs) -> str:
    """The `model` argument of `environments.stories.load_prompts` for ``--prompts``."""
    from environments.stories import BUILTIN_PROMPTS

    source = run.prompts or (BUILTIN_PROMPTS if run.model in STORY_MODELS else "simplestories")
    return BUILTIN_PROMPTS if source == BUILTIN_PROMPTS else run.model


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

    from environments.stories import load_prompts
    from rewards.config import trl_reward_args
    from trl_ext.launch.processes import barrier
    from trl_ext.routing.setup import routing_setup
    from trl_ext.runs.preemption import PreemptionCallback, preemption_handler
    from trl_ext.runs.provenance import start_weights
    from trl_ext.runs.rundir import start_on_main
    from trl_ext.trainer import ExtGRPOTrainer

    run, cfg = plan.run, plan.cfg
    if cfg.mode == "sft":
        from trl_ext.sft import run_sft

        return run_sft(plan)
    tee = start_on_main(plan, prepare=setup_wandb)  # only the main process writes the run directory and wandb
    main_process = tee is not None
    if not main_process:
        cfg.report_to = []
    barrier()  # the run directory exists before any rank trains
    set_seed(cfg.seed)  # adapters built before the trainer (dual LoRA) are initialised from the run's seed

    model_path = model_source(run.model, rebuild=run.rebuild_builtin)
    tokenizer = prepare_tokenizer(load_tokenizer(model_path))
    if cfg.env:
        from trl_ext.env.episodes import env_reward, mixture_dataset

        train_dataset = mixture_dataset(cfg, run.num_prompts, tokenizer)  # one environment, or a mixture's shares
        reward_args = {"reward_funcs": [env_reward]}
    else:
        train_dataset = plan.train_data.dataset if plan.train_data is not None else load_prompts(
            prompt_source(run), tokenizer, run.prompt_length, "train", run.num_prompts, cfg.seed
        )
        reward_args = trl_reward_args(run.reward, plan.reward_config.reward(run.reward))  # a reward model: its path
    peft_config = None
    if run.lora_rank:
        from peft import LoraConfig

        peft_config = LoraConfig(r=run.lora_rank, lora_alpha=run.lora_alpha, task_type="CAUSAL_LM",
                                 **run.lora_targets.peft_kwargs())  # fmt: skip
    rc = plan.reward_config
    for label, data in (("train", plan.train_data), ("eval", plan.eval_data)):
        if data is not None and main_process:
            print(f"{label} prompts: {data.describe()}", flush=True)
    model, routing_kwargs = routing_setup(run, cfg, rc, model_path, tokenizer, prompt_source(run), plan.eval_data)
    trainer = ExtGRPOTrainer(
        model=model,
        **reward_args,
        args=cfg,
        train_dataset=train_dataset,
        eval_dataset=plan.eval_data.dataset if plan.eval_data is not None else None,
        processing_class=tokenizer,
        peft_config=peft_config,
        eval_reward_funcs={name: rc.reward(name) for name in run.eval_reward_names},
        **routing_kwargs,
    )
    # recorded, or checked on a resume (ConfigError: exit 2)
    start_weights(plan, model_path, getattr(trainer, "distill_teacher", None))
    if cfg.eval_baseline:  # the main process samples it; the others wait
        from trl_ext.distill.baseline import run_eval_baseline

        if main_process:
            run_eval_baseline(trainer, run, rc, prompt_source(run))
        barrier()
    with preemption_handler() as flag:  # SIGTERM: a checkpoint at the next step boundary, then exit 0
        preemption = PreemptionCallback(flag, trainer.accelerator)
        trainer.add_callback(preemption)
        return train_and_summarise(plan, trainer, preemption, tee)


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
                   "steps": trainer.state.global_step}
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
        return 2
