"""trl_ext.offpolicy.worker on tiny random Llamas: the sampler's behaviour log-probs, the generator copy, the weight store and
the generator thread's schedule (strict, non-strict with in-flight updates, resume), with no trainer involved."""

import math
import threading

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from trl.trainer.utils import add_fused_lm_head

from reference import trainer_logprobs

from trl_ext.generation.backends import make_sampler
from trl_ext.interfaces import SamplingParams
from trl_ext.offpolicy.worker import (
    PolicyStore,
    RolloutWorker,
    WorkerConfig,
    generation_copy,
    restrict_logits,
    sample,
)

VOCAB, EOS = 64, 1


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=EOS, pad_token_id=EOS)  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def params(**over):
    base = dict(max_new_tokens=10, temperature=1.0, top_k=0, top_p=1.0, eos_token_ids=(EOS,), pad_token_id=EOS)
    return SamplingParams(**{**base, **over})


PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]


def perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))


# ---------------------------------------------------------------- sampling


def test_restrict_logits_by_hand():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    inf = -math.inf
    assert restrict_logits(logits, 2, 1.0).tolist() == [[inf, inf, logits[0, 2].item(), logits[0, 3].item()]]
    # top_p 0.6: ascending cumulative [0.1, 0.3, 0.6, 1.0]; drop where <= 0.4 -> the 0.1 and 0.2 tokens
    assert torch.isinf(restrict_logits(logits, 0, 0.6)).tolist() == [[True, True, False, False]]
    # top_p 0.75: drop where <= 0.25 -> only the 0.1 token
    assert torch.isinf(restrict_logits(logits, 0, 0.75)).tolist() == [[True, False, False, False]]
    # top_p tiny: the most likely token always stays
    assert torch.isinf(restrict_logits(logits, 0, 1e-6)).tolist() == [[True, True, True, False]]
    assert torch.equal(restrict_logits(logits, 0, 1.0), logits) and torch.equal(restrict_logits(logits, 4, 1.0), logits)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8)])
def test_behaviour_logprobs_are_raw_tempered_logprobs(temperature, top_k, top_p):
    model = tiny_model()
    rng = torch.Generator().manual_seed(1)
    out = sample(model, PROMPTS, params(temperature=temperature, top_k=top_k, top_p=top_p), rng)
    ref, all_lp = trainer_logprobs(model, PROMPTS, out.completion_ids, temperature, full=True)
    for i, (lp, r) in enumerate(zip(out.logprobs, ref, strict=True)):
        assert len(lp) == len(r) >= 1
        assert max(abs(a - b) for a, b in zip(lp, r, strict=True)) < 1e-5
        if top_k:  # sampled among the top_k only, yet scored by the full tempered softmax
            kth = all_lp[i, : len(lp)].topk(top_k, dim=-1).values[:, -1]
            assert all(a >= b - 1e-6 for a, b in zip(lp, kth.tolist(), strict=True))
            assert all(a < 0 for a in lp)
    assert all(v == [0] * len(c) for v, c in zip(out.versions, out.completion_ids, strict=True))


def test_eos_stops_each_sequence_and_max_new_tokens_caps():
    eos = tuple(range(0, 40))  # most tokens end a sequence
    rng = torch.Generator().manual_seed(0)
    out = sample(tiny_model(), PROMPTS * 4, params(eos_token_ids=eos, max_new_tokens=6), rng)
    for ids in out.completion_ids:
        assert 1 <= len(ids) <= 6
        assert all(t not in eos for t in ids[:-1])
        assert ids[-1] in eos or len(ids) == 6
    assert any(len(ids) < 6 for ids in out.completion_ids) and any(len(ids) > 1 for ids in out.completion_ids)


def test_same_seed_same_sample_and_versions_from_hook():
    model = tiny_model()
    a = sample(model, PROMPTS, params(), torch.Generator().manual_seed(3))
    b = sample(model, PROMPTS, params(), torch.Generator().manual_seed(3), before_step=lambda t: 7 + (t >= 2))
    assert a.completion_ids == b.completion_ids and a.logprobs == b.logprobs
    assert all(v == [7, 7, 8, 8, 8, 8, 8, 8, 8, 8][: len(v)] for v in b.versions)


def test_sampling_params_validation():
    for bad in ({"temperature": 0.0}, {"max_new_tokens": 0}, {"top_p": 0.0}, {"top_k": -1}, {"eos_token_ids": ()}):
        with pytest.raises(ValueError):
            params(**bad)


# ---------------------------------------------------------------- copy and store


def test_generation_copy_runs_its_own_weights_despite_trl_patch():
    model = tiny_model()
    add_fused_lm_head(model)  # instance-level forward closing over `model`, as GRPOTrainer installs it
    clone = generation_copy(model)
    assert "forward" not in clone.__dict__ and not any(p.requires_grad for p in clone.parameters())
    perturb(clone, 0)
    ids = torch.tensor([[5, 6, 7]])
    fresh = tiny_model()
    fresh.load_state_dict(clone.state_dict())
    with torch.no_grad():
        assert torch.equal(clone(input_ids=ids).logits, fresh(input_ids=ids).logits)
        assert not torch.allclose(clone(input_ids=ids).logits, model(input_ids=ids).logits)


def test_generation_copy_refuses_unknown_forward_patch():
    model = tiny_model()
    model.model.forward = lambda *a, **k: None
    with pytest.raises(ValueError, match="patched"):
        generation_copy(model)


def test_policy_store_order_take_and_close():
    model, store = tiny_model(), PolicyStore()
    store.publish(2, model)
    with pytest.raises(ValueError, match="after version 2"):
        store.publish(2, model)
    store.publish(3, model)
    store.publish(4, model)
    assert store.latest == 4 and store.wait(3) == 4
    store.take(3)
    assert store.held_versions() == [4]  # the taken snapshot and every older one are dropped
    with pytest.raises(RuntimeError, match="not available"):
        store.take(2)
    waiter = {}
    t = threading.Thread(target=lambda: waiter.setdefault("r", _catch(lambda: store.wait(9))))
    t.start()
    store.close()
    t.join(5)
    assert type(waiter["r"]).__name__ == "Closed"


def _catch(fn):
    try:
        return fn()
    except Exception as e:
        return e


# ---------------------------------------------------------------- generator thread


def drive(k, strict, start, steps, on_step=None, around_publish=None, backend="fast", worker_fn=None):
    """A stand-in trainer: submit prompts k ahead, take batch n, 'train' (perturb), publish n + 1. ``worker_fn(model)``
    builds the worker (default: over a generation copy of ``model``).

    Returns the rollouts and the weights of every version, to re-score each batch under the policy it claims."""
    model = tiny_model()
    weights = {start: {n: p.clone() for n, p in model.state_dict().items()}}
    if worker_fn is None:
        worker = RolloutWorker(make_sampler(backend, generation_copy(model)), PolicyStore(), params(),
                               WorkerConfig(k, strict, start_step=start, seed=0), on_step=on_step)  # fmt: skip
    else:
        worker = worker_fn(model)
    worker.start()
    rollouts, submitted = [], start - 1
    try:
        for n in range(start, start + steps):
            while submitted < n + k:
                submitted += 1
                worker.submit(submitted, [{"prompt": str(submitted)}] * len(PROMPTS), PROMPTS)
            rollouts.append(worker.get(n))
            perturb(model, n)
            weights[n + 1] = {name: p.clone() for name, p in model.state_dict().items()}
            if around_publish is not None:
                around_publish(n + 1, "before")
            worker.publish(n + 1, model)
            if around_publish is not None:
                around_publish(n + 1, "after")
    finally:
        worker.stop()
    return rollouts, weights


def scored_under(weights, rollout, temperature=1.0):
    model = tiny_model()
    model.load_state_dict(weights)
    return trainer_logprobs(model, rollout.prompt_ids, rollout.completion_ids, temperature)


@pytest.mark.parametrize("backend", ["fast", "trl"])
@pytest.mark.parametrize("k, start", [(1, 0), (4, 0), (2, 3)])
def test_strict_schedule_versions_and_weights(k, start, backend):
    rollouts, weights = drive(k, True, start, 7, backend=backend)
    for n, r in zip(range(start, start + 7), rollouts, strict=True):
        v = max(n - k, start)
        assert r.index == n and r.rows[0]["prompt"] == str(n)
        assert all(seq == [v] * len(seq) for seq in r.versions)
        ref = scored_under(weights[v], r)  # sampled by exactly those weights
        diffs = [abs(a - b) for lp, rf in zip(r.logprobs, ref, strict=True) for a, b in zip(lp, rf, strict=True)]
        assert max(diffs) < 1e-5


def count_snapshots(monkeypatch) -> list[int]:
    """The versions the store keeps as snapshots (every other publish is written into the generator's copy)."""
    kept, publish = [], PolicyStore.publish

    def recorded(self, version, model):
        kept.append(version)
        publish(self, version, model)

    monkeypatch.setattr(PolicyStore, "publish", recorded)
    return kept


@pytest.mark.parametrize("k, strict", [(1, True), (1, False), (3, False)])
def test_publish_writes_into_the_copy_without_a_snapshot(k, strict, monkeypatch):
    """Strict k = 1 and in flight at any k: every publish goes straight into the generator's copy (after the batch
    or decoding step it is in), so no snapshot of the weights is ever held beside the copy; each batch is still
    sampled by exactly the policies it is stamped with."""
    kept = count_snapshots(monkeypatch)
    rollouts, weights = drive(k, strict, 0, 6)
    assert kept == []
    for n, r in enumerate(rollouts):
        for seq, lp in zip(r.versions, r.logprobs, strict=True):
            assert max(n - k, 0) <= min(seq) and max(seq) <= n
        if strict or all(len(set(seq)) == 1 for seq in r.versions):
            v = r.versions[0][0]
            ref = scored_under(weights[v], r)
            assert max(abs(a - b) for lp, rf in zip(r.logprobs, ref) for a, b in zip(lp, rf)) < 1e-5


def batch_2_after_policy_1():
    """``(on_step, around_publish)`` for `drive`: batch 2 starts only once policy 1 is published."""
    published = threading.Event()

    def on_step(index, t):
        if index == 2 and t == 0:
            assert published.wait(10)

    def around_publish(version, phase):
        if version == 1 and phase == "after":
            published.set()

    return on_step, around_publish


def test_strict_generator_behind_keeps_a_snapshot(monkeypatch):
    """Strict k = 2 with batch 2 (policy 0's) held back until policy 1 is published: the copy still needs policy 0,
    so policy 1 is kept as a snapshot, and batch 3 is sampled by exactly policy 1."""
    kept = count_snapshots(monkeypatch)
    on_step, around_publish = batch_2_after_policy_1()
    rollouts, weights = drive(2, True, 0, 5, on_step=on_step, around_publish=around_publish)
    assert 1 in kept
    for n, r in enumerate(rollouts):
        v = max(n - 2, 0)
        assert all(seq == [v] * len(seq) for seq in r.versions)
        ref = scored_under(weights[v], r)
        assert max(abs(a - b) for lp, rf in zip(r.logprobs, ref) for a, b in zip(lp, rf)) < 1e-5


def wait_until(condition, seconds=10.0) -> bool:
    for _ in range(int(seconds / 0.01)):
        if condition():
            return True
        threading.Event().wait(0.01)
    return condition()


def exact_under(weights, rollout, version) -> bool:
    """Every token of ``rollout`` stamped ``version`` and sampled by exactly ``weights`` (its log-probs to 1e-5)."""
    ref = scored_under(weights, rollout)
    same = all(seq == [version] * len(seq) for seq in rollout.versions)
    return same and max(abs(a - b) for lp, rf in zip(rollout.logprobs, ref) for a, b in zip(lp, rf)) < 1e-5


def test_strict_publish_before_the_next_batch_is_submitted_keeps_a_snapshot(monkeypatch):
    """Claim (trl_ext/offpolicy/gate.py ``write_decision``, docs/offpolicy.md Publishing): at strict k = 1 a publish
    waits for the batch the trainer takes next (the last of the older policy) only when that batch is submitted; when
    the generator has sampled every submitted batch and the next is not submitted yet, the publish neither waits
    (the publishing thread is the one that would submit it: it would wait forever) nor writes over the policy that
    batch needs: the version is kept as a snapshot. Through `RolloutWorker.publish` with its real gate, job queue and
    generator thread: policy 1 is published while batch 1 is unsubmitted; the publish returns at once with policy 1
    as the store's snapshot; batch 1, submitted after, is sampled by exactly policy 0, and batch 2 by exactly policy 1
    (loaded from the snapshot). With the gate counting every batch as submitted (sabotage row
    ``strict_publish_unsubmitted_batch``) the publish waits for ever (stopped here after 10 s); with the publish
    writing at once (``publish_waits_for_older_batches``) batch 1's policy is gone."""
    kept = count_snapshots(monkeypatch)
    model = tiny_model()
    weights = {0: {n: p.clone() for n, p in model.state_dict().items()}}
    worker = RolloutWorker(make_sampler("fast", generation_copy(model)), PolicyStore(), params(),
                           WorkerConfig(1, True, start_step=0, seed=0))  # fmt: skip
    worker.start()
    try:
        worker.submit(0, [{}] * len(PROMPTS), PROMPTS)
        r0 = worker.get(0)
        assert wait_until(lambda: worker.gate.next_index == 1 and not worker.gate.busy)  # waiting for batch 1's job
        assert not worker.jobs.has(1)
        perturb(model, 0)
        weights[1] = {n: p.clone() for n, p in model.state_dict().items()}
        publish = threading.Thread(target=worker.publish, args=(1, model), daemon=True)
        publish.start()
        publish.join(10)
        hung = publish.is_alive()
        if hung:
            worker.stop()  # a stopped generator lets the waiting publish write: the thread ends
            publish.join(10)
        assert not hung, "the publish waited for a batch nobody had submitted"
        assert kept == [1] and worker.store.held_versions() == [1]
        for index in (1, 2):
            worker.submit(index, [{}] * len(PROMPTS), PROMPTS)
        r1 = worker.get(1)
        r2 = worker.get(2)
    finally:
        worker.stop()
    assert exact_under(weights[0], r0, 0) and exact_under(weights[0], r1, 0) and exact_under(weights[1], r2, 1)


def test_a_write_that_fails_midway_records_no_version():
    """Claim (``RolloutWorker.publish``, docs/offpolicy.md Publishing): a publish writes the version straight into
    the generator's copy, one parameter at a time, and records the version only once the write is complete; a write
    that raises midway records none, so the generator never samples a half-written copy under a version number.
    Through `RolloutWorker.publish` at strict k = 1: the trainer's model carries a trainable parameter unknown to the
    generator's copy, after the first layer, so the copy's own check raises with the embedding and layer 0 written
    and the rest not. The publish raises; the copy holds policy 0 as its version, the store records none newer, and
    batch 2 (policy 1's) is not sampled. With the failed write recorded (sabotage row
    ``failed_write_records_no_version``) the copy and the store say policy 1, and batch 2 would be sampled from the
    half-written copy, stamped policy 1."""
    model = tiny_model()
    copy = generation_copy(model)
    worker = RolloutWorker(make_sampler("fast", copy), PolicyStore(), params(), WorkerConfig(1, True, start_step=0,
                                                                                             seed=0))  # fmt: skip
    worker.start()
    try:
        for index in (0, 1):
            worker.submit(index, [{}] * len(PROMPTS), PROMPTS)
        worker.get(0)
        assert wait_until(lambda: worker.gate.next_index == 2 and not worker.gate.busy)  # policy 1 is written at once
        perturb(model, 0)
        model.model.layers[1].stray = torch.nn.Parameter(torch.zeros(2))  # iterated after layer 0, before layer 1's
        with pytest.raises(RuntimeError, match="'model.layers.1.stray' is unknown to the generator copy"):
            worker.publish(1, model)
        mine = dict(copy.named_parameters())
        assert torch.equal(mine["model.embed_tokens.weight"], model.model.embed_tokens.weight)  # written
        assert not torch.equal(mine["model.norm.weight"], model.model.norm.weight)  # not reached: half-written
        assert worker.loaded_version == 0 and worker.store.latest == 0 and worker.store.held_versions() == []
        worker.get(1)  # policy 0's, sampled before the publish
        worker.submit(2, [{}] * len(PROMPTS), PROMPTS)
        assert worker.jobs.poll(2, 1.0) is None  # batch 2 needs policy 1, which does not exist
    finally:
        worker.stop()


def publish_at_third_token():
    """``(on_step, around_publish)`` for `drive`: policy 1 is published once batch 1 has sampled 3 tokens, and batch 1
    waits for it before its 4th (the events only fix the interleaving; the loading is the worker's own)."""
    reached, published = threading.Event(), threading.Event()

    def on_step(index, t):
        if index == 1 and t == 2:
            reached.set()
        if index == 1 and t == 3:
            assert published.wait(10)

    def around_publish(version, phase):
        if version == 1 and phase == "before":
            assert reached.wait(10)
        if version == 1 and phase == "after":
            published.set()

    return on_step, around_publish


@pytest.mark.parametrize("backend", ["fast", "trl"])
def test_non_strict_in_flight_update_mid_sequence(backend):
    """Batch 1 samples 3 tokens with policy 0, then the 'trainer' publishes policy 1, which the generator loads
    before the 4th token."""
    on_step, around_publish = publish_at_third_token()
    rollouts, weights = drive(1, False, 0, 3, on_step=on_step, around_publish=around_publish, backend=backend)
    r1 = rollouts[1]
    long = [v for v in r1.versions if len(v) > 3]
    assert long and all(v == [0, 0, 0] + [1] * (len(v) - 3) for v in long)
    ref0 = scored_under(weights[0], r1)
    for lp, rf, v in zip(r1.logprobs, ref0, r1.versions, strict=True):
        # the tokens stamped version 0 were sampled by the version-0 weights
        assert max(abs(a - b) for a, b in zip(lp[:3], rf[:3], strict=True)) < 1e-5
        if len(v) > 3:
            assert abs(lp[3] - rf[3]) > 1e-4  # the 4th token came from other weights
    assert all(min(seq) >= 1 for seq in rollouts[2].versions)  # batch 2 may not start before policy 1


def test_queue_is_bounded_by_k():
    model = tiny_model()
    store = PolicyStore()
    worker = RolloutWorker(make_sampler("fast", generation_copy(model)), store, params(max_new_tokens=2),
                           WorkerConfig(2, True, start_step=0, seed=0))  # fmt: skip
    worker.start()
    try:
        for i in range(6):
            worker.submit(i, [{}] * len(PROMPTS), PROMPTS)
        # batches 0, 1, 2 need policy 0; the queue holds 2, batch 2 waits to be put, batch 3 needs policy 1
        for _ in range(200):
            if worker.queue.full():
                break
            threading.Event().wait(0.01)
        threading.Event().wait(0.1)
        assert worker.queue.maxsize == 2 and worker.queue.qsize() == 2
        assert [worker.get(0).index, worker.get(1).index, worker.get(2).index] == [0, 1, 2]
    finally:
        worker.stop()


@pytest.mark.parametrize("backend", ["fast", "trl"])
def test_generator_failure_reaches_the_trainer(backend):
    model = tiny_model()
    store = PolicyStore()
    clone = generation_copy(model)

    def boom(*a, **k):
        raise FloatingPointError("generator exploded")

    clone.model.embed_tokens.forward = boom  # both samplers call the embedding module
    worker = RolloutWorker(make_sampler(backend, clone), store, params(), WorkerConfig(1, False, start_step=0, seed=0))
    worker.start()
    worker.submit(0, [{}] * len(PROMPTS), PROMPTS)
    with pytest.raises(RuntimeError, match="generator thread failed") as info:
        worker.get(0)
    assert isinstance(info.value.__cause__, FloatingPointError)
    worker.stop()
