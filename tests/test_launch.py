"""Launchers: the process count they announce; eval_run.py and sweep.py refuse several processes, and train.py
refuses, before anything loads (exit 2), every feature not yet verified on several processes (tests/test_procs.py
runs the allowed ones). Never independent copies."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from trl_ext.launch.command import torchrun_command
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
    with pytest.raises(ConfigError, match=r"launched as 2 processes \(WORLD_SIZE=2\).*same directory"):
        check_single_process("train.py", {"WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="not a process count"):
        check_single_process("train.py", {"WORLD_SIZE": "two"})


@pytest.mark.parametrize("cli", ["train.py", "eval_run.py", "sweep.py"])
def test_clis_exit_2_under_a_launcher(cli, monkeypatch, capsys):
    """eval_run.py and sweep.py run in one process; train.py refuses a feature not verified on several processes
    while it parses (before any process group or model)."""
    import trl_ext.cli_train
    import trl_ext.evaluate
    import trl_ext.sweep

    main = {"train.py": trl_ext.cli_train.main, "eval_run.py": trl_ext.evaluate.main, "sweep.py": trl_ext.sweep.main}
    argv = {"train.py": ["--reward", "happy_binary", "--use_transformers_continuous_batching"], "eval_run.py": ["--model_path", "x"],
            "sweep.py": ["--reward", "happy_binary"]}  # fmt: skip
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main[cli](argv[cli]) == 2
    err = capsys.readouterr().err
    if cli == "train.py":
        assert err.startswith("train.py: error: --use_transformers_continuous_batching: continuous-batching "
                              "generation runs on one process for now; this launch has 2 processes (WORLD_SIZE=2)")
    else:
        assert err.startswith(f"{cli}: error: {cli} was launched as 2 processes")


@pytest.mark.slow
def test_torchrun_refused_feature_exits_2_without_a_run(tmp_path):
    """The real launcher with a feature that runs on one process for now: every rank exits 2 while parsing (torchrun
    names exit code 2 as the root cause) and no run directory is written."""
    out = tmp_path / "out"
    cmd = torchrun_command(["train.py", "--reward", "happy_binary", "--use_transformers_continuous_batching",
                            "--max_steps", "1",
                            "--no_wandb", "--output_dir", str(out)])  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode != 0
    assert "train.py: error: --use_transformers_continuous_batching: continuous-batching generation runs on one " \
           "process for now; this launch has 2 processes (WORLD_SIZE=2)" in proc.stderr
    assert "exitcode  : 2" in proc.stderr  # torchrun's root-cause report: the refusal, not a crash
    assert not out.exists()


def test_end_processes_destroys_the_group(tmp_path):
    """train.py ends the process group before exit (a group left to interpreter finalization can abort the process
    with SIGABRT after its work is done); a no-op without one."""
    import torch.distributed as dist

    from trl_ext.launch.processes import end_processes, world

    end_processes()  # none started: nothing to do
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    assert dist.is_initialized()
    end_processes()
    assert not dist.is_initialized() and world() == (0, 1)
