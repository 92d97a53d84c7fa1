"""Where the seconds of one short in-process train.py run go: a matrix cell (tests/test_matrix.py: PEFT LoRA, k = 0,
story reward, 2 steps of 8 completions) run once to warm the process, then again under cProfile; prints both wall
times and the entries with the largest cumulative time.

    uv run python bench/profile_run.py | tee bench/results/profile_run.txt
"""

from __future__ import annotations

import cProfile
import contextlib
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    import torch
    from test_matrix import cell_argv

    import trl_ext.cli_train as cli

    torch.set_num_threads(1)
    out = Path(tempfile.mkdtemp())
    cell = ("lora", "k0", "story", "off")
    with contextlib.redirect_stdout(io.StringIO()):  # the runs' own output
        start = time.time()
        assert cli.main(cell_argv(*cell, out / "warm")) == 0
        warm = time.time() - start
        profile = cProfile.Profile()
        start = time.time()
        profile.enable()
        assert cli.main(cell_argv(*cell, out / "profiled")) == 0
        profile.disable()
        profiled = time.time() - start
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(40)
    print(f"cell {'-'.join(cell)}: first run {warm:.2f} s, second run (profiled) {profiled:.2f} s")
    print(text.getvalue().replace(str(ROOT) + "/", "").replace(sys.prefix + "/", ""))


if __name__ == "__main__":
    main()
