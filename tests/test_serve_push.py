"""``--vllm_weight_transfer`` without a server (``trl_ext.serve.transfer``): what a push is told to send, its CUDA
synchronisation, and, in the vLLM tier (vLLM's engines imported, no server started: cheap), the gloo push into
stand-in servers that join the trainer's groups in this process (`FakeServer`): one pass per publish whatever the
number of replicas, dtypes cast after the pusher was built, and faults that end a push within its timeout, naming
the server."""

from __future__ import annotations

import datetime
import threading
import time
from unittest import mock

import pytest
import torch
from torch import nn

from trl_ext.serve import transfer
from trl_ext.serve.client import Replica, ServerError
from trl_ext.serve.endpoint import PUSH_PATH


def small_model(seed=0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def described(pairs) -> list[tuple]:
    return [(name, t.dtype, tuple(t.shape)) for name, t in pairs]


def test_metadata_is_taken_from_what_the_first_publish_sends():
    """The trainer may cast the model after the pusher is built (FSDP2's prepare upcasts it under mixed precision):
    the metadata the servers are told is what a pass yields at the first publish, and is taken again (a pass on every
    process) only when the model's dtypes or shapes change."""
    model = small_model()
    source = transfer.PolicySource(model)
    model.to(torch.float64)
    passes = []

    def merged(m):
        passes.append(1)
        return iter(list(m.state_dict().items()))

    with mock.patch.object(transfer, "merged_weights", merged):
        meta = source.metadata()
        assert [(m.name, m.dtype, m.shape) for m in meta] == described(model.state_dict().items())
        assert {m.dtype for m in meta} == {torch.float64}
        assert source.metadata() == meta and len(passes) == 1  # taken once while the model keeps its layout
        model.to(torch.bfloat16)
        assert {m.dtype for m in source.metadata()} == {torch.bfloat16} and len(passes) == 2


def test_floating_tensors_are_sent_in_the_servers_dtype():
    """A float32 policy pushed into bfloat16 servers (layout.py's default on CUDA) is sent, and announced, in bfloat16:
    half the bytes, the values the server would have cast on load; integer buffers keep their dtype."""
    model = small_model()
    model.register_buffer("steps", torch.arange(3))
    source = transfer.PolicySource(model, torch.bfloat16)
    sent = list(source)
    assert {t.dtype for name, t in sent if name != "steps"} == {torch.bfloat16}
    assert dict(sent)["steps"].dtype == torch.int64
    assert [m.dtype for m in source.metadata()] == [t.dtype for _, t in sent]
    assert torch.equal(dict(sent)["0.weight"], model[0].weight.detach().to(torch.bfloat16))
    assert {t.dtype for _, t in transfer.PolicySource(model)} == {torch.float32, torch.int64}


def test_a_push_waits_for_the_cuda_stream_once_before_sending():
    """`transfer.settle` guards vLLM's packed NCCL producer, which reads (merges and packs) the source on streams of
    its own that do not wait for the optimizer step queued on the trainer's stream: with CUDA, the current stream is
    synchronised; without, nothing is called."""
    stream = mock.Mock()
    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.current_stream", return_value=stream):  # fmt: skip
        transfer.settle()
    stream.synchronize.assert_called_once_with()
    with mock.patch("torch.cuda.is_available", return_value=False), \
            mock.patch("torch.cuda.current_stream", return_value=stream):  # fmt: skip
        transfer.settle()
    assert stream.synchronize.call_count == 1


def test_fanout_sends_each_broadcast_into_every_replica_group():
    """`transfer.Fanout` stands for the groups of every replica in the engine's own ``_broadcast``: vLLM's
    ``PyNcclCommunicator.broadcast(tensor, src, stream)`` (enqueued, nothing returned) and a gloo group's
    ``broadcast([tensor])`` (a work to wait for) go into each group in turn; a failed one names its replica."""

    class Group:
        def __init__(self, work=None):
            self.calls, self.work = [], work

        def broadcast(self, *args, **kwargs):
            self.calls.append((args, kwargs))
            return self.work

    t = torch.ones(2)
    nccl = [Group(), Group()]
    assert transfer.Fanout(list(zip(URLS, nccl, strict=True))).broadcast(t, src=0, stream="s") is None
    assert [g.calls for g in nccl] == [[((t,), {"src": 0, "stream": "s"})]] * 2
    works = [mock.Mock(), mock.Mock()]
    works[1].wait.side_effect = RuntimeError("Timed out waiting 3000ms for send operation to complete")
    fanout = transfer.Fanout([(Replica(u), Group(w)) for u, w in zip(URLS, works, strict=True)])
    with pytest.raises(ServerError, match=f"{URLS[1]}: RuntimeError: Timed out"):
        fanout.broadcast([t]).wait()
    works[0].wait.assert_called_once_with()
    assert str(fanout.waiting) == f"vLLM server {URLS[1]}"  # what a push that times out names


# ---------------------------------------------------------------- the gloo push into stand-in servers (vLLM tier)
class FakeServer(transfer.GateClient):
    """A replica's gate routes and its one worker, in this process, as the server runs them
    (``trl_ext.serve.endpoint._push`` over ``trl_ext.serve.gloo_transfer.GlooWeightTransferEngine``): ``init`` joins
    the trainer's gloo group, ``update`` receives every announced tensor. ``MODES[url]`` breaks one: ``init_fails``
    (the init request fails at once, the worker never joins), ``init_stall`` (the init request never answers, the
    worker never joins), ``update_fails`` (the update request fails at once), ``stall`` (the update request never
    answers, the worker never receives)."""

    MODES: dict = {}
    made: list = []
    release = threading.Event()  # ends the stalled requests at the test's end

    def __init__(self, replica: Replica) -> None:
        super().__init__(replica)
        self.mode, self.received, self.finished = self.MODES.get(replica.url), {}, []
        self.made.append(self)

    def _post(self, op: str, body: dict) -> None:
        from torch.distributed import TCPStore

        from trl_ext.serve.gloo_transfer import gloo_group

        if self.mode == f"{op}_fails":
            raise ServerError(f"{self.replica} answered {PUSH_PATH}{op} with 500: {op} broke")
        if op == "init":
            if self.mode == "init_stall":
                self.release.wait(60)
                raise ServerError(f"{self.replica} did not answer {PUSH_PATH}init")
            info = body["init_info"]
            timeout = datetime.timedelta(seconds=info["timeout_s"])
            store = TCPStore(info["master_address"], info["master_port"], info["world_size"], False, timeout=timeout)
            self.group = gloo_group(store, info["rank_offset"], info["world_size"], info["timeout_s"])
        elif op == "update":
            if self.mode == "stall":
                self.release.wait(60)
                return
            update = body["update_info"]
            for name, dtype, shape in zip(update["names"], update["dtype_names"], update["shapes"], strict=True):
                weight = torch.empty(shape, dtype=getattr(torch, dtype))
                self.group.broadcast([weight]).wait()
                self.received[name] = weight
        elif op == "finish":
            self.finished.append(body["version"])


URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


@pytest.fixture
def servers(monkeypatch):
    """``make(model, timeout_s, modes)``: a gloo `WeightPusher` (process 0) of ``model`` into 2 `FakeServer`s."""
    pytest.importorskip("vllm")
    monkeypatch.setattr(transfer, "GateClient", FakeServer)
    monkeypatch.setattr(FakeServer, "made", [])
    FakeServer.release.clear()

    def make(model, timeout_s=20.0, modes=None):
        monkeypatch.setattr(FakeServer, "MODES", dict(modes or {}))
        infos = [{"weight_transfer": "gloo", "world_size": 1}] * len(URLS)
        return transfer.WeightPusher([Replica(u) for u in URLS], infos, "gloo", model, 0, "127.0.0.1", timeout_s)

    yield make
    FakeServer.release.set()


def assert_received(model: nn.Module) -> None:
    for server in FakeServer.made:
        assert described(server.received.items()) == described(model.state_dict().items())
        for name, t in model.state_dict().items():
            assert torch.equal(server.received[name], t), name


@pytest.mark.vllm
def test_one_pass_per_publish_into_every_replica(servers, monkeypatch):
    """Each publish gathers and merges every tensor once (one pass over the source) and sends it into every
    replica's group: 2 replicas, one pass (the first publish takes the metadata with one more). The CUDA stream is
    settled before the pass."""
    model = small_model()
    pusher = servers(model)
    log = []
    merged = transfer.merged_weights

    def counted(m):
        log.append("pass")
        return merged(m)

    monkeypatch.setattr(transfer, "merged_weights", counted)
    monkeypatch.setattr(transfer, "settle", lambda: log.append("settle"), raising=False)
    pusher.publish(1, model)
    assert_received(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    log.clear()
    pusher.publish(2, model)
    assert log == ["settle", "pass"], log
    assert_received(model)
    assert [s.finished for s in FakeServer.made] == [[1, 2], [1, 2]]
    pusher.close()


@pytest.mark.vllm
def test_a_cast_after_the_pusher_is_built_pushes_the_new_dtypes(servers):
    """The pusher is built before the trainer casts the model (FSDP2's prepare under mixed precision): the first
    push sends, and announces, the cast dtypes; a later cast is announced again."""
    model = small_model()
    pusher = servers(model)
    model.to(torch.float64)
    pusher.publish(1, model)
    assert_received(model)
    model.to(torch.bfloat16)
    pusher.publish(2, model)
    assert_received(model)
    pusher.close()


@pytest.mark.vllm
@pytest.mark.parametrize("mode, timeout_s, bound, match", [
    ("init_fails", 20.0, 5.0, f"{URLS[1]} answered {PUSH_PATH}init with 500"),
    ("init_stall", 3.0, 6.0, f"{URLS[1]} did not join the gloo weight-transfer group within 3 s"),
], ids=["init_fails", "init_stall"])  # fmt: skip
def test_a_failed_or_stalled_init_ends_the_join_naming_the_server(servers, mode, timeout_s, bound, match):
    """A server that answers the init with an error never joins the group: the trainer stops waiting in the group's
    rendezvous at once (not after its 20 s timeout) with the server's error. One that never answers it ends the join
    after ``timeout_s``, named."""
    start = time.monotonic()
    with pytest.raises(ServerError, match=match):
        servers(small_model(), timeout_s, {URLS[1]: mode})
    assert time.monotonic() - start < bound


@pytest.mark.vllm
@pytest.mark.parametrize("mode, timeout_s, bound", [("stall", 3.0, 6.0), ("update_fails", 20.0, 5.0)])
def test_a_failed_or_stalled_server_ends_the_publish_naming_it(servers, mode, timeout_s, bound):
    """A server whose update stalls (its worker never receives) ends the publish after ``timeout_s``
    (``--vllm_request_timeout``); one whose update fails ends it at once. Either way the error names that server, not
    the healthy one."""
    pusher = servers(small_model(), timeout_s, {URLS[1]: mode})
    start = time.monotonic()
    with pytest.raises(ServerError, match=URLS[1]) as error:
        pusher.publish(1, small_model())
    assert time.monotonic() - start < bound
    assert URLS[0] not in str(error.value)
