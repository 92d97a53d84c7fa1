"""Samples/s of one training run on 2 CPU processes x 1 thread (torchrun, DDP over gloo) against 1 process x 2
threads, the same global batch, in alternating rounds.

Each round runs both arms as train.py processes on the builtin model (happy_binary, global batch ``--batch`` =
``--batch / 2`` per process on 2 processes, 4 generations, 32 tokens, ``--steps`` steps) and reads the wall time of the
training loop from each run's ``run_summary.json`` (model build and process start excluded). Printed per round:
samples/s of each arm and their ratio; then min / median / max of the ratios, the load average before and after and
the CPU model.

    uv run python bench/bench_procs.py --rounds 5            # no goal: reported in docs/processes.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


def run(arm: str, out: Path, steps: int, batch: int, port: int) -> float:
    """Samples/s of one run: ``steps * batch`` completions over the training loop's wall time."""
    flags = ["--reward", "happy_binary", "--max_steps", str(steps), "--num_generations", "4",
             "--max_completion_length", "32", "--no_wandb", "--save_steps", "100000", "--logging_steps", "100000",
             "--output_dir", str(out)]  # fmt: skip
    if arm == "1x2":
        cmd = [sys.executable, "train.py", *flags, "--batch_size", str(batch)]
        env = {**os.environ, "OMP_NUM_THREADS": "2"}
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
               "train.py", *flags, "--batch_size", str(batch // 2)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{arm} failed:\n{proc.stderr[-3000:]}")
    (summary,) = out.glob("*/run_summary.json")
    return steps * batch / json.loads(summary.read_text())["wall_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16, help="global completions per step (even)")
    a = ap.parse_args()
    if a.batch % 2 or a.rounds < 1:
        raise SystemExit("--batch must be even and --rounds >= 1")
    load_before = os.getloadavg()
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            order = ["1x2", "2x1"] if r % 2 == 0 else ["2x1", "1x2"]  # alternate which arm goes first
            sps = {arm: run(arm, Path(tmp) / f"r{r}-{arm}", a.steps, a.batch, 29600 + r) for arm in order}
            ratios.append(sps["2x1"] / sps["1x2"])
            print(f"round {r + 1}: 1 process x 2 threads {sps['1x2']:.1f} samples/s, 2 processes x 1 thread "
                  f"{sps['2x1']:.1f} samples/s, ratio {ratios[-1]:.3f}", flush=True)  # fmt: skip
    print(f"samples/s ratio 2 processes x 1 thread / 1 process x 2 threads over {a.rounds} rounds: min "
          f"{min(ratios):.3f} median {statistics.median(ratios):.3f} max {max(ratios):.3f}")  # fmt: skip
    print(f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}; CPU: {cpu_model()}")


if __name__ == "__main__":
    main()
