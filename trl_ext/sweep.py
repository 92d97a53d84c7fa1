"""Sweeps: a grid of train.py runs scheduled on one machine (seed 004's sweep.py).

    uv run sweep.py --reward sentence_length_5 --grid seed=42,123,7 beta=0.01,0.02 \\
        --fixed lr=1e-5 max_steps=2000 --per_gpu 12

Planning (``trl_ext.sweep_plan``): the Cartesian product of ``--grid`` values plus the ``--fixed`` values and
bare ``--train_flags`` gives one train.py command per run, each validated with ``cli_train.build_plan`` before
anything launches (one bad value fails the sweep, exit 2); its directory is the one train.py uses.

Scheduling: with GPUs, ``--per_gpu N`` runs per visible GPU, each child pinned (CUDA_VISIBLE_DEVICES) to
the least-loaded GPU; NVIDIA MPS is detected through its control pipe and reported (children use it when
its daemon runs). Without a GPU, ``--parallel N`` CPU slots (default: one per core). Each child gets
``max(1, cores // slots)`` torch threads through OMP_NUM_THREADS / MKL_NUM_THREADS, read by torch at start,
and OMP_WAIT_POLICY=PASSIVE unless set (idle OpenMP threads sleep instead of spinning on shared cores).

Resumability: a run whose ``run_summary.json`` says "done" is skipped. An unfinished run (crashed, killed or
interrupted) continues from its newest complete checkpoint (train.py ``--resume_from_checkpoint latest``: an exact
resume, see ``trl_ext.runs``); one with no complete checkpoint, or every unfinished one with
``--restart_unfinished``, is moved to ``{sweep_dir}/incomplete/`` and restarts from scratch. A lock per run
(``{output_dir}/.locks/``) keeps two sweeps from running the same run at once (status BUSY).

Logs: train.py tees its output to ``{run_dir}/train.log``; the child's terminal output (all of it, errors
raised before the tee starts included) goes to ``{sweep_dir}/logs/{run}.log``: one writer per file.
A run that exits non-zero or leaves no "done" summary is FAILED, with its log tail; the others go on.

Several machines: ``--shard K/N`` (or ``--shard env``: a Slurm job array's task) runs the K-th of N slices of the
plan (``sweep_plan.shard_runs``), in the sweep directory every shard shares; a shard's files are named for it
(``sweep.shardKofN.yaml``, ``summary.shardKofN.*``), and ``--summarize`` merges them and the run directories into
``summary.*`` (``trl_ext.sweep_summary``). Several processes per run: ``--procs_per_run N`` launches each run with
torchrun on its own rendezvous port, validated and named (``_procsN``) at plan time as train.py does under torchrun.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from trl_ext.registry import ConfigError
from trl_ext.runs.checkpoints import latest_complete
from trl_ext.sweep_plan import PlannedRun, build_spec, parse_shard, plan_runs, shard_runs, sweep_dir_for
from trl_ext.sweep_summary import (RunResult, fill_metrics, is_done, merge_results, shard_suffix, summary_table,
                                   write_summary)  # fmt: skip

TRAIN_SCRIPT = Path(__file__).resolve().parents[1] / "train.py"
DEFAULT_PER_GPU = 1
MPS_PIPE_DEFAULT = "/tmp/nvidia-mps"
POLL_S = 0.5


def _help(text: str, default=None, factory=None):
    kw = {"default_factory": factory} if factory else {"default": default}
    return field(metadata={"help": text}, **kw)


@dataclass
class SweepArgs:
    reward: str | None = _help("Reward binding of every run (= --fixed reward=NAME).")
    grid: list[str] = _help("Swept train.py flags KEY=V1,V2,...: one run per combination.", factory=list)
    fixed: list[str] = _help("train.py flags shared by all runs, KEY=VALUE (the value is taken whole).", factory=list)
    train_flags: list[str] = _help("Bare boolean train.py flags, without dashes (e.g. no_wandb).", factory=list)
    baselines: list[str] = _help("Baseline arms added next to every routed run (plain, filter, reward_penalty, "
                                 "retain_penalty); replaces a sweep file's baselines.", factory=list)
    config: str | None = _help(
        "Named sweep YAML (keys: description, recipe, reward, grid, fixed, train_flags); a key given on the command "
        "line replaces the file's. train.py's own reward YAML is --fixed config=FILE."
    )
    recipe: list[str] = _help("train.py recipes (run files, trl_ext.runs.recipe) every run starts from, the sweep's "
                              "fixed and grid values over them; replaces a sweep file's recipe.", factory=list)
    dry_run: bool = _help("Print the planned runs (command, directory) and launch nothing.", False)
    per_gpu: int | None = _help(f"Concurrent runs per visible GPU (default {DEFAULT_PER_GPU}).")
    parallel: int | None = _help("Concurrent runs on a machine without GPU (default: one per CPU core).")
    sweep_name: str | None = _help("Sweep directory {output_dir}/sweeps/NAME (default: grid keys, run count, hash).")
    restart_unfinished: bool = _help("Restart unfinished runs from scratch (their directories are moved to "
                                     "{sweep dir}/incomplete/) instead of resuming them from their latest checkpoint.",
                                     False)
    shard: str | None = _help("Run only the K-th of N slices of the planned runs, K/N (runs whose place in the plan "
                              "is K-1 modulo N), so that N machines cover the grid; 'env' reads a Slurm job "
                              "array's task (SLURM_ARRAY_TASK_ID/MIN/MAX/COUNT). Summaries: summary.shardKofN.*.")
    summarize: bool = _help("Launch nothing: merge every shard's summary and the run directories of the whole "
                            "grid into {sweep dir}/summary.* (exit 0 when every run is done, 1 otherwise).", False)
    procs_per_run: int = _help("Processes per run: >1 launches each run with torchrun (python -m "
                               "torch.distributed.run --nproc_per_node N), one GPU per process with GPUs.", 1)
    status_every: float = _help("Seconds between live status lines.", 30.0)
    log_tail: int = _help("Lines of a failed run's log kept in the summary.", 20)


# ------------------------------------------------------------------------------------------ resources
@dataclass
class Resources:
    gpus: list[str]  # CUDA_VISIBLE_DEVICES ids; empty = CPU slots
    per_slot: int  # concurrent runs per GPU (per GPU group with several processes), or CPU slots
    threads: int  # torch threads per process
    mps: str | None  # MPS pipe directory when its daemon runs
    procs: int = 1  # processes per run (torchrun); with GPUs, one GPU each

    @property
    def devices(self) -> list[str]:
        """Slot keys: ``procs`` GPU ids per group (a run's CUDA_VISIBLE_DEVICES; leftover GPUs stay idle), or cpu."""
        n = self.procs
        return [",".join(self.gpus[i * n:(i + 1) * n]) for i in range(len(self.gpus) // n)] if self.gpus else ["cpu"]

    @property
    def capacity(self) -> int:
        return self.per_slot * len(self.devices)

    def describe(self) -> str:
        unit = "run" if self.procs == 1 else "process"
        procs = f", {self.procs} processes per run (torchrun)" if self.procs > 1 else ""
        if not self.gpus:
            return f"{self.per_slot} CPU slots{procs}, {self.threads} torch thread(s) per {unit}"
        mps = f"MPS active ({self.mps})" if self.mps else (
            "MPS not running: runs sharing a GPU time-slice (start it: nvidia-cuda-mps-control -d)")
        groups = f" in {len(self.devices)} group(s) [{' '.join(self.devices)}]" if self.procs > 1 else ""
        idle = len(self.gpus) - self.procs * len(self.devices)
        idle = f", {idle} GPU(s) idle" if idle else ""
        return (f"{len(self.gpus)} GPU(s) [{','.join(self.gpus)}]{groups} x {self.per_slot} runs{procs}{idle}, "
                f"{mps}, {self.threads} CPU thread(s) per {unit}")  # fmt: skip


def visible_gpus(env: dict) -> list[str]:
    """GPU ids a child may be pinned to: CUDA_VISIBLE_DEVICES' entries (up to an invalid one such as -1,
    where CUDA stops), else every device torch sees."""
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    ids = [x.strip() for x in cvd.split(",")]
    return list(itertools.takewhile(lambda x: x != "" and not x.startswith("-"), ids))


def mps_pipe(env: dict) -> str | None:
    pipe = Path(env.get("CUDA_MPS_PIPE_DIRECTORY", MPS_PIPE_DEFAULT))
    return str(pipe) if (pipe / "control").exists() else None


def resolve_resources(args: SweepArgs, env: dict, cpus: int) -> Resources:
    """Slots and threads. ``--procs_per_run N`` counts N processes per run: N GPUs per run (one per process, as
    accelerate's DDP places them), or N cores per CPU slot (default slots: cores // N)."""
    procs = args.procs_per_run
    if procs < 1:
        raise ConfigError(f"--procs_per_run must be >= 1, got {procs}")
    gpus = visible_gpus(env)
    if gpus and len(gpus) < procs:
        raise ConfigError(f"--procs_per_run {procs} gives each run {procs} GPUs (one per process); "
                          f"{len(gpus)} visible")  # fmt: skip
    if gpus and args.parallel is not None:
        raise ConfigError(f"--parallel is for machines without GPU; {len(gpus)} visible (use --per_gpu, or "
                          "CUDA_VISIBLE_DEVICES= to train on CPU)")  # fmt: skip
    if not gpus and args.per_gpu is not None:
        raise ConfigError("--per_gpu needs a visible GPU and there is none; use --parallel")
    per_slot = (DEFAULT_PER_GPU if args.per_gpu is None else args.per_gpu) if gpus else (
        max(1, cpus // procs) if args.parallel is None else args.parallel)
    if per_slot < 1:
        raise ConfigError(f"--per_gpu / --parallel must be >= 1, got {per_slot}")
    res = Resources(gpus, per_slot, 1, mps_pipe(env) if gpus else None, procs)
    res.threads = max(1, cpus // (res.capacity * procs))
    return res


class Slots:
    """Where the next child runs: the least-loaded GPU with a free slot (ties: first listed), or a CPU slot."""

    def __init__(self, res: Resources):
        self.load = dict.fromkeys(res.devices, 0)
        self.limit = res.per_slot

    def acquire(self) -> str | None:
        dev = min(self.load, key=self.load.__getitem__)
        if self.load[dev] >= self.limit:
            return None
        self.load[dev] += 1
        return dev

    def release(self, dev: str) -> None:
        self.load[dev] -= 1


def child_env(base: dict, res: Resources, dev: str) -> dict:
    """The child's environment: its thread count, its GPU, and OpenMP threads that sleep rather than spin
    while waiting (the runs share cores; OMP_WAIT_POLICY is kept when the caller set it)."""
    env = {"OMP_WAIT_POLICY": "PASSIVE", **base, "OMP_NUM_THREADS": str(res.threads),
           "MKL_NUM_THREADS": str(res.threads), "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    if res.gpus:
        env["CUDA_VISIBLE_DEVICES"] = dev
    return env


# ------------------------------------------------------------------------------------------ running
def _tail(path: Path, n: int) -> list[str]:
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, 2) - 65536))
        return f.read().decode(errors="replace").replace("\r", "\n").splitlines()[-n:]


def _progress(run_dir: Path) -> str:
    log = run_dir / "train.log"
    if not log.is_file():
        return "starting"
    hits = re.findall(r"(\d+)/(\d+) \[", "\n".join(_tail(log, 40)))
    return f"step {hits[-1][0]}/{hits[-1][1]}" if hits else "loading"


def _lock(run: PlannedRun) -> int | None:
    lock_dir = run.run_dir.parent / ".locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_dir / f"{run.name}.lock", os.O_CREAT | os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        return None


@dataclass
class _Active:
    run: PlannedRun
    proc: subprocess.Popen
    dev: str
    lock: int
    log: Path
    t0: float
    port: int | None = None  # torchrun's rendezvous port (several processes)


def _say(msg: str) -> None:
    print(msg, flush=True)


def execute(runs: list[PlannedRun], sweep_dir: Path, res: Resources, status_every: float, log_tail: int,
            say=_say, restart: bool = False, shard: tuple | None = None) -> tuple[list[RunResult], bool]:  # fmt: skip
    """Run (or skip) every planned run; returns the results in plan order and whether it was interrupted."""
    results: dict[str, RunResult] = {}
    shard_label = f"{shard[0]}/{shard[1]}" if shard else None

    def record(run, status, launched, **kw):
        result = RunResult(run.label, run.name, str(run.run_dir), status, launched, shard=shard_label, **kw)
        results[run.name] = fill_metrics(result)

    queue, active, slots, interrupted = [], {}, Slots(res), False
    for run in runs:
        if is_done(run.run_dir):
            say(f"[sweep] skip (done earlier): {run.label}")
            record(run, "done", False)
        else:
            queue.append(run)
    (sweep_dir / "logs").mkdir(parents=True, exist_ok=True)
    last_status = time.time()
    try:
        while queue or active:
            while queue and (dev := slots.acquire()) is not None:
                run = queue.pop(0)
                started = _start(run, dev, sweep_dir, res, say, restart, {a.port for a in active.values()})
                if isinstance(started, _Active):
                    active[run.name] = started
                    continue
                slots.release(dev)
                record(run, started, False)
            for name, a in list(active.items()):
                if a.proc.poll() is None:
                    continue
                del active[name]
                slots.release(a.dev)
                os.close(a.lock)
                ok = a.proc.returncode == 0 and is_done(a.run.run_dir)
                tail = [] if ok else _tail(a.log, log_tail)
                summary = a.run.run_dir / "run_summary.json"  # exit 0 "preempted" (SIGTERM): the next sweep resumes it
                preempted = not ok and a.proc.returncode == 0 and summary.is_file() and \
                    json.loads(summary.read_text()).get("status") == "preempted"
                record(a.run, "done" if ok else "PREEMPTED" if preempted else "FAILED", True,
                       wall_s=round(time.time() - a.t0, 1),
                       returncode=a.proc.returncode, device=a.dev, log=str(a.log), log_tail=tail)  # fmt: skip
                r = results[name]
                say(f"[sweep] {r.status}: {a.run.label} (exit {r.returncode}, {r.wall_s} s, steps {r.steps})"
                    + ("".join(f"\n    | {line}" for line in tail[-5:]) + f"\n    log: {a.log}" if tail else ""))
            if time.time() - last_status >= status_every and active:
                last_status = time.time()
                counts = {s: sum(r.status == s for r in results.values()) for s in ("done", "FAILED")}
                say(f"[sweep {time.strftime('%H:%M:%S')}] {counts['done']} done, {counts['FAILED']} failed, "
                    f"{len(active)} running, {len(queue)} queued | "
                    + "; ".join(f"{a.run.label}: {_progress(a.run.run_dir)}" for a in active.values()))
            time.sleep(POLL_S if active else 0)
    except KeyboardInterrupt:
        interrupted = True
        say(f"[sweep] interrupted: stopping {len(active)} running run(s)")
        for a in active.values():
            a.proc.terminate()
        for a in active.values():
            try:
                a.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                a.proc.kill()
                a.proc.wait()
            record(a.run, "INTERRUPTED", True, returncode=a.proc.returncode, device=a.dev, log=str(a.log))
        for run in queue:
            record(run, "NOT_STARTED", False)
    finally:
        for a in active.values():
            if a.proc.poll() is None:  # the sweep itself failed: leave no orphaned runs behind
                a.proc.kill()
                a.proc.wait()
            os.close(a.lock)
    return [results[r.name] for r in runs], interrupted


def free_port(taken: set) -> int:
    """A TCP port free on this machine now (the OS picks it) and not held by another running run of this sweep:
    torchrun's rendezvous port (``--master_port``), one per concurrent multi-process run."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in taken:
            return port


def train_command(argv: list[str], procs: int = 1, port: int | None = None) -> list[str]:
    """``python train.py ARGV``; several processes: ``python -m torch.distributed.run --nproc_per_node N
    --master_port PORT train.py ARGV`` (torchrun: what accelerate launch runs for DDP; on CPU ``accelerate launch
    --cpu`` starts one process only, see docs/processes.md)."""
    if procs == 1:
        return [sys.executable, str(TRAIN_SCRIPT), *argv]
    if port is None:
        raise ValueError("a multi-process run needs its own --master_port")
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_port", str(port),
            str(TRAIN_SCRIPT), *argv]  # fmt: skip


def resumable(procs: int) -> bool:
    """Whether train.py resumes a run of ``procs`` processes (--resume_from_checkpoint is refused on several
    processes while `trl_ext.launch.processes.CFG_FLAGS` lists it)."""
    from trl_ext.launch.processes import CFG_FLAGS

    return procs == 1 or all(flag != "resume_from_checkpoint" for flag, *_ in CFG_FLAGS)


def _start(run: PlannedRun, dev: str, sweep_dir: Path, res: Resources, say, restart: bool = False,
           ports: set = frozenset()) -> _Active | str:  # fmt: skip
    lock = _lock(run)
    if lock is None:
        say(f"[sweep] BUSY: {run.label} is being run by another process ({run.run_dir})")
        return "BUSY"
    if is_done(run.run_dir):  # finished by another process since the plan was made
        os.close(lock)
        return "done"
    ckpt = None if restart or not run.run_dir.exists() else latest_complete(run.run_dir)
    if ckpt and not resumable(res.procs):
        say(f"[sweep] {run.label}: --resume_from_checkpoint runs on one process for now; restarting from scratch")
        ckpt = None
    resume = ["--resume_from_checkpoint", "latest"] if ckpt else []
    if ckpt:
        say(f"[sweep] unfinished run resumes from {ckpt}")
    elif run.run_dir.exists():
        base = sweep_dir / "incomplete" / f"{run.name}.{time.strftime('%Y%m%d-%H%M%S')}"
        base.parent.mkdir(parents=True, exist_ok=True)
        stale, n = base, 0
        while stale.exists():
            n += 1
            stale = base.with_name(f"{base.name}.{n}")
        shutil.move(run.run_dir, stale)
        say(f"[sweep] unfinished run moved aside, restarting from scratch: {stale}")
    log = sweep_dir / "logs" / f"{run.name}.log"
    port = free_port(ports) if res.procs > 1 else None
    cmd = train_command([*run.argv, *resume], res.procs, port)
    with open(log, "ab") as f:
        f.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} device {dev}: {shlex.join(cmd)}\n".encode())
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(dict(os.environ), res, dev))
    say(f"[sweep] start: {run.label} on {dev} (log {log})")
    return _Active(run, proc, dev, lock, log, time.time(), port)


def main(argv: list[str] | None = None) -> int:
    from transformers import HfArgumentParser

    from trl_ext.launch.processes import check_single_process

    argv = sys.argv[1:] if argv is None else argv
    try:
        check_single_process("sweep.py")  # each run is a train.py process (or torchrun launch) of its own
        (args,) = HfArgumentParser(SweepArgs).parse_args_into_dataclasses(args=argv)
        shard = None if args.shard is None else parse_shard(args.shard, dict(os.environ))
        if args.summarize and (shard or args.dry_run):
            raise ConfigError("--summarize merges every shard's runs and launches nothing: give it without --shard "
                              "and --dry_run")  # fmt: skip
        spec = build_spec(args)
        res = resolve_resources(args, dict(os.environ), len(os.sched_getaffinity(0)))
        planned = plan_runs(spec, args.procs_per_run)  # the whole grid: every shard plans the same runs
        sweep_dir = sweep_dir_for(planned, spec, args.sweep_name, args.config)
        if args.summarize and not sweep_dir.is_dir():
            raise ConfigError(f"no sweep directory {sweep_dir}: no run of this sweep has started (the same flags as "
                              "the shards', without --shard, find it)")  # fmt: skip
    except ConfigError as e:
        print(f"sweep.py: error: {e}", file=sys.stderr)
        return 2
    if args.summarize:
        results = merge_results(planned, sweep_dir)
        paths = write_summary(results, sweep_dir)
        print(summary_table(results) + "\n" + "\n".join(f"{k}: {p}" for k, p in paths.items()), flush=True)
        return 0 if all(r.status == "done" for r in results) else 1
    runs = shard_runs(planned, *shard) if shard else planned
    part = f"; shard {shard[0]}/{shard[1]}: {len(runs)} of them" if shard else ""
    print(f"sweep: {len(planned)} run(s){part}, {res.describe()}\nsweep dir: {sweep_dir}")
    launcher = f"torchrun --nproc_per_node {args.procs_per_run} " if args.procs_per_run > 1 else ""
    for run in runs:
        done = " [done: will be skipped]" if is_done(run.run_dir) else ""
        print(f"run {run.index + 1}/{len(planned)}: {run.run_dir}{done}\n    {launcher}train.py {shlex.join(run.argv)}")
    if args.dry_run or not runs:
        return 0
    sweep_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)  # stop the children too when the sweep is terminated
    record = {"argv": argv, **asdict(spec), "procs_per_run": args.procs_per_run, "shard": shard and list(shard)}
    (sweep_dir / f"sweep{shard_suffix(shard)}.yaml").write_text(yaml.safe_dump(record, sort_keys=False))
    results, interrupted = execute(runs, sweep_dir, res, args.status_every, args.log_tail,
                                   restart=args.restart_unfinished, shard=shard)  # fmt: skip
    paths = write_summary(results, sweep_dir, shard)
    print(summary_table(results) + "\n" + "\n".join(f"{k}: {p}" for k, p in paths.items()), flush=True)
    if shard:
        whole = [a for i, a in enumerate(argv) if not (a.startswith("--shard") or (i and argv[i - 1] == "--shard"))]
        print(f"all shards' runs: uv run sweep.py {shlex.join(whole)} --summarize", flush=True)
    return 130 if interrupted else 0 if all(r.status == "done" for r in results) else 1


def _interrupt(signum, frame):
    raise KeyboardInterrupt


