"""A multi-process launch is refused before anything loads (exit 2), never run as independent copies."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trl_ext.launch.processes import check_single_process, launched_processes
from trl_ext.registry import ConfigError


@pytest.mark.parametrize("env,expected", [
    ({}, (1, None)),
    ({"WORLD_SIZE": "1", "RANK": "0"}, (1, None)),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}, (2, "WORLD_SIZE")),
    ({"OMPI_COMM_WORLD_SIZE": "4"}, (4, "OMPI_COMM_WORLD_SIZE")),
    ({"PMI_SIZE": "3"}, (3, "PMI_SIZE")),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}, (8, "SLURM_NTASKS")),
    ({"SLURM_NTASKS": "8"}, (1, None)),  # an allocation of 8 tasks running one plain process
])  # fmt: skip
def test_launched_processes(env, expected):
    assert launched_processes(env) == expected


def test_check_single_process_names_the_launch():
    check_single_process("train.py", {"WORLD_SIZE": "1"})
    with pytest.raises(ConfigError, match=r"launched as 2 processes \(WORLD_SIZE=2\).*same run directory"):
        check_single_process("train.py", {"WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="not a process count"):
        check_single_process("train.py", {"WORLD_SIZE": "two"})


@pytest.mark.parametrize("cli", ["train.py", "eval_run.py", "sweep.py"])
def test_clis_exit_2_under_a_launcher(cli, monkeypatch, capsys):
    import trl_ext.cli_train
    import trl_ext.evaluate
    import trl_ext.sweep

    main = {"train.py": trl_ext.cli_train.main, "eval_run.py": trl_ext.evaluate.main, "sweep.py": trl_ext.sweep.main}
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main[cli](["--reward", "happy_binary"] if cli != "eval_run.py" else ["--model_path", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{cli}: error: {cli} was launched as 2 processes")


@pytest.mark.slow
def test_torchrun_two_processes_exit_nonzero_without_a_run(tmp_path):
    """The real launcher: the first rank to parse exits 2 before loading anything (torchrun then stops the other),
    and no run directory is written."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
         "train.py", "--reward", "happy_binary", "--max_steps", "1", "--no_wandb", "--output_dir", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "train.py: error: train.py was launched as 2 processes (WORLD_SIZE=2)" in proc.stderr
    assert "exitcode  : 2" in proc.stderr  # torchrun's root-cause report: the refusal, not a crash
    assert not out.exists()
