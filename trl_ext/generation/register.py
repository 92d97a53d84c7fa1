"""Registration of the generation sources (`trl_ext.parts.GENERATION_SOURCES`): the fast sampler ("fast":
``--generation_backend fast``; `trl_ext.generation.fast.FastSampler`, hooked into TRL's generation by
`trl_ext.generation.component`), TRL's own generation ("trl") and its continuous batching ("continuous_batching",
selected by TRL's flag ``--use_transformers_continuous_batching``). vLLM's is ``trl_ext.vllm.register``, the off-policy
generator's ``trl_ext.offpolicy.register``."""

from __future__ import annotations

from trl_ext.parts import GENERATION_SOURCES, GenerationSource
from trl_ext.registry import ConfigError


def check_generation_backend(run, cfg) -> None:
    """``--generation_backend fast`` (synchronous runs and the off-policy generator alike) on an architecture it
    computes exactly, read from ``--model``'s config alone (`generation.families.fast_backend_refusal`)."""
    if cfg.generation_backend != "fast":
        return
    from trl_ext.generation.families import fast_backend_refusal
    from trl_ext.models.arch import model_config

    reason = fast_backend_refusal(model_config(run.model, cfg.trust_remote_code), disable_dropout=cfg.disable_dropout)
    if reason is not None:
        raise ConfigError(f"--generation_backend fast: {reason}")


FSDP_REASON = ("at k = 0 it samples from the policy, reading each projection's whole weight outside the model's "
               "forward, where FSDP2 holds shards: use --generation_backend trl (TRL generates from the sharded "
               "model), or --max_async_level >= 1 (the fast sampler then samples from the off-policy generator's "
               "copy, gathered whole from the shards)")


class FastPart(GenerationSource):
    """The fast sampler, synchronous or in the off-policy generator. Under FSDP2 only in the off-policy generator,
    whose copy is gathered whole from the shards (`FSDP_REASON`); not under DeepSpeed."""

    what = "the fast generation backend"
    flags = ("generation_backend",)

    def selected(self, run, cfg) -> bool:
        return cfg.generation_backend == "fast"

    def supports(self, launch) -> str | None:
        return None if launch.sharding == "FSDP" else launch.unsharded(self.what)

    def check_args(self, run, cfg) -> None:
        from trl_ext.launch.sharding import sharded_training

        if sharded_training(cfg) == "FSDP" and cfg.max_async_level < 1:
            raise ConfigError(f"--generation_backend fast: {self.what} has not been run under FSDP ({FSDP_REASON})")

    def check(self, plan) -> None:
        check_generation_backend(plan.run, plan.cfg)


GENERATION_SOURCES.add("fast", FastPart())


class TrlGeneratePart(GenerationSource):
    """TRL's synchronous generation (``--generation_backend trl``, ``--max_async_level 0``): supported everywhere."""

    def selected(self, run, cfg) -> bool:
        return cfg.generation_backend == "trl" and cfg.max_async_level == 0


class TrlFlagGenerationPart(GenerationSource):
    """One of TRL's other ways to generate, selected by its flag: not yet run on several processes nor sharded."""

    def __init__(self, flag: str, what: str):
        self.flags, self.what = (flag,), what

    def supports(self, launch) -> str | None:
        return launch.one_process(self.what) or launch.unsharded(self.what)


GENERATION_SOURCES.add("trl", TrlGeneratePart())
GENERATION_SOURCES.add("continuous_batching", TrlFlagGenerationPart("use_transformers_continuous_batching",
                                                                "continuous-batching generation"))
