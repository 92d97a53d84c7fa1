"""Registration of off-policy training (`trl_ext.parts.FEATURES` "offpolicy") and of its generator
(`trl_ext.parts.GENERATION_SOURCES` "offpolicy"): with ``--max_async_level >= 1`` a thread samples with a copy of
the policy (transformers' forward, or the fast sampler with ``--generation_backend fast``;
`trl_ext.offpolicy.worker`)."""

from __future__ import annotations

from trl_ext.offpolicy.args import OffPolicyArgs
from trl_ext.parts import FEATURES, GENERATION_SOURCES, Feature, GenerationSource
from trl_ext.registry import ConfigError


class OffPolicyPart(Feature):
    """The off-policy loss and the asynchronous generator (``--max_async_level``; the trainer reads its flags). Under
    FSDP2 the generator's plain copy is loaded with whole tensors gathered from the shards at its start and at each
    publish (`trl_ext.offpolicy.sharded`); not under DeepSpeed (not run there)."""

    what = "off-policy training"
    flags = OffPolicyArgs

    def supports(self, launch) -> str | None:
        return None if launch.sharding == "FSDP" else launch.unsharded(self.what)


FEATURES.add("offpolicy", OffPolicyPart())


def check_offpolicy_dropout(run, cfg) -> None:
    """With ``--max_async_level >= 1`` the generator samples without dropout while the trainer's forward (training
    mode) applies it: the importance ratio would differ from 1 at lag 0 and the masks would drop tokens for no lag.
    Module dropouts (GPT-2's ``resid_pdrop`` ...) need ``--disable_dropout`` (TRL zeroes them); a functional attention
    dropout (``attention_dropout``, which ``--disable_dropout`` leaves on) must be 0 in the model's config."""
    if cfg.max_async_level < 1:
        return
    from trl_ext.generation.families import FUNCTIONAL_DROPOUTS
    from trl_ext.models.arch import architecture_of, model_config

    config = model_config(run.model, cfg.trust_remote_code)
    functional = [f"{k}={getattr(config, k)}" for k in FUNCTIONAL_DROPOUTS if getattr(config, k, 0.0)]
    if functional:
        raise ConfigError(f"--max_async_level >= 1: --model's config sets {', '.join(functional)}, which the trainer's "
                          "forward applies and the generator does not (the importance ratio would not be 1 at lag 0; "
                          "--disable_dropout does not reach it): set it to 0 in the model's config.json")
    modules = () if cfg.disable_dropout else architecture_of(config).dropouts
    if modules:
        raise ConfigError(f"--max_async_level >= 1: --model has active dropout ({', '.join(modules[:3])}"
                          f"{', ...' if len(modules) > 3 else ''}), which the trainer's forward applies and the "
                          "generator does not (the importance ratio would not be 1 at lag 0): pass --disable_dropout")


class OffPolicyGeneratorPart(GenerationSource):
    """The generator thread of ``--max_async_level >= 1``. Under FSDP2 its plain copy is made before the Trainer
    shards the policy and loaded with the gathered whole weights (`trl_ext.offpolicy.sharded`); not under DeepSpeed."""

    what = "the off-policy generator"
    flags = ("max_async_level",)

    def selected(self, run, cfg) -> bool:
        return cfg.max_async_level >= 1

    def supports(self, launch) -> str | None:
        return None if launch.sharding == "FSDP" else launch.unsharded(self.what)

    def check(self, plan) -> None:
        check_offpolicy_dropout(plan.run, plan.cfg)


GENERATION_SOURCES.add("offpolicy", OffPolicyGeneratorPart())
