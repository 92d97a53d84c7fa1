"""How a run starts in its directory: fresh, resumed from a checkpoint, or over an old run moved aside.

Nothing is ever overwritten silently: a run directory that already holds a run (checkpoints, a run_summary.json or a
train.log) is refused unless the command says ``--resume_from_checkpoint latest|PATH`` (continue it) or
``--overwrite_run`` (rename the old directory to ``{run_dir}.old-{timestamp}``; nothing is deleted). Every refusal is
a ConfigError, raised before any model is loaded.
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path

import yaml
from transformers import TrainerCallback

from trl_ext.naming import is_defining
from trl_ext.registry import ConfigError
from trl_ext.runlog import Tee
from trl_ext.runs.checkpoints import (
    checkpoint_step, config_differences, list_checkpoints, resolve_resume, saved_run_config,
)
from trl_ext.runs.rollouts import discard_after

PREVIOUS_RUN_FILES = ("run_summary.json", "train.log")


def previous_run(run_dir: Path) -> str | None:
    """What in ``run_dir`` shows an earlier run (None when there is nothing)."""
    found = [p.name for _, p, _ in list_checkpoints(run_dir)]
    found += [name for name in PREVIOUS_RUN_FILES if (run_dir / name).exists()]
    return ", ".join(found) if found else None


def aside_name(run_dir: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate, n = run_dir.with_name(f"{run_dir.name}.old-{stamp}"), 1
    while candidate.exists():
        n += 1
        candidate = run_dir.with_name(f"{run_dir.name}.old-{stamp}-{n}")
    return candidate


def check_run_dir(run_dir: Path, resume: str | None, overwrite: bool, current_config: dict) -> Path | None:
    """Validate how the run starts; return the checkpoint to resume from (None = a fresh start).

    ``current_config`` is the command's run_config.yaml content (``runlog.resolved_config``)."""
    if resume and overwrite:
        raise ConfigError("--resume_from_checkpoint and --overwrite_run exclude each other (continue the old run, or "
                          "move it aside and start over)")
    if resume:
        ckpt = resolve_resume(resume, run_dir)
        current = yaml.safe_load(yaml.safe_dump(current_config, sort_keys=False))
        diffs = config_differences(saved_run_config(ckpt), current, is_defining)
        if diffs:
            raise ConfigError(f"--resume_from_checkpoint {ckpt}: the checkpoint's run differs from this command in "
                              f"run-defining values: {'; '.join(diffs)}")
        if ckpt.resolve().parent == run_dir.resolve():
            newer = [p.name for step, p, done in list_checkpoints(run_dir) if done and step > checkpoint_step(ckpt)]
            if newer:
                raise ConfigError(f"--resume_from_checkpoint {ckpt}: {run_dir} has newer checkpoints "
                                  f"({', '.join(newer)}) that the resumed run would overwrite; resume from latest, or "
                                  "resume into another directory (--output_dir)")
        return ckpt
    found = previous_run(run_dir)
    if found and not overwrite:
        raise ConfigError(f"{run_dir} already holds a run ({found}); continue it with --resume_from_checkpoint latest, "
                          "or start over with --overwrite_run (moves the old directory aside, deletes nothing)")
    return None


def move_incomplete_checkpoints(run_dir: Path) -> list[Path]:
    """Rename interrupted checkpoints (no marker) to ``incomplete-checkpoint-N-{timestamp}`` before a resume, so a
    re-save of step N never mixes with a half-written directory; returns the new paths."""
    moved = []
    for step, path, done in list_checkpoints(run_dir):
        if not done:
            target = run_dir / f"incomplete-{path.name}-{time.strftime('%Y%m%d-%H%M%S')}"
            path.rename(target)
            moved.append(target)
    return moved


def open_run_dir(plan):
    """Move an old run aside (--overwrite_run) or set the run directory up for the resume (``plan``: train.py's Plan,
    after `check_run_dir`); start the train.log tee (appended to on resume, after a visible marker)."""
    notes = []
    if plan.resume is None and plan.run.overwrite_run and plan.run_dir.exists() and previous_run(plan.run_dir):
        target = aside_name(plan.run_dir)
        plan.run_dir.rename(target)
        notes.append(f"--overwrite_run: the previous run was moved to {target}")
    if plan.resume is not None:
        notes += [f"incomplete checkpoint moved aside: {p}" for p in move_incomplete_checkpoints(plan.run_dir)]
        discarded = discard_after(plan.run_dir, checkpoint_step(plan.resume) or 0)
        if discarded is not None:
            notes.append(f"rollouts of steps after the checkpoint moved to {discarded}")
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    tee = Tee(plan.run_dir / "train.log")
    if plan.resume is not None:
        print(f"\n{'=' * 30} RESUMED from {plan.resume} at {time.strftime('%Y-%m-%d %H:%M:%S')} {'=' * 30}")
    print(f"$ train.py {shlex.join(plan.argv)}\nrun dir: {plan.run_dir}", flush=True)
    for note in notes:
        print(note, flush=True)
    return tee


def start_on_main(plan, prepare=None):
    """The main process's share of starting a run of ``plan``: `open_run_dir`, ``prepare(plan)`` if given (e.g. wandb,
    whose choice run_config.yaml records), run_config.yaml. Returns the train.log tee; None on the other processes,
    which write nothing. (train.log's launch line waits for the prepared model: `LaunchHeader`.)"""
    from trl_ext.launch.processes import is_main, launch_record
    from trl_ext.runlog import write_run_config

    if not is_main():
        return None
    tee = open_run_dir(plan)
    if prepare is not None:
        prepare(plan)
    from trl_ext.runs.recipe import FLAGS_SECTION

    write_run_config(plan.run_dir / "run_config.yaml", plan.run, plan.cfg,
                     extra={**(launch_record() or {}), FLAGS_SECTION: plan.flags or {}})  # a recipe of this run
    return tee


class LaunchHeader(TrainerCallback):
    """train.log's launch line (processes, the parallelism in effect, the global batch: `describe_launch`) once the
    Trainer has prepared the model, on the main process; on several processes the parallelism also goes into
    run_config.yaml's ``launch`` section (``parallelism``: a description, not compared on resume), before the first
    checkpoint copies the file. Read from ``trainer.parallelism`` (`trl_ext.runs.lifecycle.RunLifecycle`)."""

    def __init__(self, plan, trainer):
        self.plan, self.trainer = plan, trainer

    def on_train_begin(self, args, state, control, **kwargs):
        from trl_ext.launch.processes import describe_launch, is_main

        found = self.trainer.parallelism
        if not is_main():
            return
        print(describe_launch(self.plan.cfg, found.describe()), flush=True)
        path = self.plan.run_dir / "run_config.yaml"
        config = yaml.safe_load(path.read_text()) if path.is_file() else None
        if found.processes > 1 and isinstance(config, dict) and isinstance(config.get("launch"), dict):
            config["launch"]["parallelism"] = found.describe()
            path.write_text(yaml.safe_dump(config, sort_keys=False))


def add_launch_header(plan, trainer) -> None:
    """`LaunchHeader` as ``trainer``'s first callback: its line comes before the progress bar's."""
    trainer.add_callback(LaunchHeader(plan, trainer))
    callbacks = trainer.callback_handler.callbacks
    callbacks.insert(0, callbacks.pop())
