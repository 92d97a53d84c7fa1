"""The sabotage table's switches of runs: recipes, checkpoints, resumes, records, faults (``switches.py``;
the shared helpers are in ``replacements.py``): each function takes the original of a row's target and returns its
sabotaged replacement; its docstring says what the switch turns off. Replacements import what they need when called:
this file is imported at interpreter start-up."""

from __future__ import annotations


def recipe_flags_last(orig):
    """expand puts the recipes' flags after the command line's: the recipe overrides what was typed."""

    def expand(argv, parser):
        from trl_ext.runs.recipe import recipe_argv

        full, recipes = orig(argv, parser)
        mine = [a for r in recipes for a in recipe_argv(r, parser)]
        return full[len(mine):] + mine, recipes

    return expand


def no_reproduction_check(orig):
    """check_reproduces checks nothing: a run_config.yaml recipe runs into its own directory, or as another run when a
    default changed."""

    def check_reproduces(plan, recipe):
        plan.origin = recipe.origin

    return check_reproduces


def batches_not_skipped(orig):
    """skip_first_batches (transformers.trainer's) skips nothing: a resumed run starts the data order over."""

    def skip_first_batches(dataloader, num_batches=0):
        return dataloader

    return skip_first_batches


def reward_unguarded(orig):
    """guard_reward returns the reward function unwrapped: a computed NaN reaches TRL as a None would."""

    def guard_reward(fn, name, faults=None):
        return fn

    return guard_reward


def plain_write(orig):
    """write_atomic writes the file in place (open, write), with no temporary file and no rename."""

    def write_atomic(path, text):
        with open(path, "w") as f:
            f.write(text)

    return write_atomic


def marker_first(orig):
    """RunLifecycle._save_checkpoint writes the completion marker before the checkpoint's files."""

    def _save_checkpoint(self, model, trial, *args, **kwargs):
        import sys
        from pathlib import Path

        if self.args.should_save:
            ckpt = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{self.state.global_step}"
            ckpt.mkdir(parents=True, exist_ok=True)
            sys.modules["trl_ext.runs.lifecycle"].mark_complete(ckpt, self.state.global_step)
        return orig(self, model, trial, *args, **kwargs)

    return _save_checkpoint


def token_rows_of_process_0(orig):
    """Records.write_token_records gathers only process 0's token rows: every other process sends empty columns to
    the gather (the collective still runs; one process alone is unchanged)."""

    def write_token_records(self):
        acc = self.trainer.accelerator
        if acc.num_processes > 1 and not acc.is_main_process and self.table is not None:
            self.table.samples.clear()
        return orig(self)

    return write_token_records


def start_weights_without_origin(orig):
    """start_weights (train.py's record or check of the start weights) runs as if the run had no recipe run: a rerun
    from another run's run_config.yaml records its start weights without comparing them with that run's."""

    def start_weights(plan, model_path, teacher=None):
        origin = getattr(plan, "origin", None)
        plan.origin = None
        try:
            return orig(plan, model_path, teacher)
        finally:
            plan.origin = origin

    return start_weights
