"""trl_ext.offpolicy.worker with a pusher (``--vllm_weight_transfer nccl|gloo`` at k >= 1): versions pushed into an
engine's servers when no batch still to be sampled needs an older one, a checkpoint otherwise. The servers here hold
one model, as a vLLM server does (`OneModelServer`); the stand-in trainer is test_offpolicy.drive's."""

import json
import sys
import threading
from pathlib import Path

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


def drive_pushed(k, strict, steps, on_step=None, around_publish=None, agree=bool, made=None):
    """test_offpolicy.drive with the worker's model None, its sampler over `OneModelServer` and a `Pusher`;
    ``made`` (a dict, if given) receives the ``server`` and the ``worker`` as they are built."""
    made = {} if made is None else made

    def worker_fn(model):
        made["server"] = server = OneModelServer(model)
        made["worker"] = worker = RolloutWorker(server, PolicyStore(), params(),
                                                WorkerConfig(k, strict, start_step=0, seed=0), on_step=on_step,
                                                pusher=Pusher(server), agree=agree)  # fmt: skip
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


def agreement_driver(out: Path) -> None:
    """One of 2 processes (``torchrun --nproc_per_node 2 tests/test_offpolicy_push.py OUT``, gloo): ``agree`` is
    train.py's, ``OffPolicy._every_process`` (an all-reduce over the processes) on a real accelerate ``Accelerator``.
    First the function alone on every pair of local decisions; then a pushed strict k = 2 run on each process where,
    at policy 1's publish, process 0's generator has sampled every batch of policy 0 (it may push) while process
    1's is held back before its batch 2, policy 0's (it may not). Writes ``rank{r}.json``."""
    from types import SimpleNamespace

    from accelerate import Accelerator

    from trl_ext.launch.processes import end_processes
    from trl_ext.offpolicy.component import OffPolicy

    acc = Accelerator(cpu=True)  # as train.py on a machine without CUDA (trl_ext.launch.processes: gloo)
    rank = acc.process_index
    assert acc.num_processes == 2
    component = SimpleNamespace(trainer=SimpleNamespace(accelerator=acc))  # what _every_process reads of the component

    def agree(ok: bool) -> bool:
        return OffPolicy._every_process(component, ok)

    answers = {f"{a}-{b}": agree((a, b)[rank]) for a in (False, True) for b in (False, True)}
    made = {}
    if rank == 1:
        on_step, around_publish = batch_2_after_policy_1()  # its batch 2 waits for policy 1's publish
    else:
        on_step = None

        def around_publish(version, phase):  # every batch of policy 0 (0, 1, 2) sampled: this process may push 1
            if version == 1 and phase == "before":
                gate = made["worker"].gate
                for _ in range(1000):
                    if gate.next_index >= 3:
                        break
                    threading.Event().wait(0.01)
                assert gate.next_index >= 3, gate.next_index

    rollouts, weights, server = drive_pushed(2, True, 5, on_step=on_step, around_publish=around_publish, agree=agree,
                                             made=made)  # fmt: skip
    try:
        assert_exact(rollouts, weights, 2)
        exact = True
    except AssertionError:
        exact = False
    (out / f"rank{rank}.json").write_text(json.dumps({"answers": answers, "pushes": server.pushes,
                                                      "loads": server.loads, "exact": exact}))  # fmt: skip
    end_processes()


def test_two_processes_push_a_version_only_when_both_may(tmp_path):
    """Claim (docs/offpolicy.md, docs/layout.md): a version is pushed into the servers only when every trainer
    process may push it. On 2 real processes (gloo) ``OffPolicy._every_process``, the agreement train.py's worker
    calls, answers True on both only when both say True (an all-reduce MIN: with one process saying False, both get
    False). In a pushed strict k = 2 run where at policy 1's publish process 0 may push and process 1's generator
    still owes a batch of policy 0, policy 1 goes as a checkpoint on both processes, pushed on neither; every batch is
    still exact on both. A MAX in the agreement (sabotage row ``push_agreement_all_reduce_min``) or a worker deciding
    alone (``push_agreed_by_every_process``) pushes policy 1 from process 0."""
    from test_procs import torchrun

    proc = torchrun([str(Path(__file__).resolve()), str(tmp_path)], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        both = {"False-False": False, "False-True": False, "True-False": False, "True-True": True}  # process 0-1
        assert r["answers"] == both, ranks
        assert 1 not in r["pushes"] and 1 in r["loads"], ranks
        assert r["exact"], ranks
    assert ranks[0]["pushes"][0] == 0 and ranks[1]["pushes"][0] == 0  # the start policy was pushed on both: they push


if __name__ == "__main__":
    agreement_driver(Path(sys.argv[1]))
