"""Preemption: SIGTERM (what Slurm, Kubernetes and cloud schedulers send before they kill a job) ends a train.py run
with a complete checkpoint of the current step and exit 0, so that ``--resume_from_checkpoint latest`` continues it.

- `preemption_handler` (a context manager train.py wraps around ``trainer.train()`` and the summary, never installed
  at import time) replaces SIGTERM's default action by a handler that only records the signal: nothing is interrupted
  mid-write, and a second SIGTERM while the checkpoint is being saved changes nothing (the save finishes).
- `PreemptionCallback.on_step_end` (an HF ``TrainerCallback``) looks at the flag at every optimizer-step boundary and,
  once it is set, asks HF's loop for a save and a stop (``control.should_save`` / ``control.should_training_stop``):
  HF's ``_maybe_log_save_evaluate`` then writes ``checkpoint-N`` through `runs.lifecycle.RunLifecycle` (its marker
  last, as every checkpoint) and the loop ends normally (an off-policy run's generator thread is stopped by
  ``OffPolicyMixin.train``'s ``finally``).
- Several processes: the flag is per process (a rank may receive the signal a step later than another, or not at
  all). Every rank all-reduces it (a sum over ranks) at each step boundary, so all of them stop after the same step,
  all take part in the checkpoint's collectives, and none waits in a collective for a rank that already left.
- SIGINT (Ctrl-C) is left as Python sets it (``KeyboardInterrupt`` at once): someone at the terminal wants the run to
  stop now, not after a step that may take minutes; the last periodic checkpoint is where it resumes.
"""

from __future__ import annotations

import signal
import time
from contextlib import contextmanager

from transformers import TrainerCallback

PREEMPTED = "preempted"  # run_summary.json's status of a run stopped by SIGTERM


class PreemptionFlag:
    """Whether (and when) SIGTERM arrived; `on_signal` is the signal handler and only sets attributes (printing from a
    handler could re-enter a buffered write that it interrupted)."""

    def __init__(self) -> None:
        self.received: float | None = None  # time.time() of the first SIGTERM
        self.count = 0

    def on_signal(self, signum, frame) -> None:
        self.count += 1
        if self.received is None:
            self.received = time.time()

    @property
    def requested(self) -> bool:
        return self.received is not None


@contextmanager
def preemption_handler():
    """SIGTERM sets a `PreemptionFlag` instead of ending the process, inside the ``with`` block only (the previous
    handler is restored on the way out). Yields the flag."""
    flag = PreemptionFlag()
    previous = signal.signal(signal.SIGTERM, flag.on_signal)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGTERM, previous)


def any_rank(local: bool, accelerator=None) -> bool:
    """True when ``local`` is True on any process (a sum all-reduce; ``local`` itself on one process)."""
    if accelerator is None or accelerator.num_processes == 1:
        return local
    import torch

    flag = torch.tensor([float(local)], device=accelerator.device)
    return bool(accelerator.reduce(flag, reduction="sum").item() > 0)


class PreemptionCallback(TrainerCallback):
    """Save a checkpoint and stop at the first step boundary after SIGTERM reached any process (see the module)."""

    def __init__(self, flag: PreemptionFlag, accelerator=None) -> None:
        self.flag, self.accelerator = flag, accelerator
        self.stopped_at: int | None = None  # the step whose checkpoint was saved on preemption

    def on_step_end(self, args, state, control, **kwargs):
        if self.stopped_at is None and any_rank(self.flag.requested, self.accelerator):
            self.stopped_at = state.global_step
            control.should_save = True
            control.should_training_stop = True
            where = "" if self.flag.requested else " (on another process)"
            print(f"preempted: SIGTERM received{where}; saving checkpoint-{state.global_step} (step "
                  f"{state.global_step} of {state.max_steps}) and stopping", flush=True)
        return control

    def notice(self, steps: int, max_steps: int, run_dir) -> str:
        """The line a preempted run ends its log with."""
        return (f"preempted at step {steps} of {max_steps}: {run_dir / f'checkpoint-{self.stopped_at}'} is complete; "
                "continue with the same command and --resume_from_checkpoint latest")

    def summary(self, run_dir, steps: int) -> dict:
        """run_summary.json fields of a preempted run."""
        ckpt = run_dir / f"checkpoint-{self.stopped_at}"
        return {"status": PREEMPTED, "steps": steps, "checkpoint": str(ckpt),
                "resume": "rerun the same command with --resume_from_checkpoint latest"}
