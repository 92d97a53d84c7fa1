"""Registration of teacher context distillation (`trl_ext.parts.FEATURES` "distill")."""

from __future__ import annotations

from trl_ext.distill.args import DistillArgs
from trl_ext.parts import FEATURES, Feature


class Distill(Feature):
    """Teacher context distillation and ``--eval_baseline``. Not under FSDP / DeepSpeed: the teacher scores with the
    policy's adapters disabled, on whole parameters."""

    what = "distillation"
    flags = DistillArgs
    check_stage = 1  # the teacher is checked once the adapters and the generation are

    def supports(self, launch) -> str | None:
        return launch.unsharded(self.what)

    def check(self, plan) -> None:
        from trl_ext.distill.args import check_run_distill

        check_run_distill(plan.run, plan.cfg)

    def before_train(self, build, trainer) -> None:
        """``--eval_baseline``: the main process samples it; the others wait."""
        plan = build.plan
        if not plan.cfg.eval_baseline:
            return
        from trl_ext.distill.baseline import run_eval_baseline
        from trl_ext.launch.processes import barrier
        from trl_ext.prompts import prompt_source

        if build.main_process:
            run_eval_baseline(trainer, plan.run, plan.reward_config, prompt_source(plan.run))
        barrier()


FEATURES.add("distill", Distill())
