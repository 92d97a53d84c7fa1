"""layout.py's watcher (`run_layout`): it starts the servers and the trainer, watches every part, restarts the one
that dies while its restarts last, and otherwise stops everything.

- **A server that exits during training** (it had answered ``/health``) is started again with the same command,
  devices, port and environment, its log appended to, at most ``--max_server_restarts`` times per server. The
  trainer's requests to it wait for its ``/health`` (train.py's ``--vllm_server_restart_timeout``, which layout.py
  sets to ``--server_timeout``) and are sent again (``trl_ext.serve.client``): a checkpointed version is loaded by
  the restarted server at the first request that names it. Past the bound, or a server that never became healthy,
  or one not healthy again within ``--server_timeout``: the run stops as before (exit 1, naming the server, the
  run's last checkpoint resumes it).
- **A trainer that exits non-zero** is started again from the run's last complete checkpoint
  (``--resume_from_checkpoint latest``) at most ``--max_trainer_restarts`` times, the servers left running (the
  policy servers restarted with it when versions are pushed: a push the dead trainer left open would refuse the
  next, and a restarted server holds no pushed version). Not
  restarted: a configuration error (its run_summary.json says ``config_error``, or train.py's checks refuse the
  resumed command: exit 2), a diverged run (``numeric_fault``), a run with no complete checkpoint yet, or exit 0
  (done, or preempted by a SIGTERM: the scheduler asked for the stop).
- Every restart is said on layout.py's output, written to the run's train.log and restarts.jsonl, and listed in
  run_summary.json (``trl_ext.runs.restarts``).

When a part stops the run, every part is stopped (its whole process group: SIGTERM, then SIGKILL after `GRACE_S`).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from trl_ext.registry import ConfigError
from trl_ext.runs.restarts import record_restart, summary_status
from trl_ext.serve.plan import Layout, LayoutArgs, ServerSpec, check_trainer_plan, start_waves

GRACE_S = 20.0
"""Seconds a stopped part has between SIGTERM and SIGKILL."""
NOT_RESTARTED = ("config_error", "numeric_fault")
"""run_summary.json statuses of a trainer exit that a restart would only repeat."""
RESUME = ("--resume_from_checkpoint", "latest")


def stop(proc: subprocess.Popen) -> None:
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


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def resumed_flags(flags: list[str]) -> list[str]:
    """train.py's ``flags`` continuing the run from its last complete checkpoint: any ``--resume_from_checkpoint``
    and ``--overwrite_run`` dropped, ``--resume_from_checkpoint latest`` added."""
    out, skip = [], False
    for arg in flags:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name == "--overwrite_run":
            continue
        if name == "--resume_from_checkpoint":
            skip = "=" not in arg
            continue
        out.append(arg)
    return [*out, *RESUME]


def trainer_refusal(code: int, run_dir: Path, started: float, restarts: int, limit: int) -> str | None:
    """Why the trainer's exit with ``code`` (it started at ``time.time()`` ``started``, after ``restarts`` of at most
    ``limit``) is not restarted; None: it is (module docstring)."""
    from trl_ext.runs.checkpoints import latest_complete

    status = summary_status(run_dir, started)
    if code == 2 or status in NOT_RESTARTED:
        return f"not a crash (run_summary.json: {status or 'exit 2'}): a restart would repeat it"
    if restarts >= limit:
        return f"--max_trainer_restarts {limit} reached"
    if latest_complete(run_dir) is None:
        return f"{run_dir} has no complete checkpoint to resume from"
    return None


def server_restartable(server: Server, limit: int) -> bool:
    """Whether a server that exited is started again: it had answered /health (it died during training, not at its
    start), and it has restarts left of ``limit``."""
    return server.was_healthy and server.restarts < limit


@dataclass
class Server:
    spec: ServerSpec
    log: Path
    proc: subprocess.Popen | None = None
    restarts: int = 0
    healthy: bool = False
    was_healthy: bool = False
    deadline: float = 0.0  # time.monotonic() by which it must answer /health
    started: float = field(default_factory=time.monotonic)

    @property
    def name(self) -> str:
        return f"{self.spec.role} server {self.spec.url}"


def run_layout(layout: Layout, args: LayoutArgs, run_dir: Path, say=print, check=check_trainer_plan) -> int:
    """Start the servers (`start_waves`), then the trainer; watch them (module docstring) until the trainer ends.
    Returns the trainer's exit code, 1 when a server stopped the run, 2 when a restart's checks refused it.
    ``check``: train.py's checks of a layout's trainer (`check_trainer_plan`), run before a restart."""
    from trl_ext.runs.checkpoints import latest_complete
    from trl_ext.serve.client import Replica

    layout.log_dir.mkdir(parents=True, exist_ok=True)
    os.makedirs(layout.weights_dir, exist_ok=True)
    servers: list[Server] = []
    waves = start_waves(layout.servers, layout.cuda)
    trainer: subprocess.Popen | None = None
    trainer_restarts, trainer_started = 0, time.time()
    on_cpu = "CPU cores" if not layout.cuda else "GPUs"

    def on_signal(signum, frame):
        raise SystemExit(128 + signum)

    def launch(s: Server, restart: str = "") -> None:
        """Start ``s``; ``restart``: why it starts again (its log is appended to, after a line saying so)."""
        with open(s.log, "a" if restart else "w") as f:
            if restart:
                f.write(f"\n===== layout.py at {time.strftime('%Y-%m-%d %H:%M:%S')}: {restart} =====\n")
                f.flush()
            s.proc = subprocess.Popen(s.spec.command, env=s.spec.env, stdout=f, stderr=subprocess.STDOUT,
                                      start_new_session=True)  # fmt: skip
        s.healthy, s.started = False, time.monotonic()
        s.deadline = s.started + args.server_timeout

    def start(wave: list[ServerSpec]) -> None:
        for spec in wave:
            s = Server(spec, layout.log_dir / f"{spec.role}{spec.index}-{spec.port}.log")
            share = f", {spec.gpu_share:.3g} of their memory" if layout.cuda else ""
            say(f"layout: {spec.role} server {spec.index} on {on_cpu} {','.join(map(str, spec.devices))}{share}: "
                f"{spec.url} (log {s.log})")
            launch(s)
            servers.append(s)

    def start_trainer(command: list[str]):
        env = dict(os.environ)
        if layout.cuda:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, layout.trainer_devices))
        cores = None if layout.cuda else set(layout.trainer_devices)
        return subprocess.Popen(command, env=env, start_new_session=True,
                                preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)  # fmt: skip

    previous = signal.signal(signal.SIGTERM, on_signal)
    try:
        if layout.made_weights_dir:
            say(f"layout: weights directory {layout.weights_dir} ({layout.weights_why})")
        start(waves.pop(0))
        # started now: its imports overlap the servers' start, and train.py waits for every server's /health before
        # it loads anything (its parse-time check, --vllm_server_timeout = --server_timeout)
        trainer = start_trainer(layout.trainer)
        say(f"layout: trainer on {on_cpu} {','.join(map(str, layout.trainer_devices))}, training once every server "
            f"answers /health: {shlex.join(layout.trainer)}")
        while True:
            code = trainer.poll()
            if code is not None:
                say(f"layout: the trainer exited with code {code}")
                if code == 0:
                    return 0
                refusal = trainer_refusal(code, run_dir, trainer_started, trainer_restarts, args.max_trainer_restarts)
                if refusal is None:
                    resumed = replace(layout, flags=resumed_flags(layout.flags))
                    try:
                        check(resumed)  # train.py's checks of the resumed command: exit 2 before a start
                    except ConfigError as e:
                        say(f"layout: the trainer is not restarted: train.py refuses the resumed run: {e}")
                        return 2
                    stop(trainer)  # its whole process group (torchrun's workers) is gone before the next starts
                    if layout.pushed:  # a push the dead trainer left open would refuse the next: fresh servers
                        for s in servers:
                            if s.spec.role == "policy":
                                say(f"layout: restarting the {s.name} with the trainer (its weights were pushed)")
                                stop(s.proc)
                                launch(s, f"restarted with the trainer (restart {trainer_restarts + 1})")
                    trainer_restarts += 1
                    ckpt = latest_complete(run_dir)
                    why = f"it exited with code {code}; resumed from {ckpt.name}"
                    record_restart(run_dir, "trainer", trainer_restarts, args.max_trainer_restarts, why)
                    command = layout.trainer[: len(layout.trainer) - len(layout.flags)] + resumed.flags
                    say(f"layout: restarting the trainer ({trainer_restarts} of {args.max_trainer_restarts}) from "
                        f"{ckpt}: {shlex.join(command)}")
                    trainer_started = time.time()
                    trainer = start_trainer(command)
                    continue
                say(f"layout: the trainer is not restarted: {refusal}; the run stops (resume it with "
                    "--resume_from_checkpoint latest)")
                return code
            for s in servers:
                if s.proc.poll() is not None:
                    exit_code = s.proc.returncode
                    if server_restartable(s, args.max_server_restarts):
                        s.restarts += 1
                        why = f"it exited with code {exit_code} during training"
                        record_restart(run_dir, s.name, s.restarts, args.max_server_restarts, why)
                        say(f"layout: the {s.name} exited with code {exit_code} during training; restarting it "
                            f"({s.restarts} of {args.max_server_restarts}: same command, devices and port); the "
                            f"trainer's requests wait for it. Its log {s.log} ends:\n{tail(s.log)}")
                        stop(s.proc)  # what it left in its process group (vLLM's engine process holds its memory)
                        launch(s, f"restart {s.restarts} of {args.max_server_restarts}")
                        continue
                    when = "during training" if s.was_healthy else "before it was healthy"
                    bound = (f" (its {args.max_server_restarts} restart(s), --max_server_restarts, are spent)"
                             if s.was_healthy else "")  # fmt: skip
                    say(f"layout: the {s.name} exited with code {exit_code} {when}{bound}; stopping the trainer (its "
                        f"last checkpoint resumes the run). Its log {s.log} ends:\n{tail(s.log)}")
                    return 1
                if not s.healthy and Replica(s.spec.url).healthy(timeout=1.0):
                    s.healthy = True
                    if s.was_healthy:
                        say(f"layout: the {s.name} is healthy again, {time.monotonic() - s.started:.0f} s after it "
                            "started again")
                    s.was_healthy = True
                    if all(o.healthy for o in servers) and not waves and not any(o.restarts for o in servers):
                        say(f"layout: {len(servers)} server(s) healthy")
            if all(s.healthy for s in servers) and waves:
                start(waves.pop(0))  # the next servers of a shared GPU, once the earlier ones hold their memory
            late = next((s for s in servers if not s.healthy and time.monotonic() > s.deadline), None)
            if late is not None:
                say(f"layout: the {late.name} was not healthy within {args.server_timeout:g} s (--server_timeout); "
                    f"its log {late.log} ends:\n{tail(late.log)}")
                return 1
            time.sleep(1.0)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for proc in [trainer] * (trainer is not None) + [s.proc for s in servers]:
            stop(proc)
        if layout.made_weights_dir:
            shutil.rmtree(layout.weights_dir, ignore_errors=True)
