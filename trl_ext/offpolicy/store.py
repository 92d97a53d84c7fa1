"""The policy versions the trainer publishes to the off-policy generator (`PolicyStore`): which exist, and the weight
snapshots of those the generator has yet to load (``trl_ext.offpolicy.worker.RolloutWorker.publish`` decides when a
version needs one, ``trl_ext.offpolicy.gate.WeightGate``)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import Tensor, nn

from trl_ext.interfaces import EnginePublisher


def trainable_snapshot(model: nn.Module) -> dict[str, Tensor]:
    """Detached copies of the parameters the optimizer changes (all of them for a full fine-tune, adapters for LoRA);
    whole tensors gathered from the shards of an FSDP2 model (a collective, `trl_ext.offpolicy.sharded`)."""
    from trl_ext.offpolicy.sharded import full_parameters, is_sharded

    if is_sharded(model):
        snapshot = full_parameters(model, trainable_only=True)
    else:
        snapshot = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    if torch.cuda.is_available() and any(t.is_cuda for t in snapshot.values()):
        torch.cuda.current_stream().synchronize()  # the generator reads them on its own stream
    return snapshot


class Closed(Exception):
    """Raised in a waiting thread when the rollout machinery is shut down."""


class PolicyStore:
    """The published policy versions, and the snapshots of those the generator has yet to load: a
    ``trl_ext.interfaces.Publisher``. ``snapshot(version, model)`` makes one: by default the trainable parameters'
    copies (`trainable_snapshot`), which the generator copies into its model; with a vLLM engine (`of`) the engine
    publisher's snapshot, a checkpoint directory (``trl_ext.vllm.publish.CheckpointPublisher``), which its sampler
    loads. A version written straight into the generator's model (`RolloutWorker.publish`) is recorded with `written`
    and has no snapshot."""

    @classmethod
    def of(cls, publisher: EnginePublisher) -> PolicyStore:
        """A store whose snapshot of a version is ``publisher``'s: it publishes the version (a collective), then
        keeps ``publisher.snapshot(version)``."""

        def snapshot(version: int, model: nn.Module):
            publisher.publish(version, model)
            return publisher.snapshot(version)

        return cls(snapshot)

    def __init__(self, snapshot: Callable[[int, nn.Module], object] | None = None) -> None:
        self._snapshot = snapshot or (lambda version, model: trainable_snapshot(model))
        self._cond = threading.Condition()
        self._snapshots: dict[int, object] = {}
        self._latest: int | None = None
        self._closed = False

    def publish(self, version: int, model: nn.Module) -> None:
        """Version ``version`` of ``model`` kept as a snapshot until the generator takes it."""
        snapshot = self._snapshot(version, model)
        if snapshot is None:  # e.g. a Publisher's publish (it returns None): the store is built with `of`
            raise TypeError(f"the snapshot of policy version {version} is None: build the store over an engine's "
                            "publisher with PolicyStore.of(publisher)")  # fmt: skip
        with self._cond:
            self._check_order(version)
            self._snapshots[version] = snapshot
            self._latest = version
            self._cond.notify_all()

    def written(self, version: int) -> None:
        """Version ``version`` is published and already in the generator's model: no snapshot, and every older
        snapshot is dropped (the generator needs none of them: `RolloutWorker.publish` writes only then)."""
        with self._cond:
            self._check_order(version)
            self._snapshots.clear()
            self._latest = version
            self._cond.notify_all()

    def _check_order(self, version: int) -> None:
        if self._latest is not None and version <= self._latest:
            raise ValueError(f"policy version {version} published after version {self._latest}")

    @property
    def latest(self) -> int | None:
        with self._cond:
            return self._latest

    def wait(self, version: int) -> int:
        """Block until a version >= ``version`` is published; return the newest one."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or (self._latest is not None and self._latest >= version))
            if self._closed:
                raise Closed
            return self._latest

    def take(self, version: int):
        """The snapshot of exactly ``version``, removed from the store with every older one (versions are loaded in
        order, each once)."""
        with self._cond:
            if version not in self._snapshots:
                raise RuntimeError(f"policy version {version} is not available (have {sorted(self._snapshots)})")
            for old in [v for v in self._snapshots if v < version]:
                del self._snapshots[old]
            return self._snapshots.pop(version)

    def held_versions(self) -> list[int]:
        with self._cond:
            return sorted(self._snapshots)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
