"""Refuse a multi-process launch that the trainer would not use as one run.

Under ``torchrun --nproc_per_node 2 train.py`` (what ``accelerate launch`` runs on CPU) each process would otherwise
train alone: transformers' Trainer warns that the process group is initialised but ``parallel_mode`` is not
distributed, and both copies write train.log, checkpoints and run_summary.json into the same run directory. Until
every extension runs on several processes, such a launch is a configuration error (exit 2), never two runs.

Launchers announce the world size in the environment: torchrun and accelerate (``WORLD_SIZE``), Open MPI
(``OMPI_COMM_WORLD_SIZE``), MPICH / Intel MPI (``PMI_SIZE``), Slurm's srun (``SLURM_NTASKS`` with ``SLURM_PROCID``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from trl_ext.registry import ConfigError

WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def launched_processes(environ: Mapping[str, str] | None = None) -> tuple[int, str | None]:
    """(number of processes the launcher started, the variable that says so); (1, None) for a plain start."""
    env = os.environ if environ is None else environ
    for name in WORLD_SIZE_VARIABLES:
        value = env.get(name)
        if value is not None:
            try:
                n = int(value)
            except ValueError:
                raise ConfigError(f"{name}={value!r} is not a process count") from None
            if n > 1:
                return n, name
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        return int(env["SLURM_NTASKS"]), "SLURM_NTASKS"
    return 1, None


def check_single_process(cli: str, environ: Mapping[str, str] | None = None) -> None:
    """ConfigError when ``cli`` (e.g. "train.py") was started as one of several processes."""
    n, name = launched_processes(environ)
    if n > 1:
        raise ConfigError(
            f"{cli} was launched as {n} processes ({name}={n}) but runs in one process: each process would train "
            f"its own copy into the same run directory. Start it once (`uv run {cli} ...`); several processes "
            "are not supported yet"
        )
