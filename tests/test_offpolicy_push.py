"""trl_ext.offpolicy.worker with a pusher (``--vllm_weight_transfer nccl|gloo`` at k >= 1): versions pushed into an
engine's servers when no batch still to be sampled needs an older one, a checkpoint otherwise. The servers here hold
one model, as a vLLM server does (`OneModelServer`); the stand-in trainer is test_offpolicy.drive's."""

import pytest
import torch

from test_offpolicy import batch_2_after_policy_1, drive, params, publish_at_third_token, scored_under
from trl_ext.generation.backends import make_sampler
from trl_ext.offpolicy.worker import PolicyStore, RolloutWorker, WorkerConfig, generation_copy


class OneModelServer:
    """An engine's sampler over servers that hold one model (a ``trl_ext.interfaces.VersionedSampler``): a
    checkpoint is loaded when its version is staged, a pushed version (staged without one) is already in the model.
    ``pushes``/``loads``: the versions each way."""

    loads_versions = True

    def __init__(self, model) -> None:
        self.model = generation_copy(model)
        self.sampler = make_sampler("fast", self.model)
        self.pushes, self.loads = [], []

    def stage(self, version, snapshot) -> None:
        if snapshot is None:
            assert version == self.pushes[-1], (version, self.pushes)  # only the newest push is held
            return
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(snapshot[name])
        self.loads.append(version)

    def sample(self, *args, **kwargs):
        return self.sampler.sample(*args, **kwargs)


class Pusher:
    def __init__(self, server: OneModelServer) -> None:
        self.server = server

    def publish(self, version, model) -> None:
        with torch.no_grad():
            for (name, p), (_, q) in zip(self.server.model.named_parameters(), model.named_parameters(), strict=True):
                p.copy_(q)
        self.server.pushes.append(version)


def drive_pushed(k, strict, steps, on_step=None, around_publish=None, agree=bool):
    """test_offpolicy.drive with the worker's model None, its sampler over `OneModelServer` and a `Pusher`."""
    made = {}

    def worker_fn(model):
        made["server"] = server = OneModelServer(model)
        worker = RolloutWorker(server, PolicyStore(), params(), WorkerConfig(k, strict, start_step=0, seed=0),
                               on_step=on_step, pusher=Pusher(server), agree=agree)  # fmt: skip
        worker.publish(0, model)  # the starting policy, as the trainer pushes it
        return worker

    rollouts, weights = drive(k, strict, 0, steps, around_publish=around_publish, worker_fn=worker_fn)
    return rollouts, weights, made["server"]


def assert_exact(rollouts, weights, k):
    """Every token's version within the lag bound; a row of one version sampled by exactly that policy."""
    for n, r in enumerate(rollouts):
        for seq in r.versions:
            assert max(n - k, 0) <= min(seq) and max(seq) <= n
        rows = [i for i, seq in enumerate(r.versions) if len(set(seq)) == 1]
        for v in {r.versions[i][0] for i in rows}:
            ref = scored_under(weights[v], r)
            same = [i for i in rows if r.versions[i][0] == v]
            assert max(abs(a - b) for i in same for a, b in zip(r.logprobs[i], ref[i], strict=True)) < 1e-5


@pytest.mark.parametrize("k, strict", [(1, True), (1, False), (3, False)])
def test_every_version_pushed_none_as_a_checkpoint(k, strict):
    """Strict k = 1 and in flight at any k: every version is pushed (after the batch or decoding step in progress),
    no checkpoint is made, and every batch is sampled by the policies it is stamped with."""
    rollouts, weights, server = drive_pushed(k, strict, 6)
    assert server.pushes == list(range(7)) and server.loads == []
    if strict:
        assert all(seq == [max(n - k, 0)] * len(seq) for n, r in enumerate(rollouts) for seq in r.versions)
    assert_exact(rollouts, weights, k)


def test_in_flight_push_lands_between_decoding_steps():
    """In flight: policy 1 is pushed while batch 1 is at its 3rd token; the generator takes it before the 4th."""
    on_step, around_publish = publish_at_third_token()
    rollouts, weights, server = drive_pushed(1, False, 3, on_step=on_step, around_publish=around_publish)
    long = [v for v in rollouts[1].versions if len(v) > 3]
    assert long and all(v == [0, 0, 0] + [1] * (len(v) - 3) for v in long)
    ref0 = scored_under(weights[0], rollouts[1])
    for lp, rf in zip(rollouts[1].logprobs, ref0, strict=True):
        assert max(abs(a - b) for a, b in zip(lp[:3], rf[:3], strict=True)) < 1e-5


def test_strict_generator_behind_gets_a_checkpoint():
    """Strict k = 2 with batch 2 (policy 0's) held back until policy 1 is published: the servers still need policy 0,
    so policy 1 goes as a checkpoint, loaded for batch 3; every batch is sampled by exactly its policy."""
    on_step, around_publish = batch_2_after_policy_1()
    rollouts, weights, server = drive_pushed(2, True, 5, on_step=on_step, around_publish=around_publish)
    assert 1 in server.loads and 1 not in server.pushes
    assert all(seq == [max(n - 2, 0)] * len(seq) for n, r in enumerate(rollouts) for seq in r.versions)
    assert_exact(rollouts, weights, 2)


def test_a_process_that_cannot_push_makes_every_version_a_checkpoint():
    """Another process's generator always needs an older policy (``agree`` is false): every version goes as a
    checkpoint, on this process too, and every batch is still exact."""
    rollouts, weights, server = drive_pushed(1, True, 4, agree=lambda ok: False)
    assert server.pushes == [] and server.loads[:3] == [0, 1, 2]  # (batch 4, sampled ahead, may load 3)
    assert_exact(rollouts, weights, 1)
