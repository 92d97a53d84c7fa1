"""Registration of the environments' flags and of SFT mode (`trl_ext.parts.FEATURES` "env", "sft"); the
environments' prompts are `trl_ext.env.source`."""

from __future__ import annotations

from trl_ext.env.args import EnvArgs
from trl_ext.parts import FEATURES, Feature
from trl_ext.sft import SFTArgs


class Env(Feature):
    """The environments' flags (levels, turns, advantage estimators, ``--no_think_rl``), read by the trainer's episode
    loop and estimators. Under FSDP2 the synchronous episode loop plays in lockstep over the processes (TRL generates
    from the sharded model, each forward a collective: `trl_ext.env.component`); the off-policy generator plays on its
    plain copy. Not under DeepSpeed: not run there."""

    what = "environments"
    flags = EnvArgs

    def supports(self, launch) -> str | None:
        return None if launch.sharding == "FSDP" else launch.unsharded(self.what)


class Sft(Feature):
    """``--mode sft``: TRL's SFTTrainer on an environment's BFS trajectories (`trl_ext.sft.run_sft`) instead of GRPO.
    Under FSDP2 it trains sharded, and the main process merges, saves and validates a plain copy loaded with the
    whole parameters gathered from the shards (`trl_ext.sft.gather_into`). Not under DeepSpeed: not run there."""

    what = "SFT mode"
    flags = SFTArgs

    def selected(self, run, cfg) -> bool:
        return cfg.mode == "sft"

    def supports(self, launch) -> str | None:
        return None if launch.sharding == "FSDP" else launch.unsharded(self.what)

    def check(self, plan) -> None:
        """SFT trains by --sft_epochs; a given --max_steps ends it at that step (HF's max_steps over epochs), said
        when both are given (a recipe's epochs and a short command-line run)."""
        import warnings

        if {"max_steps", "sft_epochs"} <= set(plan.flags or {}):
            warnings.warn(f"--mode sft: --max_steps {plan.cfg.max_steps} ends the run, before --sft_epochs "
                          f"{plan.cfg.sft_epochs:g} would", stacklevel=2)

    def run(self, plan) -> int | None:
        from trl_ext.sft import run_sft

        return run_sft(plan)


FEATURES.add("env", Env())
FEATURES.add("sft", Sft())
