"""The combination matrix (tests/test_matrix.py: {full, PEFT LoRA, routed dual LoRA} x {k = 0, k = 1 strict, k = 1
in-flight} x {story reward, single-turn env, multi-turn env} x {distillation off, on}) under FSDP2 on 2 CPU processes:
the column's pairwise design (9 cells, `test_matrix.pairwise_cells`; all 54 with ``TRL_EXT_FULL_MATRIX=1``), every
cell one run of the one-process cells' global batch with ``--fsdp``, keeping the same invariants. The driver
(``uv run torchrun --nproc_per_node 2 tests/test_fsdp_matrix.py OUT_DIR``) runs the cells one after another in each
process through train.py's ``main`` (tests/test_matrix.py's `run_all_cells`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_matrix import column_cells, run_all_cells, run_matrix_on_two_processes

FSDP = ("--fsdp",)
FSDP_SHIFT = 1  # the column's pairwise design (test_matrix.pairwise_cells)


@pytest.mark.slow
def test_every_cell_on_two_fsdp2_processes(builtin_path, tmp_path):
    """The column's cells under `torchrun --nproc_per_node 2` with FSDP2: each run to its checkpoint, its header naming
    FSDP2, its saved rollouts (both processes' rows) keeping the invariants."""
    cells = column_cells(FSDP_SHIFT)
    run_matrix_on_two_processes(__file__, tmp_path, "x2 --fsdp", timeout=1200, cells=cells)
    logs = list(tmp_path.glob("*/*/train.log"))
    assert len(logs) == len(cells) and all("FSDP2: " in p.read_text() for p in logs)


def environment_kept(main):
    """``main`` restoring ``os.environ`` after each run: transformers' TrainingArguments exports the FSDP settings
    (``ACCELERATE_USE_FSDP`` ...) into the environment, where the next in-process run's parse would read them."""
    import functools
    import os

    @functools.wraps(main)
    def run(argv):
        saved = dict(os.environ)
        try:
            return main(argv)
        finally:
            os.environ.clear()
            os.environ.update(saved)

    return run


if __name__ == "__main__":  # uv run torchrun --nproc_per_node 2 tests/test_fsdp_matrix.py OUT_DIR
    import trl_ext.cli_train as cli
    from trl_ext.launch.processes import end_processes

    cli.main = environment_kept(cli.main)  # run_all_cells calls cli.main
    failed = run_all_cells(Path(sys.argv[1]), column_cells(FSDP_SHIFT), extra=FSDP)
    end_processes()
    sys.exit(1 if failed else 0)
