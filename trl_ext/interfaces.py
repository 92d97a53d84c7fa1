"""What the rollout components share: the sampling types, and the protocols the samplers and publishers implement.

Samplers (`Sampler`) turn prompt token ids into completions with per-token behaviour log-probs and policy versions;
the off-policy generator (``trl_ext.offpolicy.worker``) drives any of them. Two kinds, told apart by
``loads_versions``:

- `ModelSampler` (``loads_versions = False``): samples ``model`` as its weights are at each step; a new version is
  written into ``model`` (``trl_ext.generation.fast.FastSampler``, ``trl_ext.generation.hf_sampler.HFSampler``);
- `VersionedSampler` (``loads_versions = True``): loads each version itself from what it is given with `stage` (a
  checkpoint directory, or None for a version already pushed into its servers): ``trl_ext.vllm.sampler.VLLMSampler``.

Publishers (`Publisher`) take policy version v (the weights after v optimizer steps) from the trainer:
``trl_ext.offpolicy.store.PolicyStore``, ``trl_ext.offpolicy.worker.RolloutWorker``, and the engine publishers
(`EnginePublisher`: ``trl_ext.vllm.publish.CheckpointPublisher``, ``trl_ext.serve.transfer.WeightPusher``), whose
`snapshot` is what a `VersionedSampler` stages for a published version. Every ``publish`` is called by every trainer
process at the same point (a collective under FSDP2).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["EnginePublisher", "ModelSampler", "Publisher", "Sampled", "Sampler", "SamplingParams",
           "VersionedSampler"]  # fmt: skip


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; filled from the trainer's GRPOConfig (no defaults here)."""

    max_new_tokens: int
    temperature: float
    top_k: int  # 0 = off
    top_p: float  # 1.0 = off
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    """Token sequences that end a row like EOS (their last token is the row's last), e.g. an environment answer's
    closing tag: sampling past it would only produce tokens that the episode loop cuts off."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"need top_k >= 0 and 0 < top_p <= 1, got top_k={self.top_k}, top_p={self.top_p}")
        if not self.eos_token_ids:
            raise ValueError("eos_token_ids must not be empty")
        if any(len(seq) == 0 for seq in self.stop_sequences):
            raise ValueError("stop sequences must not be empty")


@dataclass
class Sampled:
    """Per sequence: the completion token ids (up to and including EOS), their behaviour log-probs and versions."""

    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]


@runtime_checkable
class Sampler(Protocol):
    """One completion per prompt. ``before_step(t)`` is called before every forward pass (t = 0 is the prefill; an
    engine calls it before each chunk of tokens); it may load new weights and returns the version that produces
    token t (without it every token is version 0). ``rng`` draws the samples (None: the device's default)."""

    loads_versions: ClassVar[bool]
    """True: a `VersionedSampler` (it loads versions itself); False: a `ModelSampler` (versions are written into
    its model)."""

    def sample(self, prompt_ids: list[list[int]], params: SamplingParams, rng: torch.Generator | None = None,
               before_step: Callable[[int], int] | None = None) -> Sampled: ...  # fmt: skip


@runtime_checkable
class ModelSampler(Sampler, Protocol):
    """A sampler of ``model``'s weights as they are at each step (no copy): a version is loaded by writing it into
    ``model``'s parameters (between two decoding steps in flight)."""

    model: nn.Module


@runtime_checkable
class VersionedSampler(Sampler, Protocol):
    """A sampler that loads each version itself: `stage` gives it the version the generator now samples with and
    that version's snapshot (a checkpoint directory; None: already in its servers, pushed); it loads it when
    ``before_step`` first reports that version."""

    def stage(self, version: int, snapshot: object | None) -> None: ...


@runtime_checkable
class Publisher(Protocol):
    """Takes policy ``version`` of ``model`` from the trainer (a collective: every process calls it at the same
    point); `close` releases what it holds (files, connections, the generator thread)."""

    def publish(self, version: int, model: nn.Module) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class EnginePublisher(Publisher, Protocol):
    """A publisher for a `VersionedSampler`: `snapshot` is what the sampler stages for a published version."""

    def snapshot(self, version: int) -> object | None: ...
