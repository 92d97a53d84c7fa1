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
forward with a DynamicCache, any causal LM; ``fast`` the fast sampler, its architectures only). Behaviour log-probs are
``log_softmax(logits / temperature)`` of the sampled token, from the raw logits: top-k / top-p restrict only the
distribution that is sampled from. This is what TRL's fused LM head computes for the trainer, so with
identical weights the ratio is 1 up to float error.
"""

from __future__ import annotations

import copy
import itertools
import queue
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from trl_ext.generation.backends import make_sampler
from trl_ext.generation.sampler import FastSampler, Sampled, SamplingParams
from trl_ext.generation.sampling import restrict_logits
from trl_ext.offpolicy.store import Closed, PolicyStore

__all__ = ["PolicyStore", "RolloutWorker", "Sampled", "SamplingParams", "generation_copy", "restrict_logits", "sample"]


def sample(
    model: nn.Module,
    prompt_ids: list[list[int]],
    params: SamplingParams,
    rng: torch.Generator | None,
    before_step: Callable[[int], int] | None = None,
) -> Sampled:
    """One completion per prompt with the fast sampler (``trl_ext.generation.sampler``), left-padding the prompts.

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
        if getattr(getattr(forward, "__func__", forward), "__wrapped__", None) is type(module).forward:
            del module.__dict__["forward"]
        else:
            raise ValueError(f"cannot copy {type(module).__name__} for generation: its forward is patched ({forward})")
    return clone.requires_grad_(False).eval()


def batch_seed(seed: int, index: int, rank: int = 0) -> int:
    """The sampling seed of batch ``index`` on process ``rank``: distinct per process (a group split over processes
    must not draw the same noise twice), and the one-process seed for rank 0."""
    return seed * 1_000_003 + index + rank * 7_919_000_003


@dataclass
class Rollout:
    """A generation batch as the trainer receives it: dataset rows, token ids, behaviour log-probs, versions."""

    index: int
    rows: list[dict]
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]
    extra: dict = field(default_factory=dict)  # episode outputs of environment runs (env_mask, env_return, ...)

    def version_range(self) -> tuple[int, int]:
        flat = [v for seq in self.versions for v in seq]
        return min(flat), max(flat)


class RolloutWorker:
    """Generator thread: holds its own model copy, samples batch after batch into a bounded queue.

    The trainer ``submit``s the prompts of batch i (rows and token ids, tokenized in the trainer thread), ``publish``es
    weights to ``store`` after every optimizer step and ``get``s batch n at step n. ``on_step(index, t)`` is a test
    hook called in the generator thread before each forward pass. ``backend`` names the sampler
    (``trl_ext.generation.backends``: ``trl`` or ``fast``), built over ``model``, unless ``sampler`` is given (an
    engine's sampler with the same ``sample`` interface and a ``stage(version, snapshot)`` that takes each loaded
    version's snapshot: ``trl_ext.vllm.engine.VLLMSampler``; ``model`` is then None). On
    several processes each process runs its own worker on its slice of every batch (``rank`` seeds its sampling: `batch_seed`); all of them follow
    the same schedule, and every process trains step n on batch n, in lockstep through DDP.

    ``episode_fn(rows, sample_turn)``, when given, plays each batch as environment episodes
    (``env.episodes.play_episodes``) instead of sampling one completion per prompt: ``sample_turn(contexts)`` samples
    one turn with this worker's sampler, schedule and in-flight updates (weights may change between turns and between
    decoding steps; every token's version says which policy sampled it). It returns ``play_episodes``' dict.
    """

    def __init__(
        self,
        model: nn.Module | None,
        store: PolicyStore,
        params: SamplingParams,
        *,
        max_async_level: int,
        strict: bool,
        start_step: int,
        seed: int,
        backend: str,
        rank: int = 0,
        num_threads: int | None = None,
        autocast: Callable[[], AbstractContextManager] = nullcontext,
        on_step: Callable[[int, int], None] | None = None,
        episode_fn: Callable[[list[dict], Callable], dict] | None = None,
        sampler=None,
        pusher=None,
        agree: Callable[[bool], bool] = bool,
    ) -> None:
        if max_async_level < 1:
            raise ValueError(f"RolloutWorker needs max_async_level >= 1, got {max_async_level}")
        self.model, self.store, self.params = model, store, params
        self.k, self.strict, self.start_step, self.seed, self.rank = max_async_level, strict, start_step, seed, rank
        self.num_threads, self.autocast, self.on_step = num_threads, autocast, on_step
        self.episode_fn = episode_fn
        self.pusher, self.agree = pusher, agree  # an engine's servers take pushed versions (publish)
        self.queue: queue.Queue[Rollout] = queue.Queue(maxsize=max_async_level)
        self.loaded_version: int | None = None
        # The weight gate (`publish`): the generator's model is read while `_busy` (a whole batch in strict mode, one
        # decoding step in flight) and written by the trainer while `_writing`; `_next` is the batch it samples next.
        self._gate = threading.Condition()
        self._busy = self._writing = self._writer_waiting = False
        self._next = start_step
        if model is not None:  # the copy holds the starting policy: nothing to snapshot or load for it
            self.loaded_version = start_step
            store.written(start_step)
        self.error: BaseException | None = None
        self._params = dict(model.named_parameters()) if model is not None else {}
        self.backend = backend
        self.sampler = make_sampler(backend, model) if sampler is None else sampler
        self._jobs: dict[int, tuple[list[dict], list[list[int]]]] = {}
        self._jobs_cond = threading.Condition()
        self._claimed = start_step - 1  # the newest batch the generator has taken
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollout-generator", daemon=True)
        self._stream = None  # the generator's CUDA stream (set by its thread)

    def required_version(self, index: int) -> int:
        """Oldest policy allowed to sample batch ``index`` (the only one in strict mode)."""
        return max(index - self.k, self.start_step)

    def start(self) -> None:
        self._thread.start()

    def submit(self, index: int, rows: list[dict], prompt_ids: list[list[int]]) -> None:
        with self._jobs_cond:
            self._jobs[index] = (rows, prompt_ids)
            self._jobs_cond.notify_all()

    def get(self, index: int, poll_s: float = 0.2) -> Rollout:
        """Batch ``index`` (blocking); re-raises a generator failure in the caller's thread."""
        while True:
            if self.error is not None:
                raise RuntimeError("the rollout generator thread failed") from self.error
            if not self._thread.is_alive() and self.queue.empty():
                raise RuntimeError("the rollout generator thread is not running")
            try:
                rollout = self.queue.get(timeout=poll_s)
            except queue.Empty:
                continue
            if rollout.index != index:
                raise RuntimeError(f"expected rollout batch {index}, the queue delivered batch {rollout.index}")
            return rollout

    def stop(self) -> None:
        self._stop.set()
        self.store.close()
        with self._gate:
            self._gate.notify_all()
        with self._jobs_cond:
            self._jobs_cond.notify_all()
        self._thread.join()

    # ------------------------------------------------------------------ trainer thread: publishing
    def publish(self, version: int, model: nn.Module) -> None:
        """Policy ``version`` (``model`` after ``version`` optimizer steps) for the generator. A collective under
        FSDP2 (every process calls it at the same point, and every path gathers the same tensors in the same order).

        With an engine the store keeps the version's checkpoint. Otherwise the trainable weights are written straight
        into the generator's model, gathered one parameter at a time (no copy of the model is held), whenever no batch
        still to be sampled needs an older policy: in flight always, between two decoding steps; strict when the
        generator's next batch is one of this version's, waiting at k = 1 for the batch it is sampling, which the
        trainer takes next. Only a strict generator behind by a batch of an older policy (k >= 2) makes the store
        keep a snapshot (`trainable_snapshot`), until it takes it.

        With a ``pusher`` (an engine whose servers take pushed weights: ``trl_ext.serve.transfer``) a version is
        pushed into the servers when it would be written into a copy, once every process may push (``agree``: all
        processes share the servers); else the store keeps its checkpoint."""
        if self.model is None and self.pusher is None:
            return self.store.publish(version, model)

        decision = ["wait"]

        def decided() -> bool:
            decision[0] = self._write_decision(version)
            return decision[0] != "wait"

        with self._gate:
            self._writer_waiting = True
            try:
                self._gate.wait_for(decided)
                direct = self._writing = decision[0] == "write"
            finally:
                self._writer_waiting = False
                self._gate.notify_all()
        if self.pusher is not None and self.agree(direct) != direct:  # another process's generator needs an older
            with self._gate:  # policy on the shared servers: this version goes as a checkpoint everywhere
                self._writing = direct = False
                self._gate.notify_all()
        if not direct:
            return self.store.publish(version, model)
        try:
            self._write(version, model)
        except BaseException:
            with self._gate:  # a failed write is no version: the trainer's step fails with it
                self._writing = False
                self._gate.notify_all()
            raise
        with self._gate:
            self._writing = False
            self.loaded_version = version
            self.store.written(version)
            self._gate.notify_all()

    def _write(self, version: int, model: nn.Module) -> None:
        """Version ``version`` into the generator's model, or pushed into its servers (then the next request loads
        it: staged without a checkpoint)."""
        if self.pusher is not None:
            self.pusher.publish(version, model)
            self.sampler.stage(version, None)
            return
        from trl_ext.offpolicy.sharded import iter_whole

        if self._stream is not None:
            self._stream.synchronize()  # the generator's last forward has finished: no write under it
        self._copy_in(iter_whole(model, trainable_only=True))

    def _write_decision(self, version: int) -> str:
        """"write" (into the generator's model now), "snapshot" or "wait" (for the generator's batch or step)."""
        if self._stop.is_set() or not self._thread.is_alive():
            return "write"  # nothing samples any more
        if not self.strict:
            return "wait" if self._busy else "write"  # the decoding step in progress
        if not self._busy and self.required_version(self._next) >= version:
            return "write"  # every batch of an older policy is sampled
        if self._next == version and self.required_version(version + 1) >= version and self._has_job(version):
            return "wait"  # k = 1: the batch the trainer takes next is the last of the older policy
        return "snapshot"

    def _has_job(self, index: int) -> bool:
        """Whether batch ``index`` is submitted (waiting, or taken by the generator): a publish may wait for it."""
        with self._jobs_cond:
            return index in self._jobs or self._claimed >= index

    def _copy_in(self, tensors) -> None:
        """Every (name, whole tensor) of ``tensors`` copied into the generator's model, one at a time."""
        cuda = False
        with torch.no_grad():
            for name, tensor in tensors:
                if name not in self._params:
                    raise RuntimeError(f"published weight {name!r} is unknown to the generator copy")
                self._params[name].copy_(tensor)
                cuda = cuda or tensor.is_cuda
        if cuda:
            torch.cuda.current_stream().synchronize()  # the generator reads them on its own stream

    # ------------------------------------------------------------------ generator thread
    def _load(self, version: int) -> None:
        if version == self.loaded_version:
            return  # written in place by `publish`
        snapshot = self.store.take(version)
        if hasattr(self.sampler, "stage"):  # an engine's sampler loads the version's checkpoint itself
            self.sampler.stage(version, snapshot)
        else:
            self._copy_in(snapshot.items())
        self.loaded_version = version

    def _hold(self) -> None:
        """The generator reads its model from here until `_release`. A write in progress finishes first; in flight
        a publish waiting to write goes first too (in strict mode it may be waiting for this very batch)."""
        with self._gate:
            yields = not self.strict
            self._gate.wait_for(lambda: not (self._writing or (yields and self._writer_waiting)) or self._stop.is_set())
            self._busy = True

    def _release(self, next_index: int | None = None) -> None:
        """A publish may write from here (it first waits for the kernels already queued on the generator's stream)."""
        with self._gate:
            self._busy = False
            if next_index is not None:
                self._next = next_index
            self._gate.notify_all()

    def _next_job(self, index: int) -> tuple[list[dict], list[list[int]]]:
        with self._jobs_cond:
            self._jobs_cond.wait_for(lambda: self._stop.is_set() or index in self._jobs)
            if self._stop.is_set():
                raise Closed
            self._claimed = index
            return self._jobs.pop(index)

    def _before_step(self, index: int) -> Callable[[int], int]:
        gated = (self.model is not None or self.pusher is not None) and not self.strict  # in flight: a publish writes
        # (or pushes) between two decoding steps

        def hook(t: int) -> int:
            if gated and t > 0:
                self._release()
            if self.on_step is not None:
                self.on_step(index, t)
            if self._stop.is_set():
                raise Closed
            if gated and t > 0:
                self._hold()
            elif not self.strict and self.store.latest > self.loaded_version:
                self._load(self.store.latest)  # an engine's in-flight update: it loads the version's checkpoint
            return self.loaded_version

        return hook

    def _sample_batch(self, index: int, rows: list[dict], prompt_ids: list[list[int]], rng) -> Rollout:
        hook = self._before_step(index)
        if self.episode_fn is None:
            out = self.sampler.sample(prompt_ids, self.params, rng, hook)
            return Rollout(index, rows, prompt_ids, out.completion_ids, out.logprobs, out.versions)

        def sample_turn(contexts: list[list[int]]):
            out = self.sampler.sample(contexts, self.params, rng, hook)
            return out.completion_ids, out.logprobs, out.versions

        ep = dict(self.episode_fn(rows, sample_turn))
        return Rollout(index, rows, ep.pop("prompt_ids"), ep.pop("completion_ids"), ep.pop("logprobs"),
                       ep.pop("versions"), extra=ep)  # fmt: skip

    def _run(self) -> None:
        try:
            if self.num_threads:
                torch.set_num_threads(self.num_threads)
            device = next(self.model.parameters()).device if self.model is not None else torch.device("cpu")
            self._stream = stream = torch.cuda.Stream(device) if device.type == "cuda" else None
            rng = torch.Generator(device)  # one generator, reseeded per batch (a CUDA graph keeps it registered)
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                for index in itertools.count(self.start_step):
                    rows, prompt_ids = self._next_job(index)
                    need = self.required_version(index)
                    latest = self.store.wait(need)
                    self._hold()
                    try:
                        self._load(need if self.strict else latest)
                        rng.manual_seed(batch_seed(self.seed, index, self.rank))
                        with self.autocast():
                            rollout = self._sample_batch(index, rows, prompt_ids, rng)
                    finally:
                        self._release(index + 1)
                    while True:
                        if self._stop.is_set():
                            raise Closed
                        try:
                            self.queue.put(rollout, timeout=0.1)
                            break
                        except queue.Full:
                            continue
        except Closed:
            pass
        except BaseException as e:  # surfaced to the trainer by get()
            self.error = e
        finally:
            with self._gate:  # a publish waiting on this thread writes (`_write_decision`)
                self._busy = False
                self._gate.notify_all()
