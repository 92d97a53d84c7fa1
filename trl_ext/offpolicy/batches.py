"""Sampling one batch of the off-policy generator (`BatchSampler`): one completion per prompt, or environment
episodes, with the sampler's ``before_step`` hook doing the in-flight weight updates between two decoding steps (as
PipelineRL, Piché et al. 2025, and AReaL, Fu et al. 2025: the KV cache of the tokens already generated is kept) and
stamping every token with the policy version that sampled it."""

from __future__ import annotations

import threading
from collections.abc import Callable

from trl_ext.interfaces import Sampler, SamplingParams
from trl_ext.offpolicy.gate import WeightGate
from trl_ext.offpolicy.jobs import Rollout
from trl_ext.offpolicy.store import Closed
from trl_ext.offpolicy.weights import GeneratorWeights


class BatchSampler:
    """Samples batches with ``sampler`` and ``params`` under ``gate``'s schedule, loading newer versions into
    ``weights``. ``on_step(index, t)``: a test hook called in the generator thread before each forward pass.

    ``episode_fn(rows, sample_turn)``, when given, plays each batch as environment episodes
    (``env.episodes.play_episodes``) instead of sampling one completion per prompt: ``sample_turn(contexts)`` samples
    one turn with this sampler, schedule and in-flight updates (weights may change between turns and between decoding
    steps; every token's version says which policy sampled it). It returns ``play_episodes``' dict."""

    def __init__(self, sampler: Sampler, params: SamplingParams, gate: WeightGate, weights: GeneratorWeights,
                 stop: threading.Event, episode_fn: Callable[[list[dict], Callable], dict] | None = None,
                 on_step: Callable[[int, int], None] | None = None) -> None:  # fmt: skip
        self.sampler, self.params, self.gate, self.weights, self.stop = sampler, params, gate, weights, stop
        self.episode_fn, self.on_step = episode_fn, on_step

    def before_step(self, index: int) -> Callable[[int], int]:
        """The ``before_step`` hook of batch ``index``: in flight, the gate is released between two decoding steps
        (a publish writes, or pushes, there) and an engine loads the newest published version; returns the version
        that samples token t."""
        strict, store, weights = self.gate.strict, self.weights.store, self.weights
        gated = weights.direct and not strict  # in flight: a publish writes (or pushes) between two decoding steps

        def hook(t: int) -> int:
            if gated and t > 0:
                self.gate.release()
            if self.on_step is not None:
                self.on_step(index, t)
            if self.stop.is_set():
                raise Closed
            if gated and t > 0:
                self.gate.hold()
            elif not strict and store.latest > weights.loaded_version:
                weights.load(store.latest)  # an engine's in-flight update: it loads the version's checkpoint
            return weights.loaded_version

        return hook

    def sample_batch(self, index: int, rows: list[dict], prompt_ids: list[list[int]], rng) -> Rollout:
        """Batch ``index`` (``rng`` seeded for it), with the generator holding the gate and the batch's first
        version loaded."""
        hook = self.before_step(index)
        if self.episode_fn is None:
            out = self.sampler.sample(prompt_ids, self.params, rng, hook)
            return Rollout(index, rows, prompt_ids, out.completion_ids, out.logprobs, out.versions)

        def sample_turn(contexts: list[list[int]]):
            out = self.sampler.sample(contexts, self.params, rng, hook)
            return out.completion_ids, out.logprobs, out.versions

        ep = dict(self.episode_fn(rows, sample_turn))
        return Rollout(index, rows, ep.pop("prompt_ids"), ep.pop("completion_ids"), ep.pop("logprobs"),
                       ep.pop("versions"), extra=ep)  # fmt: skip
