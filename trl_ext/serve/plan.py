"""layout.py's plan (`plan_layout`): its flags (`LayoutArgs`), the servers' commands and environments, and every check
that can refuse a layout before anything starts (a ConfigError: exit 2).

The model is read as transformers reads it (``AutoConfig``: a folder, or a hub id from the hub cache with its
revision, ``HF_HUB_OFFLINE`` honoured), never from ``<model>/config.json``: a hub id works wherever a folder does.
On CUDA each server gets its share of its GPUs' memory (vLLM's ``--gpu-memory-utilization``): `GPU_SHARE` split
evenly among the servers that share a GPU (docs/layout.md), and serves in bfloat16 unless ``--server_dtype`` says
otherwise; on CPU the servers run in float32, where the vLLM tier tests exactness.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from trl_ext.registry import ConfigError

LOOPBACK = ("127.0.0.1", "localhost", "::1")
MAX_MODEL_LEN = 8192
"""The servers' largest default --max-model-len (`LayoutArgs.max_model_len` 0)."""
GPU_SHARE = 0.9
"""The fraction of a GPU's memory its servers take together by default (vLLM 0.30's own default for one server is
0.92: this leaves the CUDA contexts of two servers on one GPU their room)."""
MAX_GPU_SHARE = 0.95
"""The most that the servers of one GPU may ask for together (``--gpu_memory_utilization`` x servers)."""
SERVER_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class LayoutArgs:
    """layout.py's own flags; everything after ``--`` goes to train.py."""

    inference_gpu_ids: str = field(default="0", metadata={
        "help": "Devices of the policy's vLLM servers (seed 002's flag): GPU ids on a CUDA machine, CPU core ids "
                "without CUDA; split evenly among --inference_dp replicas (each replica's GPUs run tensor-parallel)."})
    inference_dp: int = field(default=1, metadata={
        "help": "Replicas of the policy server (seed 002's --inference.parallel.dp): one server each, the rows of "
                "every batch spread over them (a group's rows on one replica)."})
    teacher_gpu_ids: str = field(default="", metadata={
        "help": "Devices of the teacher's vLLM server (may share a device with inference); empty: no teacher "
                "server (needs train.py's --teacher_tau > 0 when set)."})
    trainer_gpu_ids: str = field(default="0", metadata={
        "help": "Devices of the trainer: one torchrun process per id (GPUs on CUDA, CPU cores without; add "
                "--fsdp to the train.py flags for FSDP2)."})
    host: str = field(default="127.0.0.1", metadata={
        "help": "Address the servers listen on. Another than loopback needs VLLM_API_KEY in the environment."})
    port: int = field(default=8100, metadata={"help": "Port of the first server; the others take the next ones."})
    server_dtype: str = field(default="auto", metadata={
        "help": "dtype the servers run in (vLLM's --dtype): 'auto' is bfloat16 on CUDA and float32 without (where the "
                "tests check the servers' log-probs against the trainer's to float error).",
        "choices": list(SERVER_DTYPES)})
    gpu_memory_utilization: float = field(default=0.0, metadata={
        "help": "Each server's share of its GPUs' memory (vLLM's --gpu-memory-utilization). 0: "
                f"{GPU_SHARE:g} split evenly among the servers that share a GPU (a policy and a teacher server on "
                f"one GPU: {GPU_SHARE / 2:g} each). The servers of one GPU may ask for {MAX_GPU_SHARE:g} together "
                "at most. CUDA only."})
    max_model_len: int = field(default=0, metadata={
        "help": "The servers' --max-model-len (prompt + completion); 0: the model's max_position_embeddings, at "
                f"most {MAX_MODEL_LEN} (a long-context model's whole context would not fit a GPU's KV cache)."})
    enforce_eager: bool = field(default=False, metadata={
        "help": "The servers' --enforce-eager (no torch.compile, no CUDA graphs): a faster start, slower decoding."})
    server_timeout: float = field(default=600.0, metadata={
        "help": "Seconds each server has to answer /health after it starts."})
    max_server_restarts: int = field(default=3, metadata={
        "help": "Restarts of each server that exits during training (same command, devices and port, its log appended "
                "to; the trainer's requests wait for it: train.py's --vllm_server_restart_timeout is set to "
                "--server_timeout). Past it the run stops (exit 1, resumable). 0: a server's exit stops the run."})
    max_trainer_restarts: int = field(default=3, metadata={
        "help": "Restarts of the trainer after a crash or a kill, each from the run's last complete checkpoint "
                "(--resume_from_checkpoint latest), the servers left running; never after a configuration error or a "
                "numeric fault (a diverged run), nor before the first checkpoint. 0: its exit stops the run."})
    weights_dir: str = field(default="", metadata={
        "help": "Where the trainer publishes checkpoints for the servers (a shared filesystem across nodes); empty: "
                "a new directory in /dev/shm when it has room for the run's checkpoints, else in the temporary "
                "directory (the launcher says which and why), deleted at exit."})
    log_dir: str = field(default="", metadata={"help": "The servers' logs; empty: OUTPUT_DIR/layout_logs."})
    dry_run: bool = field(default=False, metadata={
        "help": "Print the plan per device (servers, tensor-parallel size, weights in the serving dtype, KV-cache "
                "tokens, the trainer's shard of parameters, gradients and optimizer state) from the model's config "
                "alone, refuse a device that cannot hold its parts (exit 2), and start nothing."})
    plan_gpus: str = field(default="", metadata={
        "help": "With --dry_run: the GPUs to plan for, as COUNTxGIB[,COUNTxGIB...] (e.g. 8x80), on a machine without "
                "them (a login node); empty: the CUDA devices this machine sees."})

    def __post_init__(self):
        if self.inference_dp < 1:
            raise ConfigError(f"--inference_dp must be >= 1, got {self.inference_dp}")
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port must be a TCP port, got {self.port}")
        if self.server_dtype not in SERVER_DTYPES:
            raise ConfigError(f"--server_dtype must be one of {', '.join(SERVER_DTYPES)}, got {self.server_dtype!r}")
        if not 0 <= self.gpu_memory_utilization <= MAX_GPU_SHARE:
            raise ConfigError(f"--gpu_memory_utilization must be in (0, {MAX_GPU_SHARE:g}] (0: shared evenly), got "
                              f"{self.gpu_memory_utilization:g}")
        if self.max_model_len < 0:
            raise ConfigError(f"--max_model_len must be >= 0 (0: the model's context), got {self.max_model_len}")
        for name in ("max_server_restarts", "max_trainer_restarts"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name} must be >= 0 (0: no restart), got {getattr(self, name)}")
        if not self.server_timeout > 0:
            raise ConfigError(f"--server_timeout must be > 0, got {self.server_timeout:g}")
        if self.plan_gpus and not self.dry_run:
            raise ConfigError("--plan_gpus states the GPUs a dry run plans for: it needs --dry_run")


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
    gpu_share: float = 0.0  # vLLM's --gpu-memory-utilization on CUDA; 0 on CPU
    max_model_len: int = 0
    config: object = None  # the model's transformers config (`model_config`)


def model_config(model: str, trust_remote_code: bool = False):
    """The text config of ``model`` (a folder or a hub id, as transformers resolves it: `trl_ext.models.arch`)."""
    from trl_ext.models.arch import model_config as read

    config = read(model, trust_remote_code)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def model_len(args: LayoutArgs, config) -> int:
    """``--max_model_len``, or the model's context capped at `MAX_MODEL_LEN`."""
    if args.max_model_len:
        return args.max_model_len
    return min(getattr(config, "max_position_embeddings", None) or MAX_MODEL_LEN, MAX_MODEL_LEN)


def check_tensor_parallel(spec: ServerSpec, config) -> None:
    """vLLM shards attention heads, KV heads and the MLP over a server's GPUs (``QKVParallelLinear``: KV heads divide
    by the TP size, or the TP size by them, where they are replicated; ``ModelConfig.verify_with_parallel_config``):
    a size that does not divide them fails inside vLLM after minutes; here it is refused."""
    tp = len(spec.devices)
    if tp == 1:
        return
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    mlp = getattr(config, "intermediate_size", None)
    what = f"the {spec.role} server's {tp} GPUs (tensor parallel {tp})"
    if heads and heads % tp:
        raise ConfigError(f"{what} do not divide the model's {heads} attention heads: use a GPU count that divides "
                          f"{heads}, or more replicas (--inference_dp)")
    if kv and (kv % tp if kv >= tp else tp % kv):
        raise ConfigError(f"{what} and the model's {kv} KV heads: one must divide the other")
    if isinstance(mlp, int) and mlp % tp:
        raise ConfigError(f"{what} do not divide the model's MLP width {mlp}")


def check_server_model(spec: ServerSpec, cuda: bool) -> None:
    """What vLLM would refuse after its start, refused now: tensor parallel that does not divide the model, and (with
    vLLM installed: a dry run on a login node may lack it) an architecture vLLM does not implement or a CPU head
    size its kernels do not take (`trl_ext.vllm.args.check_model`)."""
    import importlib.util

    if cuda:
        check_tensor_parallel(spec, spec.config)
    if importlib.util.find_spec("vllm") is None:
        return
    from trl_ext.vllm.args import check_model

    try:
        check_model(spec.config, cuda)
    except ConfigError as e:
        raise ConfigError(f"the {spec.role} server's model {spec.model}: {e}") from e


def server_dtype(args: LayoutArgs, cuda: bool) -> str:
    return args.server_dtype if args.server_dtype != "auto" else ("bfloat16" if cuda else "float32")


def gpu_shares(servers: list[ServerSpec], given: float) -> list[float]:
    """Each server's ``--gpu-memory-utilization``: ``given``, or `GPU_SHARE` over the most servers on any of its
    GPUs. ConfigError when the servers of one GPU ask for more than `MAX_GPU_SHARE` together."""
    on = {}
    for s in servers:
        for d in s.devices:
            on.setdefault(d, []).append(s)
    shares = [given or GPU_SHARE / max(len(on[d]) for d in s.devices) for s in servers]
    for device, here in on.items():
        total = sum(shares[servers.index(s)] for s in here)
        if total > MAX_GPU_SHARE + 1e-9:
            names = ", ".join(f"{s.role} server {s.index}" for s in here)
            raise ConfigError(f"GPU {device} is shared by {names}, each asking --gpu_memory_utilization "
                              f"{given:g}: {total:g} of the GPU together, more than {MAX_GPU_SHARE:g}; give each "
                              "at most "f"{MAX_GPU_SHARE / len(here):.2f}, or 0 (shared evenly)")
    return shares


def server_command(spec: ServerSpec, args: LayoutArgs, cuda: bool, seed: int, transfer: str = "files",
                   lora: dict | None = None) -> list[str]:  # fmt: skip
    """vLLM's server for ``spec`` with the version gate and the log-probs the trainer needs; a policy server takes
    pushed weights with ``transfer`` nccl or gloo (train.py's ``--vllm_weight_transfer``), and LoRA adapters with
    ``lora`` (``trl_ext.vllm.engine.lora_settings``: train.py's ``--vllm_lora_sync`` resolved to adapters). A spec
    built by hand (the Slurm recipe of docs/layout.md, the tests) gets its ``max_model_len`` from the model's config
    here."""
    if not spec.max_model_len:
        spec.config = spec.config or model_config(spec.model)
        spec.max_model_len = model_len(args, spec.config)
    # --served-model-name: with HF_HUB_OFFLINE vLLM swaps a hub id for its snapshot's path in the engine
    # (vllm/engine/arg_utils.py), and the engine's name then differs from the one the server answers to
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", spec.model,
           "--served-model-name", spec.model,
           "--host", args.host, "--port", str(spec.port), "--dtype", server_dtype(args, cuda),
           "--max-model-len", str(spec.max_model_len), "--logprobs-mode", "processed_logprobs",
           "--middleware", "trl_ext.serve.endpoint.policy_versions", "--seed", str(seed),
           "--disable-uvicorn-access-log"]  # fmt: skip
    if cuda:
        cmd += ["--gpu-memory-utilization", f"{spec.gpu_share:.4g}"]
        if len(spec.devices) > 1:
            cmd += ["--tensor-parallel-size", str(len(spec.devices))]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    if spec.role == "policy" and transfer != "files":
        cmd += ["--weight-transfer-config", json.dumps({"backend": transfer})]
    if spec.role == "policy" and lora:
        cmd += ["--enable-lora", "--max-lora-rank", str(lora["max_lora_rank"]), "--max-loras", str(lora["max_loras"]),
                "--max-cpu-loras", str(lora["max_cpu_loras"])]  # fmt: skip
    if not cuda:  # each row's request is seeded: no chunked prefill on CPU (trl_ext.vllm.engine.cpu_scheduler)
        from trl_ext.vllm.placement import cpu_scheduler

        sched = cpu_scheduler(spec.max_model_len)
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


def default_weights_dir(config, copies: int) -> tuple[str, str]:
    """(directory, why) for the run's checkpoints when --weights_dir is not given: `trl_ext.vllm.publish.weights_root`
    for ``copies`` float32 checkpoints of the model (what the trainer writes: its policy's dtype, float32 unless the
    run loads it otherwise), so a container's small /dev/shm (often 64 MiB) is not filled mid-run."""
    from trl_ext.serve.fit import model_shape
    from trl_ext.vllm.publish import weights_root

    root, why = weights_root(4 * model_shape(config).params, copies)
    return os.path.join(root, f"trl_ext_layout_{uuid.uuid4().hex[:8]}"), why


@dataclass
class Layout:
    servers: list[ServerSpec]
    trainer: list[str]
    trainer_devices: list[int]
    weights_dir: str
    made_weights_dir: bool
    log_dir: Path
    cuda: bool
    flags: list[str] = field(default_factory=list)  # train.py's flags as the trainer gets them
    weights_why: str = ""  # where the default weights directory went, and why
    pushed: bool = False  # versions are pushed into the policy servers (--vllm_weight_transfer nccl|gloo)


def plan_layout(args: LayoutArgs, train_argv: list[str], cuda: bool, environ=os.environ) -> Layout:
    """The servers and the trainer command for ``args`` and train.py's ``train_argv``; ConfigError (exit 2) on a
    layout that cannot run, before anything starts. train.py's own checks run in `check_trainer_plan`."""
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
    if len(inference) % args.inference_dp:
        raise ConfigError(f"--inference_dp {args.inference_dp} must divide the {len(inference)} inference devices "
                          "(seed 002: dp = len(inference_gpu_ids) / tp)")  # fmt: skip
    if cuda and set(trainer) & (set(inference) | set(teacher)):
        raise ConfigError("--trainer_gpu_ids shares a GPU with a server: the servers take their GPU memory share "
                          "first; give the trainer its own GPUs")
    if args.gpu_memory_utilization and not cuda:
        raise ConfigError("--gpu_memory_utilization is a GPU's share: no CUDA here (CPU servers take "
                          "VLLM_CPU_KVCACHE_SPACE GiB for their KV cache)")
    size = len(inference) // args.inference_dp
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    urls = [f"http://{host}:{args.port + i}" for i in range(args.inference_dp + bool(teacher))]
    flags = [*train_argv, "--use_vllm", "--vllm_mode", "server", "--vllm_server_base_url",
             ",".join(urls[: args.inference_dp])]  # fmt: skip
    flags += ["--teacher_server_url", urls[-1]] if teacher else []
    cfg, _ = parser().parse_known_args(flags)  # the values layout.py reads (argparse: model, teacher_tau, seed ...)
    if bool(teacher) != (cfg.teacher_tau > 0):
        raise ConfigError("--teacher_gpu_ids starts the teacher of distillation: give it exactly when train.py's "
                          f"--teacher_tau > 0 (got --teacher_tau {cfg.teacher_tau})")
    servers = [ServerSpec("policy", i, model_source(cfg.model), args.port + i, inference[i * size:(i + 1) * size])
               for i in range(args.inference_dp)]  # fmt: skip
    if teacher:
        servers.append(ServerSpec("teacher", 0, model_source(teacher_model or cfg.model), args.port + len(servers),
                                  teacher))  # fmt: skip
    for s in servers:
        s.config = model_config(s.model, cfg.trust_remote_code)
        s.max_model_len = model_len(args, s.config)
        check_server_model(s, cuda)
    for s, share in zip(servers, gpu_shares(servers, args.gpu_memory_utilization) if cuda else [0.0] * len(servers),
                        strict=True):  # fmt: skip
        s.gpu_share = share
    made = not args.weights_dir
    if made:
        weights_dir, why = default_weights_dir(servers[0].config, cfg.max_async_level + 2)
    else:
        weights_dir, why = os.path.abspath(args.weights_dir), "--weights_dir"
    from trl_ext.vllm.args import lora_sync_plan
    from trl_ext.vllm.engine import lora_settings

    lora = lora_settings(lora_sync_plan(cfg, cfg.lora_rank)[0], cfg.max_async_level)
    for s, url in zip(servers, urls, strict=True):
        s.url = url
        s.command = server_command(s, args, cuda, cfg.seed, cfg.vllm_weight_transfer, lora)
        s.env = server_env(s, cuda, weights_dir, dict(environ))
    if "--vllm_server_timeout" not in train_argv:  # train.py waits for every server: each start wave's timeout
        flags += ["--vllm_server_timeout", f"{args.server_timeout * len(start_waves(servers, cuda)):g}"]
    if args.max_server_restarts and "--vllm_server_restart_timeout" not in train_argv:  # a restarted server's start
        flags += ["--vllm_server_restart_timeout", f"{args.server_timeout:g}"]
    script = str(Path(__file__).resolve().parents[2] / "train.py")
    trainer_cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                   str(len(trainer)), script, *flags]  # fmt: skip
    log_dir = Path(args.log_dir or Path(cfg.output_dir) / "layout_logs")
    return Layout(servers, trainer_cmd, trainer, weights_dir, made, log_dir, cuda, flags, why,
                  pushed=cfg.vllm_weight_transfer != "files")


def start_waves(servers: list[ServerSpec], cuda: bool) -> list[list[ServerSpec]]:
    """The servers in start waves: a server waits for the earlier servers that share one of its GPUs to be healthy
    (the module docstring); on CPU all start together."""
    waves: list[list[ServerSpec]] = []
    for s in servers:
        after = [i for i, wave in enumerate(waves) if cuda and any(set(s.devices) & set(o.devices) for o in wave)]
        index = max(after) + 1 if after else 0
        if index == len(waves):
            waves.append([])
        waves[index].append(s)
    return waves


def check_trainer_plan(layout: Layout) -> Path:
    """Every check of train.py's plan (its parse, the parts' checks, the data, the run directory, and the Python
    API's refusals: `trl_ext.cli_train.build_plan`), as the trainer's ``len(trainer_devices)`` processes will see
    them, before any server starts: a run the trainer would refuse exits 2 in seconds, not after the servers' start.
    The servers' ``/health`` wait is the one check left to the trainer. On CUDA in a child process that sees only
    the trainer's GPUs (this process would otherwise hold a CUDA context on a server's GPU). Returns the run
    directory."""
    n = len(layout.trainer_devices)
    if not layout.cuda:
        return _check_train_flags(layout.flags, n)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, layout.trainer_devices))}
    out = subprocess.run([sys.executable, "-m", "trl_ext.serve.plan", str(n), *layout.flags], env=env,
                         capture_output=True, text=True)  # fmt: skip
    if out.returncode == 2:
        raise ConfigError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "train.py refused the run")
    if out.returncode:
        raise RuntimeError(f"train.py's checks failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return Path(out.stdout.strip().splitlines()[-1].removeprefix(RUN_DIR_LINE))


RUN_DIR_LINE = "run directory: "
"""The last line `check_trainer_plan`'s child prints."""


def _check_train_flags(flags: list[str], processes: int) -> Path:
    from trl_ext.cli_train import build_plan, check_start
    from trl_ext.serve.register import servers_not_started
    from trl_ext.sweep_plan import planned_processes

    with planned_processes(processes), servers_not_started():
        plan = build_plan(flags)
        if processes > 1:  # the config as the launched processes hold it (CPU: gloo), which a resume compares
            from trl_ext.launch.processes import multi_process_settings

            multi_process_settings(plan.cfg, {"WORLD_SIZE": str(processes)})
        check_start(plan)
    return plan.run_dir


def _take_teacher_model(argv: list[str]) -> tuple[list[str], str]:
    """train.py's flags without ``--teacher_model`` (the teacher server serves it), and its value."""
    for i, arg in enumerate(argv):
        if arg == "--teacher_model" and i + 1 < len(argv):
            return argv[:i] + argv[i + 2:], argv[i + 1]
        if arg.startswith("--teacher_model="):
            return argv[:i] + argv[i + 1:], arg.split("=", 1)[1]
    return argv, ""


if __name__ == "__main__":  # `check_trainer_plan`'s child: PROCESSES TRAIN.PY FLAGS
    try:
        print(f"{RUN_DIR_LINE}{_check_train_flags(sys.argv[2:], int(sys.argv[1]))}")
    except ConfigError as e:
        print(f"train.py: {e}", file=sys.stderr)
        sys.exit(2)
