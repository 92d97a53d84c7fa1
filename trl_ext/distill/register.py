"""Registration of teacher context distillation (`trl_ext.parts.FEATURES` "distill")."""

from __future__ import annotations

from trl_ext.distill.args import DistillArgs
from trl_ext.parts import FEATURES, Feature


class DistillPart(Feature):
    """Teacher context distillation and ``--eval_baseline``. Under FSDP2: the teacher is the sharded policy with its
    adapters disabled (every process scores its rows, FSDP2 gathers each layer), or ``--teacher_model``, an unsharded
    frozen copy on every process; ``--eval_baseline`` samples before the Trainer shards the policy. Not under
    DeepSpeed: not run there."""

    what = "distillation"
    flags = DistillArgs
    check_stage = 1  # the teacher is checked once the adapters and the generation are

    def supports(self, launch) -> str | None:
        return None if launch.sharding == "FSDP" else launch.unsharded(self.what)

    def check(self, plan) -> None:
        from trl_ext.distill.args import check_run_distill

        check_run_distill(plan.run, plan.cfg)

    def before_train(self, build, trainer) -> None:
        """``--eval_baseline``: the main process samples it; the others wait."""
        plan = build.plan
        if not plan.cfg.eval_baseline:
            return
        from trl_ext.data.register import prompt_source
        from trl_ext.distill.baseline import run_eval_baseline
        from trl_ext.launch.processes import barrier

        if build.main_process:
            run_eval_baseline(trainer, plan.run, plan.reward_config, prompt_source(plan.run))
        barrier()


FEATURES.add("distill", DistillPart())
