"""The off-policy generator's weights (`GeneratorWeights`): the policy version they hold, and the two ways a version
gets into them. A publish writes it directly (`write`: copied into the generator's model one gathered parameter at a
time, or pushed into an engine's servers), when the weight gate allows (``trl_ext.offpolicy.gate``); otherwise the
generator loads the store's snapshot of it before sampling with it (`load`: copied into the model, or staged for an
engine's sampler, which loads the checkpoint itself: ``trl_ext.interfaces.VersionedSampler``)."""

from __future__ import annotations

import torch
from torch import nn

from trl_ext.interfaces import Publisher, Sampler
from trl_ext.offpolicy.store import PolicyStore


class GeneratorWeights:
    """The weights ``sampler`` samples: its model's (a ``ModelSampler``; its parameters are written in place), or an
    engine's (a ``VersionedSampler``: ``model`` is None; with a ``pusher`` its servers take pushed versions).
    ``loaded_version`` is the version they hold; a model copy starts with policy ``start_step`` (recorded in
    ``store`` as written)."""

    def __init__(self, sampler: Sampler, store: PolicyStore, start_step: int, pusher: Publisher | None = None) -> None:
        self.sampler, self.store, self.pusher = sampler, store, pusher
        self.model: nn.Module | None = None if sampler.loads_versions else sampler.model
        self.params = dict(self.model.named_parameters()) if self.model is not None else {}
        self.loaded_version: int | None = None
        if self.model is not None:  # the copy holds the starting policy: nothing to snapshot or load for it
            self.loaded_version = start_step
            store.written(start_step)

    @property
    def direct(self) -> bool:
        """Whether a publish may write a version straight into them (a model copy, or servers with a pusher); else
        every version goes through the store."""
        return self.model is not None or self.pusher is not None

    @property
    def device(self) -> torch.device:
        """Where the generator samples: its model's device (an engine's sampler: CPU, where its seeds are drawn)."""
        return next(self.model.parameters()).device if self.model is not None else torch.device("cpu")

    def copy_in(self, tensors) -> None:
        """Every (name, whole tensor) of ``tensors`` copied into the generator's model, one at a time."""
        cuda = False
        with torch.no_grad():
            for name, tensor in tensors:
                if name not in self.params:
                    raise RuntimeError(f"published weight {name!r} is unknown to the generator copy")
                self.params[name].copy_(tensor)
                cuda = cuda or tensor.is_cuda
        if cuda:
            torch.cuda.current_stream().synchronize()  # the generator reads them on its own stream

    def write(self, version: int, model: nn.Module, stream: torch.cuda.Stream | None) -> None:
        """Version ``version`` (the trainer's ``model``) into the generator's model, or pushed into its servers (then
        the next request loads it: staged without a checkpoint). ``stream``: the generator's CUDA stream, whose last
        forward must finish first. Trainer thread, under the gate (`WeightGate.begin_write`)."""
        if self.pusher is not None:
            self.pusher.publish(version, model)
            self.sampler.stage(version, None)
            return
        from trl_ext.offpolicy.sharded import iter_whole

        if stream is not None:
            stream.synchronize()  # the generator's last forward has finished: no write under it
        self.copy_in(iter_whole(model, trainable_only=True))

    def written(self, version: int) -> None:
        """`write` of ``version`` completed: they hold it, and the store records it (with no snapshot)."""
        self.loaded_version = version
        self.store.written(version)

    def load(self, version: int) -> None:
        """Version ``version`` from the store's snapshot (generator thread), unless they hold it already (written in
        place by a publish)."""
        if version == self.loaded_version:
            return
        snapshot = self.store.take(version)
        if self.sampler.loads_versions:  # an engine's sampler loads the version's checkpoint itself
            self.sampler.stage(version, snapshot)
        else:
            self.copy_in(snapshot.items())
        self.loaded_version = version
