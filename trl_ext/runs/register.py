"""Registration of saved rollouts (`trl_ext.parts.FEATURES` "saved_rollouts": ``--save_rollouts``,
`trl_ext.runs.rollouts`)."""

from __future__ import annotations

from trl_ext.parts import FEATURES, Feature


class SavedRolloutsPart(Feature):
    """Every trained sample written to ``{run_dir}/rollouts/`` (the trainer reads the flag). Under FSDP2 too (rows, not
    parameters: tests/test_procs_runs.py); not under DeepSpeed: not run there yet."""

    what = "saved rollouts"
    flags = ("save_rollouts", "token_records_every")

    def supports(self, launch) -> str | None:
        return None if launch.sharding == "FSDP" else launch.unsharded(self.what)


FEATURES.add("saved_rollouts", SavedRolloutsPart())
