"""Registration of the model's adapters and builtin models (`trl_ext.parts.FEATURES` "lora", "rebuild_builtin")."""

from __future__ import annotations

from trl_ext.parts import FEATURES, Feature


class LoraPart(Feature):
    """PEFT LoRA (``--lora_rank``) and the adapter targets of dual LoRA: checked against ``--model``'s structure (its
    config only; `routing.args.check_run_adapters` sets ``run.lora_targets``)."""

    what = "LoRA adapters"

    def selected(self, run, cfg) -> bool:
        return run.lora_rank > 0 or cfg.dual_lora or run.lora_target_modules is not None

    def check(self, plan) -> None:
        from trl_ext.routing.args import check_run_adapters

        check_run_adapters(plan.run, plan.cfg)

    def contribute(self, build) -> None:
        run = build.plan.run
        if run.lora_rank:  # PEFT LoRA (dual adapters are built by "routing")
            from peft import LoraConfig

            build.kwargs["peft_config"] = LoraConfig(r=run.lora_rank, lora_alpha=run.lora_alpha, task_type="CAUSAL_LM",
                                                     **run.lora_targets.peft_kwargs())  # fmt: skip


class RebuildBuiltinPart(Feature):
    """``--rebuild_builtin``: one process only, as every process would rebuild the model into the same directory."""

    what = "rebuilding the builtin model (every process would rebuild it)"
    flags = ("rebuild_builtin",)

    def supports(self, launch) -> str | None:
        return launch.one_process(self.what)


FEATURES.add("lora", LoraPart())
FEATURES.add("rebuild_builtin", RebuildBuiltinPart())
