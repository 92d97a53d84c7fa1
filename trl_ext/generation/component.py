"""The fast sampler as TRL's single-turn generation (``--generation_backend fast``): `FastGeneration` replaces the
``transformers.generate`` call of synchronous runs with `FastSampler` (``trl_ext.generation.fast``), which also
returns the behaviour log-probs (raw tempered logits, as the asynchronous generator records them; TRL stores them as
``sampling_per_token_logps``). The flag is `trl_ext.generation.args`.
"""

from __future__ import annotations

import torch

from trl_ext import compat
from trl_ext.components import Component, register
from trl_ext.env.episodes import answer_stop_sequences
from trl_ext.generation.fast import FastSampler
from trl_ext.interfaces import SamplingParams
from trl_ext.registry import ConfigError

CPU_DECODE_THREADS = 1
"""Torch threads of a synchronous fast-backend generation on CPU (the trainer's setting is restored after it)."""


@register
class FastGeneration(Component):
    """TRL's ``_generate_single_turn`` by `FastSampler` when ``--generation_backend fast``."""

    name, order = "generation", 10

    @classmethod
    def wanted(cls, cfg, kwargs) -> bool:
        return cfg.generation_backend == "fast"

    def setup(self) -> None:
        t = self.trainer
        try:
            self.sampler = FastSampler(t.accelerator.unwrap_model(t.model))
        except ValueError as e:
            raise ConfigError(f"--generation_backend fast: {e}") from e

    def generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images):
        t = self.trainer
        if images is not None or multimodal_fields or has_tool_images:
            raise ValueError("--generation_backend fast supports text prompts only")
        params = SamplingParams(
            max_new_tokens=t.max_completion_length, temperature=t.temperature, top_k=t.top_k or 0,
            top_p=t.top_p, eos_token_ids=tuple(t.eos_token_ids), pad_token_id=compat.trl_tokenizer(t).pad_token_id,
            stop_sequences=answer_stop_sequences(t.processing_class) if t.args.env and not t.args.tool_env else (),
        )  # fmt: skip
        threads = torch.get_num_threads()
        cpu = t.accelerator.device.type == "cpu"
        if cpu:  # decode matmuls ([B, H] x [H, 3H]) are too small to split: 2 threads were slower (bench_step.py)
            torch.set_num_threads(CPU_DECODE_THREADS)
        try:
            out = self.sampler.sample(prompt_ids, params)
        finally:
            if cpu:
                torch.set_num_threads(threads)
        return out.completion_ids, out.logprobs
