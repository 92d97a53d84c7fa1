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
"""

from __future__ import annotations

import csv
import fcntl
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from trl_ext.registry import ConfigError
from trl_ext.runs.checkpoints import latest_complete
from trl_ext.sweep_plan import PlannedRun, build_spec, plan_runs, sweep_dir_for

TRAIN_SCRIPT = Path(__file__).resolve().parents[1] / "train.py"
DEFAULT_PER_GPU = 1
MPS_PIPE_DEFAULT = "/tmp/nvidia-mps"
POLL_S = 0.5
SUMMARY_COLUMNS = ("label", "status", "launched", "steps", "reward", "kl", "wall_s", "train_s", "returncode",
                   "device", "name", "run_dir")  # fmt: skip


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
        "Named sweep YAML (keys: description, reward, grid, fixed, train_flags); a key given on the command "
        "line replaces the file's. train.py's own reward YAML is --fixed config=FILE."
    )
    dry_run: bool = _help("Print the planned runs (command, directory) and launch nothing.", False)
    per_gpu: int | None = _help(f"Concurrent runs per visible GPU (default {DEFAULT_PER_GPU}).")
    parallel: int | None = _help("Concurrent runs on a machine without GPU (default: one per CPU core).")
    sweep_name: str | None = _help("Sweep directory {output_dir}/sweeps/NAME (default: grid keys, run count, hash).")
    restart_unfinished: bool = _help("Restart unfinished runs from scratch (their directories are moved to "
                                     "{sweep dir}/incomplete/) instead of resuming them from their latest checkpoint.",
                                     False)
    status_every: float = _help("Seconds between live status lines.", 30.0)
    log_tail: int = _help("Lines of a failed run's log kept in the summary.", 20)


# ------------------------------------------------------------------------------------------ resources
@dataclass
class Resources:
    gpus: list[str]  # CUDA_VISIBLE_DEVICES ids; empty = CPU slots
    per_slot: int  # concurrent runs per GPU, or CPU slots
    threads: int  # torch threads per child
    mps: str | None  # MPS pipe directory when its daemon runs

    @property
    def capacity(self) -> int:
        return self.per_slot * max(1, len(self.gpus))

    def describe(self) -> str:
        if not self.gpus:
            return f"{self.per_slot} CPU slots, {self.threads} torch thread(s) per run"
        mps = f"MPS active ({self.mps})" if self.mps else (
            "MPS not running: runs sharing a GPU time-slice (start it: nvidia-cuda-mps-control -d)")
        return (f"{len(self.gpus)} GPU(s) [{','.join(self.gpus)}] x {self.per_slot} runs, {mps}, "
                f"{self.threads} CPU thread(s) per run")  # fmt: skip


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
    gpus = visible_gpus(env)
    if gpus and args.parallel is not None:
        raise ConfigError(f"--parallel is for machines without GPU; {len(gpus)} visible (use --per_gpu, or "
                          "CUDA_VISIBLE_DEVICES= to train on CPU)")  # fmt: skip
    if not gpus and args.per_gpu is not None:
        raise ConfigError("--per_gpu needs a visible GPU and there is none; use --parallel")
    per_slot = (DEFAULT_PER_GPU if args.per_gpu is None else args.per_gpu) if gpus else (
        cpus if args.parallel is None else args.parallel)
    if per_slot < 1:
        raise ConfigError(f"--per_gpu / --parallel must be >= 1, got {per_slot}")
    capacity = per_slot * max(1, len(gpus))
    return Resources(gpus, per_slot, max(1, cpus // capacity), mps_pipe(env) if gpus else None)


class Slots:
    """Where the next child runs: the least-loaded GPU with a free slot (ties: first listed), or a CPU slot."""

    def __init__(self, res: Resources):
        self.load = dict.fromkeys(res.gpus or ["cpu"], 0)
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
@dataclass
class RunResult:
    label: str
    name: str
    run_dir: str
    status: str  # done | FAILED | BUSY | INTERRUPTED | NOT_STARTED
    launched: bool
    steps: int | None = None
    reward: float | None = None
    kl: float | None = None
    wall_s: float | None = None  # process wall time seen by this sweep
    train_s: float | None = None  # trainer.train() wall time (run_summary.json)
    returncode: int | None = None
    device: str | None = None
    log: str | None = None
    log_tail: list[str] = field(default_factory=list)


def is_done(run_dir: Path) -> bool:
    path = run_dir / "run_summary.json"
    return path.is_file() and json.loads(path.read_text()).get("status") == "done"


def fill_metrics(result: RunResult) -> RunResult:
    """Steps, final reward and KL: from run_summary.json when done, else from the newest checkpoint."""
    from trl_ext.evaluate import latest_trainer_state

    run_dir = Path(result.run_dir)
    if is_done(run_dir):
        summary = json.loads((run_dir / "run_summary.json").read_text())
        result.steps, result.train_s, last = summary["steps"], summary["wall_s"], summary["final_log"]
    elif (state_path := latest_trainer_state(run_dir)) is not None:
        state = json.loads(state_path.read_text())
        result.steps = state["global_step"]
        last = next((h for h in reversed(state["log_history"]) if "reward" in h), {})
    else:
        return result
    result.reward, result.kl = last.get("reward"), last.get("kl")
    return result


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


def _say(msg: str) -> None:
    print(msg, flush=True)


def execute(runs: list[PlannedRun], sweep_dir: Path, res: Resources, status_every: float, log_tail: int,
            say=_say, restart: bool = False) -> tuple[list[RunResult], bool]:  # fmt: skip
    """Run (or skip) every planned run; returns the results in plan order and whether it was interrupted."""
    results: dict[str, RunResult] = {}

    def record(run, status, launched, **kw):
        results[run.name] = fill_metrics(RunResult(run.label, run.name, str(run.run_dir), status, launched, **kw))

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
                started = _start(run, dev, sweep_dir, res, say, restart)
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
                record(a.run, "done" if ok else "FAILED", True, wall_s=round(time.time() - a.t0, 1),
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


def _start(run: PlannedRun, dev: str, sweep_dir: Path, res: Resources, say, restart: bool = False) -> _Active | str:
    lock = _lock(run)
    if lock is None:
        say(f"[sweep] BUSY: {run.label} is being run by another process ({run.run_dir})")
        return "BUSY"
    if is_done(run.run_dir):  # finished by another process since the plan was made
        os.close(lock)
        return "done"
    ckpt = None if restart or not run.run_dir.exists() else latest_complete(run.run_dir)
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
    cmd = [sys.executable, str(TRAIN_SCRIPT), *run.argv, *resume]
    with open(log, "ab") as f:
        f.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} device {dev}: {shlex.join(cmd)}\n".encode())
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(dict(os.environ), res, dev))
    say(f"[sweep] start: {run.label} on {dev} (log {log})")
    return _Active(run, proc, dev, lock, log, time.time())


# ------------------------------------------------------------------------------------------ summary
def _fmt(v) -> str:
    return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def summary_table(results: list[RunResult]) -> str:
    cols = ("label", "status", "steps", "reward", "kl", "train_s", "wall_s", "name")
    rows = [cols] + [tuple(_fmt(getattr(r, c)) for c in cols) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in rows)


def write_summary(results: list[RunResult], sweep_dir: Path) -> dict[str, Path]:
    """summary.json, summary.csv and reward_curves.png in ``sweep_dir``."""
    from trl_ext.evaluate import latest_trainer_state, plot_curves, reward_history

    paths = {k: sweep_dir / f for k, f in (("json", "summary.json"), ("csv", "summary.csv"),
                                            ("png", "reward_curves.png"))}  # fmt: skip
    paths["json"].write_text(json.dumps([asdict(r) for r in results], indent=2))
    with open(paths["csv"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(SUMMARY_COLUMNS)
        w.writerows([getattr(r, c) for c in SUMMARY_COLUMNS] for r in results)
    curves = {}
    for r in results:
        state = latest_trainer_state(Path(r.run_dir))
        rows = reward_history(state) if state else []
        if rows:
            curves[r.label] = ([h["step"] for h in rows], [h["reward"] for h in rows])
    plot_curves(curves, paths["png"], title=f"reward: {sweep_dir.name}", ylabel="reward")
    return paths


def main(argv: list[str] | None = None) -> int:
    from transformers import HfArgumentParser

    from trl_ext.launch.processes import check_single_process

    argv = sys.argv[1:] if argv is None else argv
    try:
        check_single_process("sweep.py")  # each run is a train.py process of its own
        (args,) = HfArgumentParser(SweepArgs).parse_args_into_dataclasses(args=argv)
        spec = build_spec(args)
        runs = plan_runs(spec)
        res = resolve_resources(args, dict(os.environ), len(os.sched_getaffinity(0)))
        sweep_dir = sweep_dir_for(runs, spec, args.sweep_name, args.config)
    except ConfigError as e:
        print(f"sweep.py: error: {e}", file=sys.stderr)
        return 2
    print(f"sweep: {len(runs)} run(s), {res.describe()}\nsweep dir: {sweep_dir}")
    for run in runs:
        done = " [done: will be skipped]" if is_done(run.run_dir) else ""
        print(f"run {run.index + 1}/{len(runs)}: {run.run_dir}{done}\n    train.py {shlex.join(run.argv)}")
    if args.dry_run:
        return 0
    sweep_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)  # stop the children too when the sweep is terminated
    (sweep_dir / "sweep.yaml").write_text(yaml.safe_dump({"argv": argv, **asdict(spec)}, sort_keys=False))
    results, interrupted = execute(runs, sweep_dir, res, args.status_every, args.log_tail,
                                   restart=args.restart_unfinished)
    paths = write_summary(results, sweep_dir)
    print(summary_table(results) + "\n" + "\n".join(f"{k}: {p}" for k, p in paths.items()), flush=True)
    return 130 if interrupted else 0 if all(r.status == "done" for r in results) else 1


def _interrupt(signum, frame):
    raise KeyboardInterrupt


