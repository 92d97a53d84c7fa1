"""The combination matrix (every extension on every task): {full, PEFT LoRA, routed dual LoRA} x {k = 0, k = 1 strict,
k = 1 in-flight} x {story reward, single-turn env, multi-turn env} x {distillation off, on}. Every cell either runs 2
steps on the builtin models and keeps its invariants, or is rejected at parse time (exit 2) with a stated reason.
The one-process column runs in-process through train.py's ``main`` a strength-3 design of 27 cells (`triple_cells`:
any three factors meet in every combination of their levels): ``uv run pytest -m slow tests/test_matrix.py``. The
other columns (2 processes here, FSDP2 and vLLM in their own files) run a pairwise design of 9 cells each
(`column_cells`: every level of every factor meets every level of every other factor in some cell, and each column
runs different cells), or all 54 with ``TRL_EXT_FULL_MATRIX=1``; the 2-process column by hand:
``uv run torchrun --nproc_per_node 2 tests/test_matrix.py OUT_DIR``.
"""

from __future__ import annotations

import itertools
import json
import math
import os

import pytest

import trl_ext.cli_train as cli
from trl_ext.runs.rollouts import load_rollouts

ADAPTERS = {"full": [], "lora": ["--lora_rank", "4"],
            "routed": ["--gradient_routing", "--routing_mode", "shared", "--lora_config", "r4",
                       "--eval_routing_steps", "0"]}  # fmt: skip
ASYNC = {"k0": [], "k1_strict": ["--max_async_level", "1", "--strict_async_level"], "k1_inflight": ["--max_async_level", "1"]}
TASKS = {
    "story": ["--reward", "sentence_length_5_with_happy", "--max_completion_length", "16"],
    "env_single": ["--env", "two_armed_bandit", "--model", "builtin_env", "--max_completion_length", "24"],
    "env_multi": ["--env", "frozenlake", "--model", "builtin_env", "--max_turns", "2", "--max_completion_length", "64"],
}
DISTILL = {"off": [], "on": ["--teacher_tau", "0.5", "--student_tau", "0.5", "--teacher_context", "A happy story."]}
ENV_DETECTOR = ["--rh_detector", "env_loophole"]  # routed env cells: the detector judging the episodes' step info
REJECTED: dict[tuple[str, str, str], str] = {
    # (adapter, k, task) -> the reason train.py gives (exit 2 before any model loads); every cell runs today
}
CELLS = list(itertools.product(ADAPTERS, ASYNC, TASKS, DISTILL))
FULL_ENV = "TRL_EXT_FULL_MATRIX"
"""Set to 1: every column runs all 54 cells instead of its pairwise design."""


def pairwise_cells(shift: int) -> list[tuple[str, str, str, str]]:
    """A pairwise (strength-2) covering design of the matrix in 9 cells: the orthogonal array L9(3^4), rows
    ``(i, j, i + j, i + 2j) mod 3`` (Hedayat, Sloane & Stufken, "Orthogonal Arrays", 1999, ch. 3), with the 4th
    factor's third level folded onto distillation on or off. ``shift`` (0, 1, 2...) relabels the off-policy and task
    levels and picks the fold, so each column runs different cells and the columns together cover more triples."""
    names = [list(ADAPTERS), list(ASYNC), list(TASKS), list(DISTILL) + [list(DISTILL)[shift % 2]]]
    rows = [(i, j, (i + j) % 3, (i + 2 * j) % 3) for i in range(3) for j in range(3)]
    return [(names[0][a], names[1][(k + shift) % 3], names[2][(t + 2 * shift) % 3], names[3][d]) for a, k, t, d in rows]


def triple_cells() -> list[tuple[str, str, str, str]]:
    """A strength-3 covering design of the matrix in 27 cells (the one-process column): every (adapter, off-policy
    mode, task), with distillation on where ``a + k + t`` is odd. Any three factors meet in every combination of their
    levels: the three 3-level ones by construction, and two of them with distillation because the third takes both
    parities over its three levels (checked by `test_triple_design_covers_every_triple`)."""
    names = [list(ADAPTERS), list(ASYNC), list(TASKS), list(DISTILL)]
    return [(names[0][a], names[1][k], names[2][t], names[3][(a + k + t) % 2])
            for a, k, t in itertools.product(range(3), repeat=3)]  # fmt: skip


def column_cells(shift: int) -> list[tuple[str, str, str, str]]:
    """The cells a column of the matrix runs: its pairwise design, or all 54 with ``TRL_EXT_FULL_MATRIX=1``."""
    return CELLS if os.environ.get(FULL_ENV) == "1" else pairwise_cells(shift)


def cell_argv(adapter: str, k: str, task: str, distill: str, out, processes: int = 1, extra=()) -> list[str]:
    """train.py's flags of a cell: 2 steps of 8 completions (global: ``8 // processes`` per process), then ``extra``
    (the vLLM column: ``--use_vllm``, tests/test_vllm_matrix.py)."""
    argv = [*TASKS[task], *ADAPTERS[adapter], *ASYNC[k], *DISTILL[distill], *extra, "--batch_size", str(8 // processes),
            "--num_generations", "4", "--max_steps", "2", "--logging_steps", "1", "--save_steps", "2", "--lr", "1e-4",
            "--no_wandb", "--save_rollouts", "--output_dir", str(out)]  # fmt: skip
    if adapter == "routed" and task != "story":
        argv += ENV_DETECTOR
    return argv


def check_cell(run_dir, adapter: str, k: str, task: str, distill: str, rows: int = 16) -> None:
    """The invariants of a cell's finished run: both steps logged with finite losses, every trained sample saved with a
    finite advantage, environment tokens kept out of training, versions within the lag (k = 1), routing labels
    exactly for routed runs, teacher and student log-prob sums exactly with distillation."""
    ro = load_rollouts(run_dir)
    state = json.loads((run_dir / "checkpoint-2" / "trainer_state.json").read_text())
    logs = [r for r in state["log_history"] if "loss" in r]
    assert [r["step"] for r in logs] == [1, 2] and all(math.isfinite(r["loss"]) for r in logs)
    assert len(ro) == rows and all(math.isfinite(a) for a in ro["advantage"])
    if task == "env_multi":  # environment tokens are never trained on
        assert any(s["source"] == "env" for row in ro for s in row["segments"])
    if k != "k0":
        for row in ro:
            assert max(row["step"] - 2, 0) <= row["policy_version_min"] <= row["policy_version_max"] <= row["step"] - 1
        assert all(r["offpolicy/policy_lag_max"] <= 1 for r in logs)
    else:
        assert set(ro["policy_version_min"]) == {None}
    assert (None not in ro["is_bad"]) == (adapter == "routed")
    if distill == "on":
        assert None not in ro["teacher_logprob_sum"] and None not in ro["student_logprob_sum"]


ONE_PROCESS = CELLS if os.environ.get(FULL_ENV) == "1" else triple_cells()
"""The one-process column's cells: its strength-3 design, or all 54 with ``TRL_EXT_FULL_MATRIX=1``."""


@pytest.mark.slow
@pytest.mark.parametrize("adapter,k,task,distill", ONE_PROCESS, ids=["-".join(c) for c in ONE_PROCESS])
def test_cell(builtin_path, tmp_path, capsys, adapter, k, task, distill):
    argv = cell_argv(adapter, k, task, distill, tmp_path)
    reason = REJECTED.get((adapter, k, task))
    if reason is not None:
        assert cli.main(argv) == 2 and reason in capsys.readouterr().err
        return
    assert cli.main(argv) == 0
    (run_dir,) = tmp_path.iterdir()
    check_cell(run_dir, adapter, k, task, distill)


def test_triple_design_covers_every_triple():
    """The one-process column's design meets every combination of levels of any three factors; 27 distinct cells."""
    cells = triple_cells()
    levels = [list(ADAPTERS), list(ASYNC), list(TASKS), list(DISTILL)]
    assert len(set(cells)) == 27 and set(cells) <= set(CELLS)
    for a, b, c in itertools.combinations(range(4), 3):
        assert {(x[a], x[b], x[c]) for x in cells} == set(itertools.product(levels[a], levels[b], levels[c]))


def test_pairwise_designs_cover_every_pair_and_differ():
    """Each column's design meets every level of every factor with every level of every other factor; the three
    columns' designs share no cell (27 of the 54 between them)."""
    designs = [pairwise_cells(shift) for shift in range(3)]
    levels = [list(ADAPTERS), list(ASYNC), list(TASKS), list(DISTILL)]
    for cells in designs:
        assert len(cells) == 9 and set(cells) <= set(CELLS)
        for a, b in itertools.combinations(range(4), 2):
            assert {(c[a], c[b]) for c in cells} == set(itertools.product(levels[a], levels[b])), (a, b)
    assert len(set().union(*designs)) == 27  # the three columns run different cells


@pytest.mark.slow
def test_every_cell_on_two_processes(builtin_path, tmp_path):
    """The matrix's 2-process column under `torchrun --nproc_per_node 2` (gloo), its pairwise design (or every cell
    with ``TRL_EXT_FULL_MATRIX=1``): each cell one run of the one-process cells' global batch (4 completions per
    process), its checkpoint and its saved rollouts (both processes' rows) keeping the invariants."""
    run_matrix_on_two_processes(__file__, tmp_path, "x2", timeout=900, cells=column_cells(DDP_SHIFT))


DDP_SHIFT = 0
"""The pairwise design of the 2-process column (`pairwise_cells`); FSDP2 and vLLM take 1 and 2."""


def run_matrix_on_two_processes(script: str, out, label: str, timeout: int, cells) -> None:
    """``torchrun --nproc_per_node 2 script out`` (a script whose ``__main__`` runs `run_all_cells` on ``cells``), its
    ranks forked with torchrun's environment (`zygote.torchrun`; the launcher's own tests are tests/test_procs.py): it
    exits 0 and prints one ``[matrix <label>] cell: ok`` line per cell."""
    from pathlib import Path

    import zygote

    root = Path(__file__).resolve().parents[1]
    proc = zygote.torchrun([script, str(out)], cwd=root, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    lines = [line for line in proc.stdout.splitlines() if line.startswith(f"[matrix {label}]")]
    assert len(lines) == len(cells) and all(": ok (" in line for line in lines), lines
    assert {line.split("] ")[1].split(":")[0] for line in lines} == {"-".join(c) for c in cells}, lines


def run_all_cells(out: Path, cells, extra=(), check=check_cell) -> int:
    """``cells`` through train.py's ``main`` in this process, one after another (under ``torchrun --nproc_per_node
    2``: on 2 processes, 4 completions each, the global batch of the one-process cells), with train.py flags ``extra``;
    the main process checks each finished run (``check``) and prints one line per cell. Returns the number of failed
    cells."""
    import os
    import time
    import traceback

    rank, n = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    failed = 0
    for cell in cells:
        start, cell_out = time.time(), out / "-".join(cell)
        code = cli.main(cell_argv(*cell, cell_out, processes=n, extra=extra))
        status = f"exit {code}"
        if code == 0 and rank == 0:
            try:
                (run_dir,) = cell_out.iterdir()
                check(run_dir, *cell)
                status = "ok"
            except AssertionError:
                status = "invariant failed: " + traceback.format_exc().splitlines()[-2].strip()
        failed += status != "ok" and rank == 0
        if rank == 0:
            label = f"x{n} {' '.join(extra)}".strip()
            print(f"[matrix {label}] {'-'.join(cell)}: {status} ({time.time() - start:.1f} s)", flush=True)
    return failed


if __name__ == "__main__":  # uv run torchrun --nproc_per_node 2 tests/test_matrix.py OUT_DIR
    import sys
    from pathlib import Path

    from trl_ext.launch.processes import end_processes

    failed = run_all_cells(Path(sys.argv[1]), column_cells(DDP_SHIFT))
    end_processes()
    sys.exit(1 if failed else 0)
