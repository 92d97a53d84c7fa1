"""Several processes as ONE run: what the launcher announced, the settings that make the Trainer use it, and the
parse-time refusal of every feature not yet verified on several processes.

Why a plain ``torchrun --nproc_per_node 2 train.py`` used to train two independent copies on CPU: transformers'
``TrainingArguments._setup_devices`` builds accelerate's ``PartialState(cpu=use_cpu, backend=ddp_backend)``. With
``use_cpu=False`` and no accelerator, ``PartialState._prepare_backend`` finds ``LOCAL_RANK`` set but no GPU, so the
distributed type stays ``NO`` (MULTI_CPU is chosen only with ``cpu=True``), while ``PartialState.__init__`` still calls
``init_process_group(backend=None)``: a process group nobody uses, ``parallel_mode`` NOT_PARALLEL, no DDP, no
sharding of the batch, every rank "main". `multi_process_settings` sets ``use_cpu=True`` and ``ddp_backend="gloo"``
on a machine without CUDA when the launcher started several processes; accelerate then chooses MULTI_CPU (gloo),
``parallel_mode`` is DISTRIBUTED and the model is wrapped in DDP. With CUDA, accelerate's own MULTI_GPU path applies.

Launchers announce the world size in the environment: torchrun and accelerate (``WORLD_SIZE``), Open MPI
(``OMPI_COMM_WORLD_SIZE``), MPICH / Intel MPI (``PMI_SIZE``), Slurm's srun (``SLURM_NTASKS`` with ``SLURM_PROCID``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from trl_ext.registry import ConfigError

WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
CPU_BACKEND = "gloo"  # torch.distributed's CPU backend (accelerate's MULTI_CPU default without MPI)
ONE_PROCESS = "runs on one process for now"


def launched_processes(environ: Mapping[str, str] | None = None) -> tuple[int, str | None]:
    """(number of processes the launcher started, the variable that says so); (1, None) for a plain start."""
    env = os.environ if environ is None else environ
    for name in WORLD_SIZE_VARIABLES:
        value = env.get(name)
        if value is not None:
            try:
                n = int(value)
            except ValueError:
                raise ConfigError(f"{name}={value!r} is not a process count") from None
            if n > 1:
                return n, name
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        return int(env["SLURM_NTASKS"]), "SLURM_NTASKS"
    return 1, None


def check_single_process(cli: str, environ: Mapping[str, str] | None = None) -> None:
    """ConfigError when ``cli`` (eval_run.py, sweep.py: one-process CLIs) was started as one of several processes."""
    n, name = launched_processes(environ)
    if n > 1:
        raise ConfigError(
            f"{cli} was launched as {n} processes ({name}={n}) but runs in one process: each process would do "
            f"the same work into the same directory. Start it once (`uv run {cli} ...`)"
        )


# ------------------------------------------------------------------------------------------ what runs on N processes
# Single flags (ExtGRPOConfig / TrainingArguments): (field, feature); several processes need the field's default.
CFG_FLAGS = (
    ("use_vllm", "vLLM generation"),
    ("use_transformers_continuous_batching", "continuous-batching generation"),
)
# RunArgs flags: (field, feature), likewise.
RUN_FLAGS = (
    ("rebuild_builtin", "rebuilding the builtin model (every process would rebuild it)"),
)


def _refusal(flag: str, value, feature: str, n: int, var: str) -> ConfigError:
    shown = f"--{flag} {value}" if not isinstance(value, bool) else f"--{flag}"
    return ConfigError(f"{shown}: {feature} {ONE_PROCESS}; this launch has {n} processes ({var}={n}). Start "
                       "train.py once, without torchrun/accelerate launch, or drop the flag")


def _plain(value) -> object:
    return value.value if hasattr(value, "value") else value  # TrainingArguments' str enums (eval_strategy)


def _default(obj, name: str) -> object:
    """The dataclass default of ``obj``'s field ``name`` (the one place a flag's default is defined)."""
    (f,) = (f for f in dataclasses.fields(obj) if f.name == name)
    return _plain(f.default)


def check_run_processes(run, environ: Mapping[str, str] | None = None) -> None:
    """RunArgs features refused on several processes (ConfigError naming the flag); nothing on one process."""
    n, var = launched_processes(environ)
    if n == 1:
        return
    for flag, feature in RUN_FLAGS:
        if getattr(run, flag) != _default(run, flag):
            raise _refusal(flag, getattr(run, flag), feature, n, var)


def changed_flag(cfg, groups: dict[type, str], flags) -> tuple[str, object, str] | None:
    """(flag, value, feature) of the first field of the ``groups`` dataclasses (-> feature name) away from its default,
    else of the first ``flags`` entry (field, feature) away from its default; None."""
    for group, feature in groups.items():
        for f in dataclasses.fields(group):
            if not f.init or f.default is dataclasses.MISSING:
                continue
            if getattr(cfg, f.name) != f.default:
                return f.name, getattr(cfg, f.name), feature
    for flag, feature in flags:
        if _plain(getattr(cfg, flag)) != _default(cfg, flag):
            return flag, _plain(getattr(cfg, flag)), feature
    return None


def unverified_feature(cfg) -> tuple[str, object, str] | None:
    """(flag, value, feature) of the first ExtGRPOConfig flag not yet verified on several processes (`CFG_FLAGS`);
    None."""
    return changed_flag(cfg, {}, CFG_FLAGS)


def check_cfg_processes(cfg, environ: Mapping[str, str] | None = None) -> None:
    """ExtGRPOConfig features refused on several processes (`unverified_feature`). Called on the parsed values,
    before TrainingArguments sets the devices up (no process group is started for a refused launch)."""
    n, var = launched_processes(environ)
    if n == 1:
        return
    found = unverified_feature(cfg)
    if found is not None:
        raise _refusal(*found, n, var)


def multi_process_settings(cfg, environ: Mapping[str, str] | None = None, cuda: bool | None = None) -> None:
    """On several processes without CUDA, ``use_cpu=True`` and ``ddp_backend="gloo"``: what makes accelerate pick
    MULTI_CPU (see the module docstring). Another ``--ddp_backend`` on CPU is an error; one process: unchanged."""
    n, _ = launched_processes(environ)
    if n == 1:
        return
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if cuda:
        return  # accelerate's MULTI_GPU (nccl) path; not run on GPU here yet
    if cfg.ddp_backend not in (None, CPU_BACKEND):
        raise ConfigError(f"--ddp_backend {cfg.ddp_backend}: {n} processes on CPU communicate through "
                          f"{CPU_BACKEND}")
    cfg.use_cpu = True
    cfg.ddp_backend = CPU_BACKEND


# ------------------------------------------------------------------------------------------ rank roles at runtime
def world() -> tuple[int, int]:
    """(rank, world size) of the started process group; (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main() -> bool:
    return world()[0] == 0


def on_main(fn, *args, **kwargs):
    """Run ``fn`` on the main process; every rank receives its result, or raises the ConfigError it raised (so a
    refusal decided by the main process, e.g. the run-directory check, ends every rank with exit 2, none hangs)."""
    rank, size = world()
    if size == 1:
        return fn(*args, **kwargs)
    import torch.distributed as dist

    box = [None]
    if rank == 0:
        try:
            box[0] = ("ok", fn(*args, **kwargs))
        except ConfigError as e:
            box[0] = ("error", str(e))
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise ConfigError(value)
    return value


def average_gradients(params: list) -> None:
    """DDP's gradient all-reduce done by hand, for a backward DDP cannot sync itself (the routed step): the
    gradients of ``params`` (the same parameters in the same order on every process; a missing gradient counts 0)
    summed over the processes in one flat buffer and divided by their number, as DDP averages."""
    rank, size = world()
    if size == 1 or not params:
        return
    import torch
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= size
    offset = 0
    for p, g in zip(params, grads, strict=True):
        p.grad = flat[offset : offset + g.numel()].view_as(g).clone()
        offset += g.numel()


def barrier() -> None:
    """Wait for every rank (no-op on one process)."""
    if world()[1] > 1:
        import torch.distributed as dist

        dist.barrier()


def end_processes() -> None:
    """Destroy the process group before the interpreter exits (every rank, on a normal return or a refusal).
    Without it Gloo's worker threads may still hold finished work whose tensors are freed during interpreter
    finalization, and the process aborts with SIGABRT after its work is done (pytorch/pytorch#179291). Not called
    on an exception: a rank whose peer waits in a collective would block on the join; torchrun ends that launch."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def describe_launch(cfg) -> str:
    """train.log's header line: processes and the global batch (TRL's per_device_train_batch_size is per process)."""
    _, n = world()
    per, steps = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps
    accumulation = f" x {steps} accumulation steps" if steps > 1 else ""
    if n == 1:
        return f"processes: 1; batch: {per} completions per process{accumulation} = {per * steps} per optimizer step"
    return (f"processes: {n} ({cfg.ddp_backend or 'default'} backend, DDP); batch: {per} completions per process "
            f"x {n} processes{accumulation} = {per * n * steps} completions per optimizer step (global)")


def name_tag(environ: Mapping[str, str] | None = None) -> str:
    """Run-name suffix of a multi-process run (``_procs2``): its global batch differs from a one-process run's with
    the same ``--batch_size``, so the two never share a directory. Empty on one process (names unchanged)."""
    n, _ = launched_processes(environ)
    return f"_procs{n}" if n > 1 else ""


def launch_record(environ: Mapping[str, str] | None = None) -> dict | None:
    """run_config.yaml's ``launch`` section on several processes (None on one process, so that one-process configs
    and their checkpoints are unchanged); a resume compares it like any run-defining value."""
    n, _ = launched_processes(environ)
    return {"launch": {"num_processes": n}} if n > 1 else None
