"""``--mode sft`` (RAGEN early 2025, SFT mode): supervised fine-tuning on BFS-optimal or scripted trajectories.

1. Data: the BFS solver's shortest action path, or an environment's scripted actions (arithmetic: the exact value;
   search: search, read, answer) (``environments.solvers.shortest_actions``; on FrozenLake
   the non-slippery path of the same map, also for slippery ice, see ``FrozenLakeEnv.sft_params``) on the
   ``--sft_train_size`` training levels (seeds ``TRAIN_LEVELS ..``); one (prompt, completion) record per
   step, the prompt being the episode so far as the policy sees it (plain text, or chat messages for a
   model with a chat template) and the completion ``<answer>action</answer>``.
2. Training: TRL's SFTTrainer, completion-only loss, LoRA (``--lora_rank``) or full, ``--sft_epochs``
   epochs at ``--lr``; the result (LoRA merged) is saved to ``<run dir>/model``: pass that directory as
   ``--model`` to start an RL run from it.
3. Validation: greedy rollouts on ``--sft_test_size`` held-out levels (seeds ``HELDOUT_LEVELS ..``) of
   the environment as ``--env_params`` configure it (slippery FrozenLake by default) for
   up to ``--max_turns`` turns, before and after training; success rate and mean return in
   ``run_summary.json``.
4. SIGTERM (a scheduler's preemption): a complete checkpoint of the current step, ``run_summary.json`` status
   "preempted", exit 0, no model saved; ``--resume_from_checkpoint latest`` continues (``trl_ext.runs.preemption``).
5. FSDP2 (``--fsdp``): the SFTTrainer trains the sharded model on every process. The main process keeps a plain copy
   of the model made before the Trainer shards it (`plain_copy`, on the CPU); after training every process takes part
   in gathering the whole parameters from the shards (`gather_into`, a collective), which the main process loads into
   its copy, and it merges, saves and validates that copy as it does the trained model without FSDP.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass, field

from environments.base import Trajectory, env_class, make_env, parse_env_params, run_episodes
from environments.base import truncate_after_answer
from environments.solvers import solved_steps, solver_env_names
from trl_ext.env.args import HELDOUT_LEVELS, TRAIN_LEVELS
from trl_ext.env.episodes import decode_agent, uses_chat
from trl_ext.registry import ConfigError

MODES = ("rl", "sft")


@dataclass
class SFTArgs:
    _argument_group_name = "SFT mode (trl_ext.sft)"  # train.py --help group (cli_help.py)

    mode: str = field(default="rl", metadata={"help": "rl (GRPO) or sft (RAGEN SFT mode on BFS trajectories; --env)."})
    sft_train_size: int = field(default=2000, metadata={"help": "SFT mode: training levels solved by BFS."})
    sft_test_size: int = field(default=200, metadata={"help": "SFT mode: held-out levels of the validation rollout."})
    sft_epochs: float = field(default=5.0, metadata={"help": "SFT mode: epochs over the BFS records (a given --max_steps "
                                                              "ends the run at that step instead)."})

    def validate_sft(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        for flag in ("sft_train_size", "sft_test_size"):
            if getattr(self, flag) < 1:
                raise ConfigError(f"--{flag} must be >= 1, got {getattr(self, flag)}")
        if not self.sft_epochs > 0:
            raise ConfigError(f"--sft_epochs must be > 0, got {self.sft_epochs}")
        if self.mode == "sft":
            if not self.env:
                raise ConfigError(f"--mode sft needs --env (one with a solver: {', '.join(solver_env_names())})")
            if not env_class(self.env).has_solver:
                raise ConfigError(f"--mode sft: environment {self.env!r} has no solver (BFS or scripted); "
                                  f"environments with one: {', '.join(solver_env_names())}")  # fmt: skip


def _prompt(traj: Trajectory, env, chat: bool):
    return traj.messages(system=env.instructions) if chat else traj.history_text()


def _completion(answer: str, env, chat: bool):
    """Plain: the answer (the prompt ends with the prefill); chat: an assistant turn, prefill included."""
    return [{"role": "assistant", "content": env.prefill + answer}] if chat else answer


def sft_records(env_name: str, n: int, start: int, chat: bool, env_params: dict | None = None) -> list[dict]:
    """(prompt, completion) records along the BFS paths of levels ``start .. start + n - 1``
    (``solved_steps``: on FrozenLake the non-slippery paths), as plain text or as chat messages."""
    return [{"prompt": _prompt(traj, env, chat), "completion": _completion(answer, env, chat)}
            for env, traj, answer in solved_steps(env_name, n, start, **(env_params or {}))]  # fmt: skip


def model_policy(model, tokenizer, env, max_new_tokens: int, do_sample: bool = False):
    """A ``run_episodes`` policy: generate from each history, cut after the first ``</answer>``."""
    import torch

    chat = uses_chat(tokenizer)

    def policy(trajs: list[Trajectory]) -> list[str]:
        texts = [_prompt(t, env, chat) for t in trajs]
        if chat:
            texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) + env.prefill
                     for m in texts]  # fmt: skip
        enc = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt").to(model.device)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=do_sample,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
        new = out[:, enc["input_ids"].shape[1] :]
        return [truncate_after_answer(decode_agent(tokenizer, g.tolist())) for g in new]

    return policy


def validate(
    model, tokenizer, env_name: str, n: int, max_turns: int, max_new_tokens: int, batch: int = 50,
    env_params: dict | None = None, do_sample: bool = False,
) -> dict:
    """Rollouts (greedy, or sampled at temperature 1) on the held-out levels ``HELDOUT_LEVELS .. + n - 1``:
    success rate, mean return, invalid-answer fraction."""
    trajs = []
    model.eval()
    for lo in range(0, n, batch):
        seeds = list(range(HELDOUT_LEVELS + lo, HELDOUT_LEVELS + min(n, lo + batch)))
        envs = [make_env(env_name, **(env_params or {})) for _ in seeds]
        policy = model_policy(model, tokenizer, envs[0], max_new_tokens, do_sample)
        trajs += run_episodes(envs, policy, seeds, max_turns)
    return {
        "levels": n,
        "success_rate": sum(t.success for t in trajs) / n,
        "mean_return": sum(t.total_reward for t in trajs) / n,
        "invalid_frac": sum(t.n_invalid for t in trajs) / sum(len(t.turns) for t in trajs),
    }


def sft_trainer_class():
    """TRL's SFTTrainer with atomic checkpoints, loud numeric faults and FSDP2 on CPU processes
    (`trl_ext.runs.lifecycle`)."""
    from trl import SFTTrainer

    from trl_ext.runs.lifecycle import RunLifecycle

    class CheckpointedSFTTrainer(RunLifecycle, SFTTrainer):
        def train(self, resume_from_checkpoint=None, *args, **kwargs):
            self.restore_run_state(resume_from_checkpoint)
            return super().train(resume_from_checkpoint, *args, **kwargs)

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.check_loss(loss)
            return loss

    return CheckpointedSFTTrainer


def plain_copy(trainer, main_process: bool):
    """Under FSDP2, on the main process: a plain CPU copy of the trainer's model (PEFT-wrapped as it trains), made
    before the Trainer shards it in place (a sharded model cannot be copied into a plain one); None elsewhere."""
    from trl_ext.offpolicy.sharded import is_sharded
    from trl_ext.offpolicy.worker import generation_copy

    if not trainer.is_fsdp_enabled or not main_process:
        return None
    model = trainer.accelerator.unwrap_model(trainer.model)
    if is_sharded(model):
        raise RuntimeError("the model is sharded already: SFT mode's plain copy cannot be made")
    return generation_copy(model).to("cpu")


def gather_into(trainer, plain) -> None:
    """The trained parameters, gathered whole from the FSDP2 shards (a collective: every process calls it), loaded
    into the main process's ``plain`` copy (`plain_copy`; None on the other processes, which receive nothing:
    ``cpu_offload`` hands the whole tensors to process 0 only)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from trl_ext.offpolicy.sharded import load_full

    model = trainer.accelerator.unwrap_model(trainer.model)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if plain is not None:
        names = [n for n, _ in plain.named_parameters()]
        if missing := [n for n in names if n not in state]:
            raise RuntimeError(f"the gathered state dict lacks parameters {missing[:3]}")
        load_full(plain, {n: state[n] for n in names})


def run_sft(plan) -> int:
    """SFT mode of train.py: data, SFTTrainer, merged save, validation before/after; returns 0."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig

    from trl_ext.launch.processes import barrier
    from trl_ext.models import model_source, load_tokenizer, prepare_tokenizer
    from trl_ext.runs.preemption import PreemptionCallback, preemption_handler
    from trl_ext.runs.provenance import start_weights
    from trl_ext.runs.rundir import add_launch_header, start_on_main

    run, cfg = plan.run, plan.cfg
    tee = start_on_main(plan)  # only the main process writes the run directory, validates and saves the model
    main_process = tee is not None
    model_path = model_source(run.model)
    tokenizer = prepare_tokenizer(load_tokenizer(model_path))
    model = AutoModelForCausalLM.from_pretrained(model_path)
    start_weights(plan, model_path)  # recorded, or checked on a resume
    env_params = parse_env_params(cfg.env_params)
    records = sft_records(cfg.env, cfg.sft_train_size, TRAIN_LEVELS, uses_chat(tokenizer), env_params)
    val_args = (cfg.env, cfg.sft_test_size, cfg.turns, cfg.max_completion_length)
    if main_process:
        print(f"sft: {len(records)} records from {cfg.sft_train_size} solved levels", flush=True)
        before = validate(model, tokenizer, *val_args, env_params=env_params)
        print(f"validation before SFT: {before}", flush=True)
    barrier()  # the run directory exists (and the validation ran) before any process trains
    peft_config = None
    if run.lora_rank:
        from peft import LoraConfig

        peft_config = LoraConfig(r=run.lora_rank, lora_alpha=run.lora_alpha, task_type="CAUSAL_LM",
                                 **run.lora_targets.peft_kwargs())  # targets: build_plan (check_run_adapters)
    sft_cfg = SFTConfig(
        output_dir=str(plan.run_dir), num_train_epochs=cfg.sft_epochs, learning_rate=cfg.learning_rate,
        max_steps=cfg.max_steps if "max_steps" in (plan.flags or {}) else -1,  # given: it ends the run, else the epochs
        per_device_train_batch_size=cfg.per_device_train_batch_size, logging_steps=cfg.logging_steps,
        save_strategy="steps", save_steps=cfg.save_steps, report_to=[] if run.no_wandb else ["wandb"], seed=cfg.seed, bf16=cfg.bf16,
        max_length=None, lr_scheduler_type=cfg.lr_scheduler_type, warmup_steps=cfg.warmup_steps,
        activation_checkpointing=cfg.activation_checkpointing,
        use_cpu=cfg.use_cpu, ddp_backend=cfg.ddp_backend,  # several processes on CPU: gloo (launch.processes)
        fsdp=cfg.fsdp, fsdp_config=copy.deepcopy(cfg.fsdp_config) if cfg.fsdp else None,  # --fsdp, as GRPO runs read it
    )  # fmt: skip
    trainer = sft_trainer_class()(model=model, args=sft_cfg, train_dataset=Dataset.from_list(records),
                         processing_class=tokenizer, peft_config=peft_config)  # fmt: skip
    add_launch_header(plan, trainer)  # train.log's launch line, once the model is prepared
    plain = plain_copy(trainer, main_process)  # FSDP2: the main process's copy to merge, save and validate
    start = time.time()
    with preemption_handler() as flag:  # SIGTERM: a checkpoint at the next step boundary, then exit 0 (as GRPO runs)
        preemption = PreemptionCallback(flag, trainer.accelerator)
        trainer.add_callback(preemption)
        result = trainer.train(resume_from_checkpoint=str(plan.resume) if plan.resume else None)
    steps = trainer.state.global_step
    preempted = preemption.stopped_at is not None and steps < trainer.state.max_steps  # the same on every process
    if trainer.is_fsdp_enabled and not preempted:
        gather_into(trainer, plain)  # every process, then only the main process's copy is used
    if not main_process:
        return 0
    if preempted:
        summary = {"mode": "sft", "run_name": cfg.run_name, **preemption.summary(plan.run_dir, steps),
                   "wall_s": round(time.time() - start, 1)}  # fmt: skip
        (plan.run_dir / "run_summary.json").write_text(json.dumps(summary, indent=2))
        print(preemption.notice(steps, trainer.state.max_steps, plan.run_dir), flush=True)
        tee.close()
        return 0
    model = trainer.model if plain is None else plain.to(trainer.args.device)
    model = model.merge_and_unload() if run.lora_rank else model
    model_dir = plan.run_dir / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    after = validate(model, tokenizer, *val_args, env_params=env_params)
    print(f"validation after SFT: {after}", flush=True)
    summary = {
        "status": "done", "mode": "sft", "run_name": cfg.run_name, "env": cfg.env, "records": len(records),
        "steps": result.global_step,
        "train_loss": result.training_loss, "wall_s": round(time.time() - start, 1),
        "validation_before": before, "validation_after": after, "model_dir": str(model_dir),
    }  # fmt: skip
    (plan.run_dir / "run_summary.json").write_text(json.dumps(summary, indent=2))
    print(f"done: {plan.run_dir} (RL from it: --model {model_dir})", flush=True)
    tee.close()
    return 0
