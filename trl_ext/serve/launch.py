"""layout.py: the user's layout in one command (seed 002's flags): the policy's vLLM servers (``--inference_gpu_ids``,
``--inference_dp`` replicas), the teacher's (``--teacher_gpu_ids``) and the FSDP2/DDP trainer (``--trainer_gpu_ids``,
torchrun), on one machine. The ids are GPUs on a CUDA machine and CPU cores on one without CUDA.

Each server is vLLM's own OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``) with the
project's version gate (``--middleware trl_ext.serve.endpoint.policy_versions``), on ``--host`` (loopback unless asked
otherwise, and then only with ``VLLM_API_KEY`` set), loading checkpoints only from the run's weights directory. The
launcher starts ``torchrun train.py`` with the servers' URLs beside them (train.py waits for every server's
``/health`` before it loads anything), watches every part, and when any part exits or fails stops the others
(their whole process groups: SIGTERM, then SIGKILL after `GRACE_S`).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from trl_ext.registry import ConfigError

GRACE_S = 20.0
"""Seconds a stopped part has between SIGTERM and SIGKILL."""
LOOPBACK = ("127.0.0.1", "localhost", "::1")
MAX_MODEL_LEN = 8192
"""The servers' largest default --max-model-len (`LayoutArgs.max_model_len` 0)."""


@dataclass
class LayoutArgs:
    """layout.py's own flags; everything after ``--`` goes to train.py."""

    inference_gpu_ids: str = field(default="0", metadata={
        "help": "Devices of the policy's vLLM servers (seed 002's flag): GPU ids on a CUDA machine, CPU core ids "
                "without CUDA; split evenly among --inference_dp replicas (each replica's GPUs run tensor-parallel)."})
    inference_dp: int = field(default=1, metadata={
        "help": "Replicas of the policy server (seed 002's --inference.parallel.dp): one server each, the rows of "
                "every batch spread over them."})
    teacher_gpu_ids: str = field(default="", metadata={
        "help": "Devices of the teacher's vLLM server (may share a device with inference); empty: no teacher "
                "server (needs train.py's --teacher_tau > 0 when set)."})
    trainer_gpu_ids: str = field(default="0", metadata={
        "help": "Devices of the trainer: one torchrun process per id (GPUs on CUDA, CPU cores without; add "
                "--fsdp to the train.py flags for FSDP2)."})
    host: str = field(default="127.0.0.1", metadata={
        "help": "Address the servers listen on. Another than loopback needs VLLM_API_KEY in the environment."})
    port: int = field(default=8100, metadata={"help": "Port of the first server; the others take the next ones."})
    server_dtype: str = field(default="float32", metadata={
        "help": "dtype the servers run in (vLLM's --dtype); the trainer's policy is float32 unless train.py says "
                "otherwise."})
    max_model_len: int = field(default=0, metadata={
        "help": "The servers' --max-model-len (prompt + completion); 0: the model's max_position_embeddings, at "
                f"most {MAX_MODEL_LEN} (a long-context model's whole context would not fit a GPU's KV cache)."})
    enforce_eager: bool = field(default=False, metadata={
        "help": "The servers' --enforce-eager (no torch.compile, no CUDA graphs): a faster start, slower decoding."})
    server_timeout: float = field(default=600.0, metadata={
        "help": "Seconds each server has to answer /health after it starts."})
    weights_dir: str = field(default="", metadata={
        "help": "Where the trainer publishes checkpoints for the servers (a shared filesystem across nodes); empty: "
                "a new directory in /dev/shm (else the temporary directory), deleted at exit."})
    log_dir: str = field(default="", metadata={"help": "The servers' logs; empty: OUTPUT_DIR/layout_logs."})


def id_list(text: str, flag: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ConfigError(f"--{flag} must be comma-separated integers, got {text!r}") from e
    if len(set(ids)) != len(ids) or any(i < 0 for i in ids):
        raise ConfigError(f"--{flag} must name distinct ids >= 0, got {text!r}")
    return ids


@dataclass
class ServerSpec:
    role: str  # "policy" or "teacher"
    index: int
    model: str
    port: int
    devices: list[int]
    url: str = ""
    command: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)


def model_len(args: LayoutArgs, model_dir: str) -> int:
    """``--max_model_len``, or the model's context capped at `MAX_MODEL_LEN`."""
    if args.max_model_len:
        return args.max_model_len
    with open(os.path.join(model_dir, "config.json")) as f:
        context = json.load(f).get("max_position_embeddings") or MAX_MODEL_LEN
    return min(context, MAX_MODEL_LEN)


def server_command(spec: ServerSpec, args: LayoutArgs, cuda: bool, seed: int, transfer: str = "files") -> list[str]:
    """vLLM's server for ``spec`` with the version gate and the log-probs the trainer needs; a policy server takes
    pushed weights with ``transfer`` nccl or gloo (train.py's ``--vllm_weight_transfer``)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", spec.model,
           "--host", args.host, "--port", str(spec.port), "--dtype", args.server_dtype,
           "--max-model-len", str(model_len(args, spec.model)), "--logprobs-mode", "processed_logprobs",
           "--middleware", "trl_ext.serve.endpoint.policy_versions", "--seed", str(seed),
           "--disable-uvicorn-access-log"]  # fmt: skip
    if cuda and len(spec.devices) > 1:
        cmd += ["--tensor-parallel-size", str(len(spec.devices))]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    if spec.role == "policy" and transfer != "files":
        cmd += ["--weight-transfer-config", json.dumps({"backend": transfer})]
    if not cuda:  # each row's request is seeded: no chunked prefill on CPU (trl_ext.vllm.engine.cpu_scheduler)
        from trl_ext.vllm.placement import cpu_scheduler

        sched = cpu_scheduler(model_len(args, spec.model))
        cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(sched["max_num_batched_tokens"])]
    return cmd


def server_env(spec: ServerSpec, cuda: bool, weights_dir: str, base: dict) -> dict:
    env = dict(base)
    env["TRL_EXT_WEIGHTS_DIR"] = weights_dir
    root = str(Path(__file__).resolve().parents[2])  # the project's root: the middleware imports trl_ext
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [base.get("PYTHONPATH")])])
    if cuda:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, spec.devices))
    else:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, spec.devices))
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


@dataclass
class Layout:
    servers: list[ServerSpec]
    trainer: list[str]
    trainer_devices: list[int]
    weights_dir: str
    made_weights_dir: bool
    log_dir: Path
    cuda: bool


def plan_layout(args: LayoutArgs, train_argv: list[str], cuda: bool, environ=os.environ) -> Layout:
    """The servers and the trainer command for ``args`` and train.py's ``train_argv``; ConfigError (exit 2) on a
    layout that cannot run, before anything starts. train.py's flags are parsed here (its own checks run again
    under torchrun, with the servers up)."""
    from trl_ext.cli_train import parser
    from trl_ext.models import model_source

    if args.host not in LOOPBACK and not environ.get("VLLM_API_KEY"):
        raise ConfigError(f"--host {args.host} exposes the servers (their weight loads included) beyond this host: "
                          "set VLLM_API_KEY in the environment (servers and trainer read it), or keep loopback")
    taken = {"--use_vllm", "--vllm_mode", "--vllm_server_base_url", "--vllm_server_host", "--vllm_server_port",
             "--teacher_server_url"}  # fmt: skip
    for arg in train_argv:
        if arg.split("=")[0] in taken:
            raise ConfigError(f"layout.py sets {arg.split('=')[0]} itself (the servers it starts); drop it from the "
                              "train.py flags")
    train_argv, teacher_model = _take_teacher_model(list(train_argv))
    inference = id_list(args.inference_gpu_ids, "inference_gpu_ids")
    teacher = id_list(args.teacher_gpu_ids, "teacher_gpu_ids")
    trainer = id_list(args.trainer_gpu_ids, "trainer_gpu_ids")
    if not inference or not trainer:
        raise ConfigError("--inference_gpu_ids and --trainer_gpu_ids must name at least one device each")
    if args.inference_dp < 1 or len(inference) % args.inference_dp:
        raise ConfigError(f"--inference_dp {args.inference_dp} must divide the {len(inference)} inference devices "
                          "(seed 002: dp = len(inference_gpu_ids) / tp)")  # fmt: skip
    if cuda and set(trainer) & (set(inference) | set(teacher)):
        raise ConfigError("--trainer_gpu_ids shares a GPU with a server: the servers take their GPU memory share "
                          "first; give the trainer its own GPUs")
    size = len(inference) // args.inference_dp
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    urls = [f"http://{host}:{args.port + i}" for i in range(args.inference_dp + bool(teacher))]
    flags = [*train_argv, "--use_vllm", "--vllm_mode", "server", "--vllm_server_base_url",
             ",".join(urls[: args.inference_dp])]  # fmt: skip
    flags += ["--teacher_server_url", urls[-1]] if teacher else []
    flags += ["--vllm_server_timeout", f"{args.server_timeout:g}"] * ("--vllm_server_timeout" not in train_argv)
    cfg, _ = parser().parse_known_args(flags)  # the values layout.py reads (argparse: model, teacher_tau, seed ...)
    if bool(teacher) != (cfg.teacher_tau > 0):
        raise ConfigError("--teacher_gpu_ids starts the teacher of distillation: give it exactly when train.py's "
                          f"--teacher_tau > 0 (got --teacher_tau {cfg.teacher_tau})")
    if len(trainer) == 1:  # every check of train.py now; several processes are checked under torchrun (a process
        parser().parse_args_into_dataclasses(args=flags, return_remaining_strings=True)  # group needs them all)
    servers = [ServerSpec("policy", i, model_source(cfg.model), args.port + i, inference[i * size:(i + 1) * size])
               for i in range(args.inference_dp)]  # fmt: skip
    if teacher:
        servers.append(ServerSpec("teacher", 0, model_source(teacher_model or cfg.model), args.port + len(servers),
                                  teacher))  # fmt: skip
    made = not args.weights_dir
    tmp = "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")
    weights_dir = os.path.abspath(args.weights_dir or os.path.join(tmp, f"trl_ext_layout_{uuid.uuid4().hex[:8]}"))
    for s, url in zip(servers, urls, strict=True):
        s.url = url
        s.command = server_command(s, args, cuda, cfg.seed, cfg.vllm_weight_transfer)
        s.env = server_env(s, cuda, weights_dir, dict(environ))
    script = str(Path(__file__).resolve().parents[2] / "train.py")
    trainer_cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                   str(len(trainer)), script, *flags]  # fmt: skip
    log_dir = Path(args.log_dir or Path(cfg.output_dir) / "layout_logs")
    return Layout(servers, trainer_cmd, trainer, weights_dir, made, log_dir, cuda)


def _take_teacher_model(argv: list[str]) -> tuple[list[str], str]:
    """train.py's flags without ``--teacher_model`` (the teacher server serves it), and its value."""
    for i, arg in enumerate(argv):
        if arg == "--teacher_model" and i + 1 < len(argv):
            return argv[:i] + argv[i + 2:], argv[i + 1]
        if arg.startswith("--teacher_model="):
            return argv[:i] + argv[i + 1:], arg.split("=", 1)[1]
    return argv, ""


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
    """Start the servers, wait for their health, run the trainer; stop everything when any part ends. Returns the
    trainer's exit code, or 1 when a server failed."""
    from trl_ext.serve.client import Replica

    layout.log_dir.mkdir(parents=True, exist_ok=True)
    os.makedirs(layout.weights_dir, exist_ok=True)
    running: list[tuple[ServerSpec, subprocess.Popen, Path]] = []
    trainer = None

    def on_signal(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_signal)
    try:
        for s in layout.servers:
            log = layout.log_dir / f"{s.role}{s.index}-{s.port}.log"
            say(f"layout: {s.role} server {s.index} on {'GPUs' if layout.cuda else 'CPU cores'} "
                f"{','.join(map(str, s.devices))}: {s.url} (log {log})")
            with open(log, "w") as f:
                proc = subprocess.Popen(s.command, env=s.env, stdout=f, stderr=subprocess.STDOUT,
                                        start_new_session=True)  # fmt: skip
            running.append((s, proc, log))
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
                    if len(healthy) == len(running):
                        say(f"layout: {len(running)} server(s) healthy")
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


def main(argv: list[str] | None = None) -> int:
    from transformers import HfArgumentParser

    argv = sys.argv[1:] if argv is None else argv
    own, train_argv = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    (args,) = HfArgumentParser(LayoutArgs).parse_args_into_dataclasses(args=own)
    import torch

    try:
        layout = plan_layout(args, train_argv, torch.cuda.is_available())
    except ConfigError as e:
        print(f"layout.py: configuration error: {e}", file=sys.stderr)
        return 2
    return run_layout(layout, args)
