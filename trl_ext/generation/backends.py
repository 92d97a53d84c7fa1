"""The asynchronous generator's samplers by ``--generation_backend`` name: one flag, one meaning (which sampler
generates). ``trl``: transformers' own model forward (`HFSampler`, any causal LM); ``fast``: the project's fast
sampler (`FastSampler`, the architectures of ``sampler.SUPPORTED_MODEL_TYPES``). Chosen explicitly: an unsupported
model under ``fast`` raises, it never falls back to the other."""

from __future__ import annotations

from torch import nn

from trl_ext.generation.fast import FastSampler
from trl_ext.generation.hf_sampler import HFSampler
from trl_ext.interfaces import ModelSampler

SAMPLERS = {"trl": HFSampler, "fast": FastSampler}
"""``--generation_backend`` -> the sampler class of the off-policy generator thread."""
DESCRIPTIONS = {"trl": "transformers model forward with a DynamicCache (trl_ext.generation.hf_sampler)",
                "fast": "the fast sampler (trl_ext.generation.fast, static cache, CUDA graphs on CUDA)"}  # fmt: skip
"""One line per backend, announced in train.log by the off-policy trainer."""


def make_sampler(backend: str, model: nn.Module) -> ModelSampler:
    """The sampler named ``backend`` over ``model`` (a ``trl_ext.interfaces.ModelSampler``); ValueError for an
    unknown name or a model it cannot sample."""
    if backend not in SAMPLERS:
        raise ValueError(f"unknown generation backend {backend!r}; backends: {', '.join(SAMPLERS)}")
    return SAMPLERS[backend](model)
