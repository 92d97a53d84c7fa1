"""Run lifecycle: atomic checkpoints and resume (`checkpoints`), the run directory guard (`rundir`), saved rollouts
(`rollouts`), numeric-fault checks (`faults`) and the trainer plumbing that ties them to HF's Trainer (`mixin`)."""
