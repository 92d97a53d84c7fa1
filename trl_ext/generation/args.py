"""The ``--generation_backend`` flag (`GenerationArgs`).

The flag names the sampler that generates. ``--generation_backend trl`` (the default) leaves TRL's generation
untouched; with ``--max_async_level >= 1`` the generator thread samples with transformers' own model forward
(`trl_ext.generation.hf_sampler.HFSampler`, any causal LM). ``fast`` samples with `FastSampler` (its architectures):
it replaces the ``transformers.generate`` call of synchronous runs (`trl_ext.generation.component`) and is the
generator thread's sampler with ``--max_async_level >= 1`` (``trl_ext.generation.backends``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from trl import GRPOConfig

from trl_ext.generation.backends import SAMPLERS
from trl_ext.generation.fast import SUPPORTED_MODEL_TYPES
from trl_ext.registry import ConfigError

BACKENDS = tuple(SAMPLERS)  # the sync path: 'trl' = TRL's own generation, 'fast' = FastSampler
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
