"""Weights pushed into the policy's servers (``--vllm_weight_transfer nccl|gloo``) with vLLM's weight-transfer engines
(``vllm.distributed.weight_transfer``), instead of a checkpoint each server reloads (``files``).

`WeightPusher.publish(version, model)` is `trl_ext.vllm.publish.CheckpointPublisher`'s interface: every trainer
process calls it (a collective under FSDP2: each tensor is gathered from its shards, `PolicySource`); process 0
broadcasts the merged weights (``trl_ext.vllm.weights.merged_weights``) to every worker of every replica through
vLLM's trainer engine (``WeightTransferTrainerFactory``; the ``gloo`` one is ``trl_ext.serve.gloo_engine``), one
group per replica. The control plane is the version gate's narrow routes (`GateClient` to
``trl_ext.serve.endpoint``): the server takes the push once no request runs, and answers requests of that version
only after it has loaded every tensor. A push holds one version on the server: at k >= 1 the off-policy generator
(``trl_ext.offpolicy.worker.RolloutWorker.publish``) pushes a version only once no batch still to be sampled, on any
process, needs an older one; otherwise that version goes as a checkpoint.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

from torch import nn

try:
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
except ImportError:  # without the vLLM extra the module imports (its tests' tables read it); WeightPusher needs vLLM
    ParamMeta, WeightSource = None, object

from trl_ext.registry import ConfigError
from trl_ext.serve.client import Replica
from trl_ext.serve.endpoint import PUSH_PATH
from trl_ext.vllm.weights import merged_weights


class PolicySource(WeightSource):
    """The policy's merged weights as vLLM's `WeightSource`: iteration is `merged_weights` (a collective under FSDP2);
    `metadata` is read from one pass at construction (names, dtypes and shapes do not change during a run)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._meta = [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in merged_weights(model)]

    def metadata(self) -> list[ParamMeta]:
        return list(self._meta)

    def __iter__(self) -> Iterator:
        return merged_weights(self.model)


class GateClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over one replica's gate routes (``trl_ext.serve.endpoint``, the API
    key and request timeout of `Replica`); ``version`` is the policy version the next push carries."""

    def __init__(self, replica: Replica) -> None:
        self.replica, self.version = replica, None

    def _post(self, op: str, body: dict) -> None:
        self.replica._request("POST", PUSH_PATH + op, body, retry=False)  # a push's step is not repeated

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._post("init", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._post("start", {"version": self.version})

    def update_weights(self, update_info) -> None:
        self._post("update", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("finish", {"version": self.version})


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


class WeightPusher:
    """Pushes each published version into every replica (module docstring). ``backend``: ``nccl`` or ``gloo``;
    ``address``: where the replicas reach this run's process 0; ``infos``: each replica's ``/v1/trl_ext/info``."""

    def __init__(self, replicas: list[Replica], infos: list[dict], backend: str, model: nn.Module, rank: int,
                 address: str, timeout_s: float) -> None:  # fmt: skip
        for r, info in zip(replicas, infos, strict=True):  # refused before anything is built
            if info.get("weight_transfer") != backend:
                raise ConfigError(f"{r} takes weight transfer {info.get('weight_transfer')!r}, the run pushes "
                                  f"{backend!r}: start it with --weight-transfer-config '{{\"backend\": "
                                  f"\"{backend}\"}}' (layout.py does, given --vllm_weight_transfer {backend})")
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from trl_ext.serve.plugin import register

        register()
        self.source = PolicySource(model)
        self.clients = [GateClient(r) for r in replicas]
        self.engines = []
        for client, info in zip(self.clients, infos, strict=True):
            world = 1 + int(info["world_size"])
            if backend == "gloo":
                from trl_ext.serve.gloo_engine import GlooTrainerInitInfo

                init = GlooTrainerInitInfo(address, 0, world, timeout_s, rank=rank)
            else:
                from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

                init = NCCLTrainerInitInfo(address, free_port(address) if rank == 0 else 0, world, rank=rank)
            self.engines.append(WeightTransferTrainerFactory.trainer_init(init, client=client, source=self.source))
        self.pushes = 0

    def publish(self, version: int, model: nn.Module) -> None:
        """Policy ``version`` (``model``) into every replica; returns None (no directory: requests wait for it)."""
        self.source.model = model
        for client, engine in zip(self.clients, self.engines, strict=True):
            client.version = version
            engine.send_weights()
        self.pushes += 1

    def close(self) -> None:
        for engine in self.engines:
            engine.shutdown()
