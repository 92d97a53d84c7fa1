"""vLLM's weight transfer over a gloo process group: the ``gloo`` backend of ``--vllm_weight_transfer`` (its classes
keep vLLM's ``...WeightTransferEngine`` names, which vLLM's factories look up).

vLLM's NCCL backend (``vllm/distributed/weight_transfer/nccl_engine.py``) pushes the trainer's weights into a
server's workers: the trainer announces each parameter's name, dtype and shape (``update_weights``), then broadcasts
the tensors from its rank 0 to every worker, which loads each one (``model.load_weights``) between vLLM's
``start_weight_update`` and ``finish_weight_update`` (layerwise reload). That backend needs CUDA. These subclasses
keep the whole protocol (the trainer's source, its metadata check, the routes, the worker's load) and replace only the
communicator: a gloo group on a TCP store hosted by the trainer's process 0, one tensor per broadcast, on CPU. So
CPU servers (and the vLLM tier's tests of this path) get weights without a shared filesystem.

Every collective of the group (its rendezvous, each broadcast) times out after ``timeout_s`` (the trainer's
``--vllm_request_timeout``): a broadcast that a worker never receives raises then (gloo's send waits for the
receiver). ``trl_ext.serve.transfer.WeightPusher`` sends through the trainer side's ``_broadcast`` into every
replica's group at once (its ``Fanout`` stands for the group: each tensor is copied to the CPU once), and bounds the
join and each publish itself.

Registered in vLLM's factories by ``trl_ext.serve.plugin.register`` (a vLLM general plugin).
"""

from __future__ import annotations

import datetime
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, WeightTransferInitInfo
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLTrainerWeightTransferEngine,
    NCCLWeightTransferEngine,
    NCCLWeightTransferUpdateInfo,
)

from trl_ext import compat

PREFIX = "trl_ext_weights"
"""The gloo group's key prefix in the trainer's TCP store."""


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """A worker's side: the trainer's store, this server's first rank in the group, the group's size, the timeout
    of every collective (seconds)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """The trainer's side: where its process 0 hosts the store (``master_port`` 0: a free port), the group's size
    (1 + the server's workers), the timeout of every collective (seconds)."""

    backend: ClassVar[str] = "gloo"

    master_address: str
    master_port: int
    world_size: int
    timeout_s: float


def gloo_group(store, rank: int, world_size: int, timeout_s: float):
    """A gloo process group of ``world_size`` ranks on ``store`` (no global process group is touched)."""
    from torch.distributed import PrefixStore
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    return ProcessGroupGloo(PrefixStore(PREFIX, store), rank, world_size, datetime.timedelta(seconds=timeout_s))


class GlooWeightTransferEngine(NCCLWeightTransferEngine):
    """A server worker's end: joins the trainer's gloo group, receives each announced tensor and loads it."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = NCCLWeightTransferUpdateInfo

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        from torch.distributed import TCPStore

        pc = self.parallel_config
        rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset  # as NCCL's workers
        timeout = datetime.timedelta(seconds=init_info.timeout_s)
        store = TCPStore(init_info.master_address, init_info.master_port, init_info.world_size, False, timeout=timeout)
        self.packed = False
        self.model_update_group = gloo_group(store, rank, init_info.world_size, init_info.timeout_s)

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        if self.model_update_group is None:
            raise RuntimeError("gloo weight transfer not initialized: call init_transfer_engine() first")
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes,
                                           strict=True):  # fmt: skip
            weight = torch.empty(shape, dtype=getattr(torch, dtype_name))
            self.model_update_group.broadcast([weight]).wait()  # from rank 0, the trainer
            self.model.load_weights([(name, weight.to(self.device))])
            del weight


class GlooTrainerWeightTransferEngine(NCCLTrainerWeightTransferEngine):
    """The trainer's end: process 0 hosts the store and sends; the other processes only take part in the gathers
    of the source (FSDP2), as in vLLM's NCCL trainer engine."""

    init_info_cls = GlooTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source=None):
        if source is None:
            raise ValueError("gloo weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, packed=False)
        if not engine.is_sender:
            return engine
        from torch.distributed import TCPStore

        timeout = datetime.timedelta(seconds=init_info.timeout_s)
        store = TCPStore(init_info.master_address, init_info.master_port, init_info.world_size, True,
                         timeout=timeout, wait_for_workers=False)  # fmt: skip
        worker = GlooWeightTransferInitInfo(master_address=init_info.master_address, master_port=store.port,
                                            rank_offset=1, world_size=init_info.world_size,
                                            timeout_s=init_info.timeout_s)  # fmt: skip
        with ThreadPoolExecutor(max_workers=1) as exe:  # the workers join while this process opens its end
            future = exe.submit(engine.client.init_weight_transfer_engine, asdict(worker))
            engine.model_update_group = gloo_group(store, 0, init_info.world_size, init_info.timeout_s)
            future.result()
        engine._store = store  # the workers reconnect to it at every collective
        return engine

    def _broadcast(self, source, meta) -> None:
        """vLLM's (``NCCLTrainerWeightTransferEngine._broadcast``), one gloo broadcast per tensor; the group may be
        ``trl_ext.serve.transfer.Fanout`` (every replica's group)."""
        if not self.is_sender:
            for _ in source:
                pass
            return
        for _name, tensor in compat.checked_weights(self, source, meta):
            self.model_update_group.broadcast([tensor.detach().to("cpu").contiguous()]).wait()

