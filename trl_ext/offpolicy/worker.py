"""Asynchronous rollouts: a sampling loop that records behaviour log-probs and the policy version of every token,
versioned weight publishing, and a generator thread that feeds finished batches to the trainer through a bounded queue.

Schedule (prime-rl ``max_async_level`` / ``strict_async_level``; in-flight weight updates after PipelineRL, Piché et
al. 2025, and AReaL, Fu et al. 2025). Policy version v = the weights after v optimizer steps. The batch trained at
step n (0-based ``global_step``) is batch n of the prompt stream, and s is the step training started (or resumed) at:

- strict:     batch n is sampled entirely by policy ``max(n - k, s)``;
- non-strict: batch n starts once policy ``max(n - k, s)`` exists, with the newest published policy, and the generator
  loads every newer policy between two decoding steps of the sequences in flight (the KV cache of the tokens already
  generated is kept, as in PipelineRL). Each token is stamped with the version that sampled it: its lag at step n is
  at most k.

Weights (`RolloutWorker.publish`): the trainer writes each version's trainable weights straight into the generator's
copy, one (gathered) parameter at a time, at a point where no batch still to be sampled needs an older policy: in
flight between two decoding steps, strict at k = 1 after the batch the trainer takes next. So no copy of the weights
is held beside the generator's. Only a strict generator still owing batches of an older policy (k >= 2, generation
slower than training) makes the store keep the new version as a snapshot until it is loaded (`PolicyStore`).

The queue and the weight snapshots live in memory only: a resumed run starts a fresh generator from the restored
weights (version s), so no batch generated before the checkpoint is ever trained on.

Sampling is the sampler named by ``--generation_backend`` (``trl_ext.generation.backends``: ``trl`` transformers' own
forward with a DynamicCache, any causal LM; ``fast`` the fast sampler, its architectures only), or an engine's
(``trl_ext.interfaces.VersionedSampler``: ``--use_vllm``). Behaviour log-probs are
``log_softmax(logits / temperature)`` of the sampled token, from the raw logits: top-k / top-p restrict only the
distribution that is sampled from. This is what TRL's fused LM head computes for the trainer, so with
identical weights the ratio is 1 up to float error.

`RolloutWorker` composes the jobs of the generator, one class each: the job queue of submitted prompt batches and
finished rollouts (``trl_ext.offpolicy.jobs``), the weight gate that applies the schedule (``trl_ext.offpolicy.gate``),
the generator's weights and how a version gets into them (``trl_ext.offpolicy.weights``), the sampling of one batch
(``trl_ext.offpolicy.batches``) and the thread's lifecycle (``trl_ext.offpolicy.thread``).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from trl_ext import compat
from trl_ext.generation.fast import FastSampler
from trl_ext.generation.sampling import restrict_logits
from trl_ext.interfaces import Publisher, Sampled, Sampler, SamplingParams
from trl_ext.offpolicy.batches import BatchSampler
from trl_ext.offpolicy.gate import WeightGate
from trl_ext.offpolicy.jobs import JobQueue, Rollout
from trl_ext.offpolicy.store import PolicyStore
from trl_ext.offpolicy.thread import GeneratorThread
from trl_ext.offpolicy.weights import GeneratorWeights

__all__ = ["PolicyStore", "Rollout", "RolloutWorker", "WorkerConfig", "generation_copy", "restrict_logits", "sample"]


def sample(
    model: nn.Module,
    prompt_ids: list[list[int]],
    params: SamplingParams,
    rng: torch.Generator | None,
    before_step: Callable[[int], int] | None = None,
) -> Sampled:
    """One completion per prompt with the fast sampler (``trl_ext.generation.fast``), left-padding the prompts.

    ``before_step(t)`` is called before every forward pass (t = 0 is the prefill); it may load new weights and returns
    the version that produces token t (without it every token is version 0). Positions run 0..len-1 over the padded
    row exactly as the trainer's forward over the same padded row numbers them.
    """
    return FastSampler(model).sample(prompt_ids, params, rng, before_step)


def generation_copy(model: nn.Module) -> nn.Module:
    """A frozen deep copy of ``model`` for the generator thread.

    TRL's fused-LM-head patch (an instance-level ``forward`` wrapping the class's forward) closes over the original
    module, so a copy would silently run the trainer's weights: it is removed. Any other instance-level forward (e.g.
    device-map hooks) cannot be copied safely and raises.
    """
    clone = copy.deepcopy(model)
    for module in clone.modules():
        forward = module.__dict__.get("forward")
        if forward is None:
            continue
        if compat.is_trl_fused_head_forward(module, forward):
            del module.__dict__["forward"]
        else:
            raise ValueError(f"cannot copy {type(module).__name__} for generation: its forward is patched ({forward})")
    return clone.requires_grad_(False).eval()


def batch_seed(seed: int, index: int, rank: int = 0) -> int:
    """The sampling seed of batch ``index`` on process ``rank``: distinct per process (a group split over processes
    must not draw the same noise twice), and the one-process seed for rank 0."""
    return seed * 1_000_003 + index + rank * 7_919_000_003


@dataclass(frozen=True)
class WorkerConfig:
    """The generator's schedule and seeding (module docstring): ``max_async_level`` k >= 1, ``strict`` (prime-rl's
    ``strict_async_level``), ``start_step`` s (the step training starts or resumes at), ``seed`` and ``rank`` (this
    process: `batch_seed`), ``num_threads`` (torch threads of the generator thread on CPU; None: unchanged)."""

    max_async_level: int
    strict: bool
    start_step: int
    seed: int
    rank: int = 0
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.max_async_level < 1:
            raise ValueError(f"RolloutWorker needs max_async_level >= 1, got {self.max_async_level}")


class RolloutWorker:
    """Generator thread: samples batch after batch with ``sampler`` into a bounded queue (a
    ``trl_ext.interfaces.Publisher``).

    The trainer ``submit``s the prompts of batch i (rows and token ids, tokenized in the trainer thread), ``publish``es
    weights after every optimizer step and ``get``s batch n at step n. ``sampler`` is a ``ModelSampler`` over the
    generator's own model copy (``--generation_backend``: ``trl_ext.generation.backends.make_sampler``), into which
    publishes write, or an engine's ``VersionedSampler`` (``trl_ext.vllm.sampler.VLLMSampler``), which loads each
    version from ``store``'s snapshot (``PolicyStore.of(publisher)``) or, with a ``pusher``, from its servers. On
    several processes each process runs its own worker on its slice of every batch (``config.rank`` seeds its
    sampling: `batch_seed`); all of them follow the same schedule, and every process trains step n on batch n, in
    lockstep through DDP. ``episode_fn``, ``on_step``: `BatchSampler`'s; ``autocast()`` wraps each batch's sampling."""

    def __init__(self, sampler: Sampler, store: PolicyStore, params: SamplingParams, config: WorkerConfig, *,
                 episode_fn: Callable[[list[dict], Callable], dict] | None = None,
                 pusher: Publisher | None = None, agree: Callable[[bool], bool] = bool,
                 autocast: Callable[[], AbstractContextManager] = nullcontext,
                 on_step: Callable[[int, int], None] | None = None) -> None:  # fmt: skip
        self.sampler, self.store, self.params, self.config = sampler, store, params, config
        self.pusher, self.agree, self.autocast = pusher, agree, autocast  # an engine's servers take pushed versions
        self.weights = GeneratorWeights(sampler, store, config.start_step, pusher)
        self.model = self.weights.model  # the generator's copy, or None (an engine)
        self.thread = GeneratorThread(self._generate, lambda: self.weights.device, config.num_threads,
                                      on_exit=lambda: self.gate.release())  # a publish waiting on the thread writes
        self.jobs = JobQueue(config.max_async_level, config.start_step, self.thread.stop)
        self.gate = WeightGate(config.max_async_level, config.strict, config.start_step, self.thread.stop,
                               self.thread.is_alive, self.jobs.has)  # fmt: skip
        self.batches = BatchSampler(sampler, params, self.gate, self.weights, self.thread.stop, episode_fn, on_step)

    # views of the parts (tests, bench/gpu_check.py)
    queue = property(lambda self: self.jobs.finished)
    loaded_version = property(lambda self: self.weights.loaded_version)
    error = property(lambda self: self.thread.error)

    @property
    def on_step(self) -> Callable[[int, int], None] | None:
        return self.batches.on_step

    @on_step.setter
    def on_step(self, fn: Callable[[int, int], None] | None) -> None:
        self.batches.on_step = fn

    def required_version(self, index: int) -> int:
        """Oldest policy allowed to sample batch ``index`` (the only one in strict mode)."""
        return self.gate.required_version(index)

    def start(self) -> None:
        self.thread.start()

    def submit(self, index: int, rows: list[dict], prompt_ids: list[list[int]]) -> None:
        self.jobs.submit(index, rows, prompt_ids)

    def get(self, index: int, poll_s: float = 0.2) -> Rollout:
        """Batch ``index`` (blocking); re-raises a generator failure in the caller's thread."""
        while True:
            self.thread.check(self.jobs.finished.empty)
            rollout = self.jobs.poll(index, poll_s)
            if rollout is not None:
                return rollout

    def stop(self) -> None:
        self.thread.stop.set()
        self.store.close()
        self.gate.wake()
        self.jobs.wake()
        self.thread.join()

    def close(self) -> None:
        """`stop` (``trl_ext.interfaces.Publisher``'s close)."""
        self.stop()

    # ------------------------------------------------------------------ trainer thread: publishing
    def publish(self, version: int, model: nn.Module) -> None:
        """Policy ``version`` (``model`` after ``version`` optimizer steps) for the generator. A collective under
        FSDP2 (every process calls it at the same point, and every path gathers the same tensors in the same order).

        With an engine the store keeps the version's checkpoint. Otherwise the trainable weights are written straight
        into the generator's model, gathered one parameter at a time (no copy of the model is held), whenever no batch
        still to be sampled needs an older policy: in flight always, between two decoding steps; strict when the
        generator's next batch is one of this version's, waiting at k = 1 for the batch it is sampling, which the
        trainer takes next (`WeightGate.write_decision`). Only a strict generator behind by a batch of an older policy
        (k >= 2) makes the store keep a snapshot (`trainable_snapshot`), until it takes it.

        With a ``pusher`` (an engine whose servers take pushed weights: ``trl_ext.serve.transfer``) a version is
        pushed into the servers when it would be written into a copy, once every process may push (``agree``: all
        processes share the servers); else the store keeps its checkpoint."""
        if not self.weights.direct:
            return self.store.publish(version, model)
        direct = self.gate.begin_write(version)
        if self.pusher is not None and self.agree(direct) != direct:  # another process's generator needs an older
            self.gate.end_write()  # policy on the shared servers: this version goes as a checkpoint everywhere
            direct = False
        if not direct:
            return self.store.publish(version, model)
        try:
            self.weights.write(version, model, self.thread.stream)
        except BaseException:
            self.gate.end_write()  # a failed write is no version: the trainer's step fails with it
            raise
        self.gate.end_write(lambda: self.weights.written(version))

    # ------------------------------------------------------------------ generator thread
    def _generate(self) -> None:
        """The schedule: batch after batch, each once its oldest allowed policy is published, sampled with the gate
        held (strict: by exactly that policy; in flight: from the newest, loading newer ones between steps)."""
        cfg = self.config
        rng = torch.Generator(self.thread.device)  # one, reseeded per batch (a CUDA graph keeps it registered)
        for index in itertools.count(cfg.start_step):
            rows, prompt_ids = self.jobs.take(index)
            need = self.gate.required_version(index)
            latest = self.store.wait(need)
            self.gate.hold()
            try:
                self.weights.load(need if cfg.strict else latest)
                rng.manual_seed(batch_seed(cfg.seed, index, cfg.rank))
                with self.autocast():
                    rollout = self.batches.sample_batch(index, rows, prompt_ids, rng)
            finally:
                self.gate.release(index + 1)
            self.jobs.put(rollout)
