"""FSDP2 in the trainer: accelerate's FSDP state on CPU processes, and the parallelism read from the prepared model.

**Why FSDP needs help on CPU.** transformers turns ``--fsdp`` into accelerate's ``FullyShardedDataParallelPlugin`` and
passes it to ``Accelerator``. accelerate 1.15's ``AcceleratorState`` keeps the plugin (``distributed_type`` FSDP) only
when the processes' type is a GPU-like one (MULTI_GPU, MULTI_XPU, ...): with ``MULTI_CPU``, which several CPU
processes get (gloo; `trl_ext.launch.processes.multi_process_settings`), it drops the plugin without a word and the
Trainer wraps the model in DDP. `use_fsdp_on_cpu` sets the state to FSDP with the Trainer's plugin right after the
Accelerator is built, before TRL prepares its reference model, so that the Trainer, TRL and accelerate take their
FSDP paths as on GPUs (``fully_shard`` runs on CPU tensors with gloo). On GPUs nothing is changed.

**What is in effect** is read from the model the Trainer prepared (`read_parallelism`): the modules that are FSDP2
``FSDPModule`` instances and the parameters that are ``DTensor`` shards, or a ``DistributedDataParallel`` wrapper.
A launch that asked for FSDP or DeepSpeed and got anything else is a ConfigError (`check_parallelism`) before the
first step: never an unsharded run under a sharded run's name. train.log's header and run_config.yaml's ``launch``
section name it (`trl_ext.runs.rundir.LaunchHeader`).

The two trainer hooks that call these are `trl_ext.runs.lifecycle.RunLifecycle`'s (every trainer of a run inherits
it).
"""

from __future__ import annotations

from dataclasses import dataclass

from trl_ext import compat
from trl_ext.launch.sharding import sharded_training
from trl_ext.registry import ConfigError


def use_fsdp_on_cpu(trainer) -> bool:
    """On CPU processes (accelerate's MULTI_CPU) of a run that asked for FSDP (``--fsdp``, or accelerate's
    ``ACCELERATE_USE_FSDP``): accelerate's state set to FSDP with the plugin the Trainer built from its arguments,
    mixed precision set on it as accelerate sets it on GPUs, and the Trainer's ``is_fsdp_enabled``. True when it
    changed the state; False elsewhere (GPUs, one process, no FSDP asked for)."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    if state.distributed_type != DistributedType.MULTI_CPU or sharded_training(trainer.args) != "FSDP":
        return False
    args = trainer.args.fsdp_plugin_args
    plugin = FullyShardedDataParallelPlugin(**args) if args else FullyShardedDataParallelPlugin()  # else: from env
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    compat.record_distributed_type(DistributedType.FSDP)  # as AcceleratorState.__init__ records it
    trainer.is_fsdp_enabled = True
    return True


@dataclass(frozen=True)
class Parallelism:
    """How the prepared model is distributed over the processes (`read_parallelism`)."""

    kind: str  # "FSDP2", "FSDP1", "DDP", "DeepSpeed" or "none"
    processes: int
    sharded_modules: int = 0  # modules that are FSDP2 FSDPModule instances (fully_shard units)
    dtensor_params: int = 0  # parameters held as DTensor shards
    params: int = 0  # the model's parameters (tensors)
    local_elements: int = 0  # this process's parameter elements (a DTensor counts its local shard)
    elements: int = 0  # the model's parameter elements

    def describe(self) -> str:
        """E.g. ``FSDP2: 8 modules sharded over 2 processes, 38 of 38 parameters as DTensor shards``, or ``DDP``."""
        if self.kind == "FSDP2":
            return (f"FSDP2: {self.sharded_modules} modules sharded over {self.processes} processes, "
                    f"{self.dtensor_params} of {self.params} parameters as DTensor shards")
        return self.kind


def read_parallelism(model, processes: int) -> Parallelism:
    """The parallelism of ``model`` as the Trainer prepared it (its ``model_wrapped``), read from its modules and
    parameters, not from the flags."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    params = list(model.parameters())
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
    counts = {"processes": processes, "params": len(params), "local_elements": local,
              "elements": sum(p.numel() for p in params)}  # fmt: skip
    sharded = sum(isinstance(m, FSDPModule) for m in model.modules())
    if sharded:
        return Parallelism("FSDP2", sharded_modules=sharded,
                           dtensor_params=sum(isinstance(p, DTensor) for p in params), **counts)  # fmt: skip
    if isinstance(model, DistributedDataParallel):
        return Parallelism("DDP", **counts)
    names = {type(m).__name__ for m in model.modules()}
    if "FullyShardedDataParallel" in names:
        return Parallelism("FSDP1", **counts)
    if type(model).__name__ == "DeepSpeedEngine":
        return Parallelism("DeepSpeed", **counts)
    return Parallelism("none", **counts)


def check_parallelism(args, parallelism: Parallelism) -> None:
    """ConfigError when the run asked for FSDP (``--fsdp`` / ``ACCELERATE_USE_FSDP``) or DeepSpeed and the prepared
    model is not sharded that way (accelerate would have trained it unsharded)."""
    asked = sharded_training(args)
    wanted = {"FSDP": "FSDP2", "DeepSpeed": "DeepSpeed"}.get(asked)
    if wanted is not None and parallelism.kind != wanted:
        raise ConfigError(f"{asked} was asked for, but the prepared model is {parallelism.describe()} over "
                          f"{parallelism.processes} process(es): it would train unsharded. Launch it with torchrun / "
                          "accelerate launch on several processes, or drop the sharding flags")


def init_fsdp2_now(model) -> None:
    """FSDP2's lazy initialisation, run now on the prepared model (else at its first forward). It fixes each
    parameter group's mixed-precision dtypes from the parameters that require grad at that moment (torch's
    ``FSDPParamGroup._init_mp_dtypes``), and PEFT's ``disable_adapter`` (TRL's reference pass) turns the adapters'
    ``requires_grad`` off: when that pass is the first forward (``--max_async_level >= 1``: the generator samples
    with its own copy), a LoRA group records no trainable dtype and its bf16 gradients are never cast back to the
    float32 adapters (a RuntimeError at the first backward, seen on a GPU with --bf16)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        compat.fsdp2_lazy_init(model)
