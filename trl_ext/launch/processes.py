"""Several processes as ONE run: what the launcher announced, the settings that make the Trainer use it, and the
parse-time refusal of what is not yet verified on several processes (asked of the registered parts' ``supports``,
`trl_ext.launch.refusals`).

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

import os
from collections.abc import Mapping

from trl_ext.launch.refusals import ONE_PROCESS, Launch, check_launch, refused_flags  # noqa: F401 (ONE_PROCESS)
from trl_ext.registry import ConfigError

WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
CPU_BACKEND = "gloo"  # torch.distributed's CPU backend (accelerate's MULTI_CPU default without MPI)


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
def check_processes(args, environ: Mapping[str, str] | None = None) -> None:
    """ConfigError naming the flag of ``args`` (RunArgs or ExtGRPOConfig) whose part (`trl_ext.parts`) refuses
    several processes; nothing on one process."""
    n, var = launched_processes(environ)
    if n > 1:
        check_launch(args, Launch(processes=n, variable=var))


def check_run_processes(run, environ: Mapping[str, str] | None = None) -> None:
    """RunArgs flags refused on several processes (`check_processes`)."""
    check_processes(run, environ)


def check_cfg_processes(cfg, environ: Mapping[str, str] | None = None) -> None:
    """ExtGRPOConfig flags refused on several processes (`check_processes`). Called on the parsed values, before
    TrainingArguments sets the devices up (no process group is started for a refused launch)."""
    check_processes(cfg, environ)


def __getattr__(name: str):
    if name == "CFG_FLAGS":  # (flag, part) of every flag refused on several processes (read by sweep.resumable)
        return tuple(refused_flags(Launch(processes=2, variable="WORLD_SIZE")))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def model_init_kwargs(cfg, cuda: bool | None = None, local_rank: int | None = None) -> dict:
    """``--model_init_kwargs`` with each process's model on its own GPU. TRL loads a model from its path with
    ``device_map="auto"`` on one process and under FSDP (``trl.trainer.utils.create_model_from_path``: only DDP and
    DeepSpeed get None), which on a machine of several GPUs spreads the model over every one of them, every process
    of an FSDP run included. With CUDA the map is ``{"": LOCAL_RANK}`` unless the kwargs name a ``device_map``."""
    kwargs = dict(cfg.model_init_kwargs or {})
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if cuda and "device_map" not in kwargs:
        kwargs["device_map"] = {"": int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else local_rank}
    return kwargs


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


def describe_launch(cfg, parallelism: str = "DDP") -> str:
    """train.log's header line: processes, the ``parallelism`` in effect (read from the prepared model:
    `trl_ext.launch.fsdp.Parallelism.describe`) and the global batch (TRL's per_device_train_batch_size is per
    process)."""
    _, n = world()
    per, steps = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps
    accumulation = f" x {steps} accumulation steps" if steps > 1 else ""
    if n == 1:
        return f"processes: 1; batch: {per} completions per process{accumulation} = {per * steps} per optimizer step"
    return (f"processes: {n} ({cfg.ddp_backend or 'default'} backend, {parallelism}); batch: {per} completions per "
            f"process x {n} processes{accumulation} = {per * n * steps} completions per optimizer step (global)")


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
