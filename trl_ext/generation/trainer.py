"""Trainer plumbing of the fast generation backend: the ``--generation_backend`` flag (`GenerationArgs`) and the
GRPOTrainer hook (`GenerationMixin._generate_single_turn`). The sampler is ``trl_ext.generation.sampler``.

The flag names the sampler that generates. ``--generation_backend trl`` (the default) leaves TRL's generation
untouched; with ``--max_async_level >= 1`` the generator thread samples with transformers' own model forward
(`trl_ext.generation.hf_sampler.HFSampler`, any causal LM). ``fast`` samples with `FastSampler` (its architectures):
it replaces the ``transformers.generate`` call of synchronous runs and also returns the behaviour log-probs (raw
tempered logits, as the asynchronous generator records them; TRL stores them as ``sampling_per_token_logps``), and it
is the generator thread's sampler with ``--max_async_level >= 1`` (``trl_ext.generation.backends``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
from trl import GRPOConfig

from trl_ext.env.episodes import answer_stop_sequences
from trl_ext.generation.backends import SAMPLERS
from trl_ext.generation.sampler import SUPPORTED_MODEL_TYPES, FastSampler, SamplingParams
from trl_ext.registry import ConfigError

BACKENDS = tuple(SAMPLERS)  # the sync path: 'trl' = TRL's own generation, 'fast' = FastSampler
CPU_DECODE_THREADS = 1
"""Torch threads of a synchronous fast-backend generation on CPU (the trainer's setting is restored after it)."""
_UNSUPPORTED = ("use_vllm", "use_transformers_continuous_batching", "repetition_penalty", "min_p", "generation_kwargs",
                "cache_implementation", "pad_to_multiple_of")  # fmt: skip
"""GRPOConfig generation options the fast backend does not implement: each must keep TRL's default."""


@dataclass
class GenerationArgs:
    _argument_group_name = "generation backends (trl_ext.generation)"  # train.py --help group (cli_help.py)

    generation_backend: str = field(
        default="trl",
        metadata={"help": "Which sampler generates. 'trl': TRL's own path (transformers.generate); with "
                  "--max_async_level >= 1 the generator thread samples with transformers' model forward (any causal "
                  "LM). 'fast': the project's fast sampler (static KV cache, fused sampling, CUDA graphs on CUDA; "
                  f"{', '.join(SUPPORTED_MODEL_TYPES)} models; temperature, top-k, top-p only), synchronous or in the "
                  "generator thread."},
    )  # fmt: skip

    def validate_generation(self) -> None:
        """Raise ConfigError for settings the chosen backend would ignore (called by ExtGRPOConfig)."""
        if self.generation_backend not in BACKENDS:
            raise ConfigError(f"--generation_backend must be one of {', '.join(BACKENDS)}, "
                              f"got {self.generation_backend!r}")
        defaults = {f.name: f.default for f in fields(GRPOConfig)}
        if self.generation_backend == "trl":
            if self.max_async_level >= 1 and self.cache_implementation != defaults["cache_implementation"]:
                raise ConfigError(f"--cache_implementation {self.cache_implementation!r} is not used by the "
                                  f"off-policy generator (--max_async_level >= 1 samples with a DynamicCache)")
            return
        for name in _UNSUPPORTED:
            if getattr(self, name) != defaults[name]:
                raise ConfigError(f"--{name} {getattr(self, name)!r} is not implemented by --generation_backend "
                                  f"fast (keep TRL's default {defaults[name]!r}, or use --generation_backend trl)")
        if self.max_completion_length is None or self.max_completion_length < 1:
            raise ConfigError("--generation_backend fast needs --max_completion_length >= 1")
        if not self.temperature > 0 or not 0 < self.top_p <= 1 or (self.top_k or 0) < 0:
            raise ConfigError(f"--generation_backend fast needs --temperature > 0, 0 < --top_p <= 1 and --top_k >= 0, "
                              f"got {self.temperature}, {self.top_p}, {self.top_k}")  # fmt: skip


class GenerationMixin:
    """Routes TRL's single-turn generation to `FastSampler` when ``--generation_backend fast``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._fast_sampler: FastSampler | None = None
        if self.args.generation_backend == "fast":
            try:
                self._fast_sampler = FastSampler(self.accelerator.unwrap_model(self.model))
            except ValueError as e:
                raise ConfigError(f"--generation_backend fast: {e}") from e

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self._fast_sampler is None:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)  # fmt: skip
        if images is not None or multimodal_fields or has_tool_images:
            raise ValueError("--generation_backend fast supports text prompts only")
        params = SamplingParams(
            max_new_tokens=self.max_completion_length, temperature=self.temperature, top_k=self.top_k or 0,
            top_p=self.top_p, eos_token_ids=tuple(self.eos_token_ids), pad_token_id=self._tokenizer.pad_token_id,
            stop_sequences=answer_stop_sequences(self.processing_class) if self.args.env else (),
        )  # fmt: skip
        threads = torch.get_num_threads()
        cpu = self.accelerator.device.type == "cpu"
        if cpu:  # decode matmuls ([B, H] x [H, 3H]) are too small to split: 2 threads were slower (bench_step.py)
            torch.set_num_threads(CPU_DECODE_THREADS)
        try:
            out = self._fast_sampler.sample(prompt_ids, params)
        finally:
            if cpu:
                torch.set_num_threads(threads)
        return out.completion_ids, out.logprobs
