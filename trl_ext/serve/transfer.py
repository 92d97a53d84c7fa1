"""Weights pushed into the policy's servers (``--vllm_weight_transfer nccl|gloo``) with vLLM's weight-transfer backends
(``vllm.distributed.weight_transfer``), instead of a checkpoint each server reloads (``files``).

`WeightPusher` is a ``trl_ext.interfaces.EnginePublisher``, as ``trl_ext.vllm.publish.CheckpointPublisher``: every
trainer process calls its ``publish(version, model)`` (a collective under FSDP2: each tensor is gathered from its
shards, `PolicySource`); process 0 broadcasts the merged weights (``trl_ext.vllm.weights.merged_weights``) to every
worker of every replica through vLLM's trainer-side backend (``WeightTransferTrainerFactory``; the ``gloo`` one is
``trl_ext.serve.gloo_transfer``), one group per replica. The control plane is the version gate's narrow routes
(`GateClient` to ``trl_ext.serve.endpoint``): the server takes the push once no request runs, and answers requests of
that version only after it has loaded every tensor. A push holds one version on the server: at k >= 1 the off-policy
generator (``trl_ext.offpolicy.worker.RolloutWorker.publish``) pushes a version only once no batch still to be
sampled, on any process, needs an older one; otherwise that version goes as a checkpoint.

- One pass per publish, whatever the number of replicas: the round of vLLM's
  ``NCCLTrainerWeightTransferEngine.send_weights`` (``nccl_engine.py``: ``start_weight_update``, then
  ``update_weights`` beside the broadcast, then ``finish_weight_update``) runs for every replica at once, and the
  engine's own ``_broadcast`` sends each tensor (or packed chunk) into every replica's group (`Fanout`). So each
  tensor is gathered and merged once, not once per replica.
- What the servers are told to receive (names, dtypes, shapes: `PolicySource.metadata`) is what a pass yields at
  the first publish, once the trainer has prepared the model (FSDP2 may upcast it), not when the pusher is built;
  taken again if the model is cast later.
- Floating tensors are sent in the servers' dtype (bfloat16 servers get half the bytes of a float32 policy).
- Before sending, the sending process waits for its CUDA stream (`settle`: vLLM's packed producer reads the weights
  on streams of its own).
- Faults end a push within ``timeout_s`` (``--vllm_request_timeout``), with a `ServerError` naming the replica:
  joining a replica's group fails as soon as its ``init`` request fails, else at the deadline; a publish's transfer
  (the ``update`` requests and the broadcast, on threads this process waits on) fails at the first error, else at
  the deadline. Each request of the routes has that timeout too (`Replica`). vLLM's NCCL communicator has none.
"""

from __future__ import annotations

import copy
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import asdict, dataclass
from itertools import chain

import torch
from torch import nn

try:
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
except ImportError:  # without the vLLM extra the module imports (its tests' tables read it); WeightPusher needs vLLM
    WeightSource = object

    @dataclass(frozen=True)
    class ParamMeta:  # vLLM's (vllm/distributed/weight_transfer/base.py)
        name: str
        dtype: torch.dtype
        shape: tuple[int, ...]


from trl_ext import compat
from trl_ext.registry import ConfigError
from trl_ext.serve.client import Replica, ServerError
from trl_ext.serve.endpoint import PUSH_PATH
from trl_ext.vllm.weights import merged_weights


def layout(model: nn.Module) -> list[tuple]:
    """(name, dtype, shape) of every parameter and buffer of ``model``, read without gathering (an FSDP2 shard has
    its whole tensor's dtype and shape): the same on every process."""
    return [(n, t.dtype, tuple(t.shape)) for n, t in chain(model.named_parameters(), model.named_buffers())]


class PolicySource(WeightSource):
    """The policy's merged weights as vLLM's `WeightSource`: iteration is `merged_weights` (a collective under FSDP2).
    `metadata` (what the servers are told to receive; vLLM's ``_checked_iter`` holds every sent tensor to it) comes
    from a pass of `merged_weights` at its first call (the first publish, after the trainer prepared the model), and
    from a new pass whenever the model's `layout` has changed since (a cast). Every process calls it at the same
    point of every publish, and sees the same layout, so the pass is a collective they all join."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None = None) -> None:
        self.model, self.dtype = model, dtype
        self._meta: list | None = None
        self._layout: list | None = None

    def metadata(self) -> list[ParamMeta]:
        now = layout(self.model)
        if self._meta is None or now != self._layout:
            self._meta = [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self._weights()]
            self._layout = now
        return list(self._meta)

    def _weights(self) -> Iterator:
        """`merged_weights`, floating tensors cast to ``dtype`` (the servers' own: a float32 policy is sent to
        bfloat16 servers at half the bytes, as they would cast it on load)."""
        for name, t in merged_weights(self.model):
            yield name, t.to(self.dtype) if self.dtype is not None and t.is_floating_point() else t

    def __iter__(self) -> Iterator:
        return self._weights()


class GateClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over one replica's gate routes (``trl_ext.serve.endpoint``, the API
    key and request timeout of `Replica`); ``version`` is the policy version the next push carries;
    ``init_error``: how the ``init`` request failed (`WeightPusher` stops waiting for the group then)."""

    def __init__(self, replica: Replica) -> None:
        self.replica, self.version = replica, None
        self.init_error: BaseException | None = None

    def _post(self, op: str, body: dict) -> None:
        self.replica._request("POST", PUSH_PATH + op, body, retry=False)  # a push's step is not repeated

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        try:
            self._post("init", {"init_info": init_info})
        except BaseException as e:
            self.init_error = e
            raise

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


def in_thread(fn, *args) -> Future:
    """``fn(*args)`` on a daemon thread (one a hung peer leaves blocked does not hold up the process's exit), on
    this thread's CUDA device."""
    future: Future = Future()
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def run() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            future.set_result(fn(*args))
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=run, daemon=True, name="trl_ext-push").start()
    return future


def settle() -> None:
    """Wait for the work queued on this thread's CUDA stream (the optimizer step that wrote the weights) before a push
    reads them. vLLM's packed NCCL producer (``packed_nccl_broadcast_producer``, ``packed_tensor.py``) pulls the
    source, so merges and packs each tensor, inside ``torch.cuda.stream(...)`` of streams of its own, which do not
    wait for this one; and the push runs on a thread of its own (its own current stream). Once per publish, on the
    sending process; nothing without CUDA."""
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()


def _reraise(replica, e: BaseException):
    """Raise ``e`` (a failure of ``replica``'s step of a push) so that it names the replica."""
    if isinstance(e, ServerError) or replica is None:
        raise e
    raise ServerError(f"{replica}: {type(e).__name__}: {e}") from e


class Fanout:
    """One communicator standing for every replica's group (``groups``: (replica, group) pairs): each broadcast an
    engine makes (vLLM's ``PyNcclCommunicator.broadcast(tensor, src, stream)`` or a gloo group's
    ``broadcast([tensor])``) goes into every group, so one pass over the source feeds every replica."""

    def __init__(self, groups: list[tuple]) -> None:
        self.groups = groups
        self.waiting = None  # the replica whose gloo broadcast this process waits for (`_Works.wait`)

    def broadcast(self, *args, **kwargs):
        works = []
        for replica, group in self.groups:
            try:
                works.append((replica, group.broadcast(*args, **kwargs)))
            except Exception as e:
                _reraise(replica, e)
        return None if all(w is None for _, w in works) else _Works(self, works)


class _Works:
    """The broadcasts of one `Fanout.broadcast` (gloo's ``Work``s): `wait` waits for each."""

    def __init__(self, fanout: Fanout, works: list[tuple]) -> None:
        self.fanout, self.works = fanout, works

    def wait(self) -> bool:
        for replica, work in self.works:
            self.fanout.waiting = replica
            try:
                work.wait()
            except Exception as e:
                _reraise(replica, e)
        self.fanout.waiting = None
        return True


class WeightPusher:
    """Pushes each published version into every replica (module docstring): a ``trl_ext.interfaces.EnginePublisher``
    whose `snapshot` is None (a pushed version is in the servers' weights). ``backend``: ``nccl`` or ``gloo``;
    ``address``: where the replicas reach this run's process 0; ``infos``: each replica's ``/v1/trl_ext/info``;
    ``timeout_s``: the bound of a group's join and of a publish's transfer (``--vllm_request_timeout``)."""

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
        dtypes = {info.get("dtype") for info in infos}
        if len(dtypes) != 1:
            raise ConfigError(f"the policy servers run in different dtypes ({', '.join(map(str, dtypes))}): start "
                              "every replica with one --dtype")
        (name,) = dtypes
        self.source = PolicySource(model, getattr(torch, name) if isinstance(name, str) else None)
        self.timeout_s, self.is_sender = timeout_s, rank == 0
        self.clients = [GateClient(r) for r in replicas]
        self.engines = []
        for client, info in zip(self.clients, infos, strict=True):
            world = 1 + int(info["world_size"])
            if backend == "gloo":
                from trl_ext.serve.gloo_transfer import GlooTrainerInitInfo

                init = GlooTrainerInitInfo(address, 0, world, timeout_s, rank=rank)
            else:
                from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

                init = NCCLTrainerInitInfo(address, free_port(address) if rank == 0 else 0, world, rank=rank)
            self.engines.append(self._join(WeightTransferTrainerFactory.trainer_init, init, client))
        self.sender = copy.copy(self.engines[0])  # its `_broadcast` and packing, into every replica's group
        if self.is_sender:
            self.sender.model_update_group = Fanout([(c.replica, e.model_update_group)
                                                     for c, e in zip(self.clients, self.engines, strict=True)])
        self.pushes = 0

    def _join(self, trainer_init, init, client: GateClient):
        """vLLM's ``trainer_init`` (the replica's ``init`` request on a thread beside this process's join of the
        group: ``nccl_engine.py``) on a thread of its own, given up as soon as the request fails, or at the
        deadline: the group's rendezvous would wait for a server that never joins."""
        joined = in_thread(lambda: trainer_init(init, client=client, source=self.source))
        deadline = time.monotonic() + self.timeout_s
        while not joined.done() and client.init_error is None:
            if time.monotonic() > deadline:
                raise ServerError(f"{client.replica} did not join the {init.backend} weight-transfer group within "
                                  f"{self.timeout_s:g} s (--vllm_request_timeout)")  # fmt: skip
            wait([joined], timeout=0.05)
        if client.init_error is not None:
            _reraise(client.replica, client.init_error)
        try:
            return joined.result()
        except Exception as e:
            raise ServerError(f"{client.replica}: joining the {init.backend} weight-transfer group failed: "
                              f"{type(e).__name__}: {e}") from e  # fmt: skip

    def publish(self, version: int, model: nn.Module) -> None:
        """Policy ``version`` (``model``) into every replica, in one pass (module docstring); returns None (no
        directory: requests wait for it)."""
        self.source.model = model
        meta = self.source.metadata()  # every process, first (a pass at the first publish: a collective)
        if not self.is_sender:  # the other processes take part in the gathers only (as in vLLM's send_weights)
            compat.send_weights(self.sender, self.source, meta)
            self.pushes += 1
            return
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

        info = asdict(NCCLWeightTransferUpdateInfo(names=[m.name for m in meta],
                                                   dtype_names=[str(m.dtype).split(".")[-1] for m in meta],
                                                   shapes=[list(m.shape) for m in meta]))  # fmt: skip
        settle()
        for client in self.clients:
            client.version = version
            client.start_weight_update()

        def send() -> None:
            compat.send_weights(self.sender, self.source, meta)

        updates = {in_thread(c.update_weights, info): c.replica for c in self.clients}  # each waits for its tensors
        sending = in_thread(send)
        done, pending = wait([*updates, sending], timeout=self.timeout_s, return_when=FIRST_EXCEPTION)
        for future in [*updates, sending]:  # a server's own error first: it says why the broadcast stalled
            if future in done and future.exception() is not None:
                _reraise(updates.get(future), future.exception())
        if pending:  # the replica the broadcast waits for (gloo), else those whose update has not returned
            stuck = getattr(self.sender.model_update_group, "waiting", None)
            late = [stuck] if stuck is not None else [updates[f] for f in updates if f in pending]
            late = ", ".join(map(str, late or [c.replica for c in self.clients]))
            raise ServerError(f"{late} did not take version {version} within {self.timeout_s:g} s "
                              "(--vllm_request_timeout): the push is abandoned")  # fmt: skip
        for client in self.clients:
            client.finish_weight_update()
        self.pushes += 1

    def snapshot(self, version: int) -> None:
        """Nothing to stage for a pushed ``version``: the servers hold it once `publish` returns."""
        return None

    def close(self) -> None:
        for engine in self.engines:
            engine.shutdown()
