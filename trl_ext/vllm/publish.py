"""Publishing the policy to vLLM engines as checkpoints: the merged weights streamed into safetensors files, written
once per node per publish, each version in its own directory (`CheckpointPublisher`).

This is prime-rl's path (its trainer writes a checkpoint, its inference server reloads it) and the one that works on
CPU vLLM, which prepacks each linear weight (TRL's in-place ``load_weights`` fails there; a reload repacks).

Memory: `write_checkpoint` takes one tensor at a time from ``trl_ext.vllm.weights.merged_weights`` (gathered from the
FSDP2 shards module by module) and keeps host copies until a file of ``bucket_bytes`` is full, so a publish holds at
most one bucket plus one module's whole tensors (its weight, its adapters and the merged weight) beyond the trained
model, on every process: never the whole model. Every process takes part in the gathers; only the node's main
process (accelerate's local main) writes. The files live until no generator can need them: with
``--max_async_level k``, a batch trained after version v is sampled by a version >= v - k, so publishing v deletes
every version below v - k; at most k + 2 checkpoints exist at once on each node.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid

from torch import nn

from trl_ext.vllm.weights import merged_weights

BUCKET_BYTES = 256 * 2**20
"""Bytes of one safetensors file of a published checkpoint: the host memory a publish holds beyond one module."""
INDEX = "model.safetensors.index.json"
EXTRAS_KEPT = 6
"""`CheckpointPublisher.publish_adapter`'s directories kept (two routing evals' three modes)."""


def write_checkpoint(model: nn.Module, directory: str, writer: bool, bucket_bytes: int = BUCKET_BYTES,
                     adapters: bool = True) -> int:  # fmt: skip
    """``model``'s merged weights (``adapters`` False: its base weights alone) as safetensors files of about
    ``bucket_bytes`` each, with transformers' index (``model.safetensors.index.json``), in ``directory``; returns the
    bytes written (0 where not ``writer``). Every process must call it (a collective under FSDP2); processes that are
    not the ``writer`` only take part."""
    from safetensors.torch import save_file

    bucket, size, total, files, weight_map = {}, 0, 0, 0, {}

    def flush():
        nonlocal bucket, size, files
        files += 1
        name = f"model-{files:05d}.safetensors"
        save_file(bucket, os.path.join(directory, name))
        weight_map.update(dict.fromkeys(bucket, name))
        bucket, size = {}, 0

    if writer:
        os.makedirs(directory, exist_ok=True)
    for name, tensor in merged_weights(model, adapters):
        if not writer:
            continue
        bucket[name] = tensor.detach().to("cpu", copy=True).contiguous()  # a copy: tied weights share no storage
        size += bucket[name].numel() * bucket[name].element_size()
        total += bucket[name].numel() * bucket[name].element_size()
        del tensor
        if size >= bucket_bytes:
            flush()
    if writer:
        if bucket or not files:
            flush()
        with open(os.path.join(directory, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def model_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters, whole (a DTensor counts its global size)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def weights_root(nbytes: int, copies: int) -> tuple[str, str]:
    """(directory, why) for ``copies`` checkpoints of ``nbytes``: ``/dev/shm`` (memory, not disk) when it has room
    for them, else the temporary directory, with the reason stated (a container's /dev/shm is often 64 MiB)."""
    need = copies * nbytes
    if os.path.isdir("/dev/shm"):
        free = shutil.disk_usage("/dev/shm").free
        if free > need:
            return "/dev/shm", f"/dev/shm has {free / 2**30:.1f} GiB free"
        why = f"/dev/shm has {free / 2**30:.2f} GiB free, {need / 2**30:.2f} GiB needed: written to disk"
    else:
        why = "no /dev/shm: written to disk"
    return tempfile.gettempdir(), why


class CheckpointPublisher:
    """A ``trl_ext.interfaces.EnginePublisher``: `publish` writes version ``version`` as a checkpoint
    (`write_checkpoint`) by the node's main process, every process waiting until it is complete, and deletes the older
    versions no generator can need (module docstring); `snapshot` is a published version's directory, which an
    engine's sampler loads. ``accelerator`` gives the processes; ``max_async_level`` the versions kept.

    With ``adapter_rank`` (``--vllm_lora_sync``) a version is the policy's adapters as one LoRA adapter of that rank
    (``trl_ext.vllm.lora.write_adapter``), and the first publish also writes the base weights once (``base/``
    beside the versions, ``trl_ext.vllm.lora.BASE``), which the engines load once. ``sent``: (kind, bytes,
    seconds) of every write, ``"base"``, ``"adapter"`` or ``"merged"`` (the seconds of the whole publish);
    ``metrics()``: TRL's metric lists, or None (``vllm/publish_bytes``, ``vllm/publish_seconds``,
    ``vllm/base_sends`` each step)."""

    def __init__(self, accelerator, max_async_level: int, nbytes: int, bucket_bytes: int = BUCKET_BYTES,
                 root: str | None = None, adapter_rank: int | None = None, metrics=None) -> None:  # fmt: skip
        """``root``: the directory the checkpoints go under, shared by every node and the servers reading them
        (``trl_ext.serve``; the run's main process writes); None: a node's own (`weights_root`, its main process
        writes)."""
        from accelerate.utils import broadcast_object_list

        self.accelerator, self.k, self.bucket_bytes = accelerator, max_async_level, bucket_bytes
        self.adapter_rank, self.metrics = adapter_rank, metrics
        self.sent: list[tuple[str, int, float]] = []
        self.extras: list[str] = []  # `publish_adapter`'s directories, oldest first
        self.writer = accelerator.is_local_main_process if root is None else accelerator.is_main_process
        token = [uuid.uuid4().hex[:12]]
        if accelerator.num_processes > 1:
            broadcast_object_list(token)  # one name on every node
        if root is None:
            root, self.why = weights_root(nbytes, max_async_level + 2)
        else:
            self.why = "the servers' weights directory (TRL_EXT_WEIGHTS_DIR)"
        self.root = os.path.join(root, f"trl_ext_vllm_{token[0]}")
        self.versions: dict[int, str] = {}

    def publish(self, version: int, model: nn.Module) -> None:
        from trl_ext.vllm.lora import write_adapter

        directory = os.path.join(self.root, f"v{version:08d}")
        start, written = time.perf_counter(), []
        if self.adapter_rank is None:
            written.append(("merged", write_checkpoint(model, directory, self.writer, self.bucket_bytes)))
        else:
            if not self.base_sends:
                written.append(("base", self._write_base(model)))
            written.append(("adapter", write_adapter(model, directory, self.writer, self.adapter_rank)))
        self.accelerator.wait_for_everyone()  # the files are complete before any engine reads them
        seconds = time.perf_counter() - start
        self.sent += [(kind, nbytes, seconds) for kind, nbytes in written]
        if self.metrics is not None:
            m = self.metrics()
            m["vllm/publish_bytes"].append(float(sum(nbytes for _, nbytes in written)))
            m["vllm/publish_seconds"].append(seconds)
            m["vllm/base_sends"].append(float(self.base_sends))
        self.versions[version] = directory
        for old in [v for v in self.versions if v < version - self.k]:
            if self.writer:
                shutil.rmtree(self.versions[old], ignore_errors=True)
            del self.versions[old]

    def publish_adapter(self, name: str, model: nn.Module) -> str:
        """``model``'s adapters at their current scales as the adapter directory ``name`` beside the versions (the
        routing eval's modes: ``trl_ext.vllm.eval_sampler``), the base weights sent first if they were not; not a
        version (nothing deletes it but `close`). Every process must call it."""
        from trl_ext.vllm.lora import write_adapter

        if self.adapter_rank is None:
            raise ValueError("this publisher sends merged versions, not adapters")
        if not self.base_sends:
            self.sent.append(("base", self._write_base(model), 0.0))
        directory = os.path.join(self.root, name)
        if directory in self.extras:
            raise ValueError(f"adapter {name!r} was published already: an engine may hold it (give a new name)")
        write_adapter(model, directory, self.writer, self.adapter_rank)
        self.accelerator.wait_for_everyone()
        self.extras.append(directory)
        while len(self.extras) > EXTRAS_KEPT:  # the eval's adapters of earlier evals
            old = self.extras.pop(0)
            if self.writer:
                shutil.rmtree(old, ignore_errors=True)
        return directory

    def _write_base(self, model: nn.Module) -> int:
        """The base weights (the model without its adapters) in ``base/`` beside the versions; their bytes."""
        from trl_ext.vllm.lora import BASE

        return write_checkpoint(model, os.path.join(self.root, BASE), self.writer, self.bucket_bytes, adapters=False)

    @property
    def base_sends(self) -> int:
        """Times the base weights were written (adapter versions: 1 once the first version is published)."""
        return sum(kind == "base" for kind, _, _ in self.sent)

    def snapshot(self, version: int) -> str:
        """The checkpoint directory of published ``version`` (KeyError once it is deleted, or never published)."""
        if version not in self.versions:
            raise KeyError(f"policy version {version} has no checkpoint (kept: {sorted(self.versions)})")
        return self.versions[version]

    def close(self) -> None:
        """Delete every checkpoint (the generator has stopped)."""
        if self.writer:
            shutil.rmtree(self.root, ignore_errors=True)
        self.versions.clear()
