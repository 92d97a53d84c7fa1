"""Shared fixtures: one builtin model per test session, in a persistent cache.

OMP_WAIT_POLICY=PASSIVE is set before any test module imports torch: with the default (spinning)
policy, 2-thread torch runs several times slower when other processes share the cores.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Every test runs on the embedded models and data: no test reaches a model hub. Set here, before huggingface_hub is
# imported (it reads the variable once) and for every subprocess, whatever the caller exported: with the hub
# unreachable but not marked offline, each hub look-up waits out its network retries (~45 s for one test).
os.environ["HF_HUB_OFFLINE"] = "1"
# What sweep.py gives its runs (trl_ext.sweep.child_env) is the tests' own environment, so that the fork server
# (tests/zygote.py) can start a sweep's runs too: it forks only where no variable read at import differs.
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the suite runs on CPU on any machine (sweep.py's slots: CPU ones)
os.environ["PYTHONUNBUFFERED"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# One thread for the in-process tests (tiny tensors: faster, and the same in every test order);
# train.py subprocesses choose their own.
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def builtin_cache():
    """Pin TRL_EXT_CACHE (the caller's value, else the default cache dir) for the session and its subprocesses.

    The cache persists across runs, so the builtin model is built at most once per CI run (and not at all
    when the quickstart already built it on this machine).
    """
    from trl_ext.models.builtin import CACHE_ENV, cache_dir

    previous = os.environ.get(CACHE_ENV)
    path = cache_dir()
    os.environ[CACHE_ENV] = str(path)
    yield path
    if previous is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = previous


@pytest.fixture(scope="session")
def builtin_path(builtin_cache):
    """The built builtin model directory (built once, ~3 minutes on 2 cores, if not cached)."""
    from trl_ext.models.builtin import ensure_builtin

    return ensure_builtin()


@pytest.fixture
def train_cli_error(capsys, monkeypatch):
    """``run(*argv)``: train.py's main on ``argv`` must exit 2 with a one-line ``train.py: error: ...``
    before `run_training` (which loads the model) is reached; returns the error line."""
    import trl_ext.cli_train as cli

    monkeypatch.setattr(cli, "run_training", lambda plan: pytest.fail("run_training reached"))

    def run(*argv: str) -> str:
        assert cli.main(list(argv)) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("train.py: error: "), err
        return err

    return run


@pytest.fixture(scope="session")
def fsdp_steps(tmp_path_factory):
    """One SGD step of every FSDP2 equivalence variant on 1 process and on 2 FSDP2 processes, run once per session
    (tests/test_fsdp_features.py's `run_fsdp_steps`); tests reading it carry ``xdist_group("fsdp_steps")``."""
    from test_fsdp_features import run_fsdp_steps

    return run_fsdp_steps(tmp_path_factory.mktemp("fsdp_steps"))


def _vllm_runs(request, tmp_path_factory, fixture: str, procs: int) -> Path:
    """Run once, in one process (or one torchrun launch of ``procs``), every tests/vllm_runs.py run named by the
    ``vllm_runs(NAME...)`` markers of the session's selected tests that read ``fixture``; the runs' directory."""
    import sys

    import zygote

    names = sorted({name for item in request.session.items if fixture in getattr(item, "fixturenames", ())
                    for marker in item.iter_markers("vllm_runs") for name in marker.args})  # fmt: skip
    out = tmp_path_factory.mktemp(fixture)
    argv = [Path(__file__).with_name("vllm_runs.py"), out, *names]
    if procs > 1:
        proc = zygote.torchrun(argv, nproc=procs, cwd=ROOT, timeout=1500)
    else:
        proc = zygote.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=1500)
    (out / "driver.log").write_text(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return out


@pytest.fixture(scope="session")
def vllm_runs(request, tmp_path_factory, builtin_path):
    """The one-process vLLM runs (tests/vllm_runs.py), run once per session; tests reading it carry
    ``xdist_group("vllm_runs")`` and ``vllm_runs(NAME...)``."""
    return _vllm_runs(request, tmp_path_factory, "vllm_runs", 1)


@pytest.fixture(scope="session")
def vllm_runs_x2(request, tmp_path_factory, builtin_path):
    """The two-process vLLM runs (tests/vllm_runs.py under torchrun), run once per session; tests reading it carry
    ``xdist_group("vllm_runs_x2")`` and ``vllm_runs(NAME...)``."""
    return _vllm_runs(request, tmp_path_factory, "vllm_runs_x2", 2)


LONGEST_FIRST = {
    "test_vllm.py::test_resume_k1_engine_loads_the_restored_policy": 108,  # the first reader of `vllm_runs`
    "test_vllm.py::test_two_processes": 60,  # of `vllm_runs_x2`
    "test_fsdp_matrix.py::test_every_cell_on_two_fsdp2_processes": 65,
    "test_preemption.py::test_sigterm_two_processes_then_resume_matches_uninterrupted": 47,
    "test_matrix.py::test_every_cell_on_two_processes": 36,
    "test_procs.py::test_torchrun_train_py_is_one_run": 30,
    "test_procs.py::test_a_failing_rank_ends_the_launch": 30,
    "test_procs.py::test_a_killed_rank_ends_the_launch": 28,
    "test_resume_e2e.py::test_sweep_resumes_a_killed_child": 24,
    "test_offpolicy_study.py::test_parallel_evaluation_equals_the_in_process_one": 22,
    "test_fsdp.py::test_fsdp2_equals_one_process": 22,  # the first reader of `fsdp_steps`
    "test_sweep.py::test_grid_on_builtin_with_one_failure": 21,
    "test_train_cli.py::test_subprocess_exit_code_and_unknown_flag": 17,
    "test_offpolicy_study.py::test_study_sweeps_plan_the_seed_arms": 11,
}
"""Seconds the longest tests took on 2 cores (bench/results/durations-slow.log, durations-vllm.log): they start first,
so that no worker idles at the end of a session while another finishes a long test (longest processing time
first)."""


def pytest_collection_modifyitems(config, items):
    """Start the longest tests first (`LONGEST_FIRST`); the rest keep their order."""

    def seconds(item) -> float:
        name = item.nodeid.split("@")[0].rsplit("/", 1)[-1].split("[")[0]
        return LONGEST_FIRST.get(name, 0)

    items.sort(key=lambda item: -seconds(item))
