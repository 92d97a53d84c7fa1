"""The benchmarks of a change, before and after, side by side: each benchmark script runs on an earlier checkout
(``--before``, a git worktree) and on this one, the order alternating from one benchmark to the next, and their
ratio lines (each measured side by side with its own baseline within one run, over its rounds) are printed together.

    git worktree add /tmp/before <commit>
    uv run python bench/before_after.py --before /tmp/before          # writes bench/results/before_after-<commit>.md

A run of the other checkout imports its own ``trl_ext`` (``PYTHONPATH`` first); the scripts themselves are this
checkout's, so both sides measure the same way.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHES = {  # script, its arguments, the ratio lines to keep
    "step": (["bench/bench_step.py", "--rounds", "5"], r"^ratio (ours|fast|vanilla2)/vanilla:"),
    "async": (["bench/bench_async.py", "--rounds", "5"], r"^ratio k=1 / k=0"),
    "routing": (["bench/bench_routing.py", "--rounds", "5"], r"^(ratio|whole-step ratio) "),
}


def commit_of(tree: Path) -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True, check=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=tree, capture_output=True,
                           text=True, check=True).stdout.strip()  # fmt: skip
    return out.stdout.strip() + ("+changes" if dirty else "")


def run(tree: Path, args: list[str], log: Path) -> str:
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    start = time.time()
    out = subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True)
    log.write_text(out.stdout + out.stderr)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args)} in {tree} failed ({out.returncode}); see {log}")
    print(f"  {tree}: {time.time() - start:.0f} s", flush=True)
    return out.stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, type=Path, help="the earlier checkout (a git worktree)")
    ap.add_argument("--benches", nargs="+", default=list(BENCHES), choices=list(BENCHES))
    a = ap.parse_args(argv)
    trees = {"before": a.before.resolve(), "after": ROOT}
    commits = {side: commit_of(tree) for side, tree in trees.items()}
    results = ROOT / "bench" / "results"
    lines = [f"# Benchmarks before ({commits['before']}) and after ({commits['after']})", ""]
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "?")
    lines += [f"CPU: {cpu}; load average at start {os.getloadavg()[0]:.2f}", ""]
    for i, name in enumerate(a.benches):
        script, pattern = BENCHES[name]
        order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
        print(f"{name}: {' then '.join(order)}", flush=True)
        kept = {}
        for side in order:
            script_args = [str(ROOT / script[0]), *script[1:]]
            out = run(trees[side], script_args, results / f"before_after-{name}-{side}.log")
            kept[side] = [ln for ln in out.splitlines() if re.search(pattern, ln)]
        lines += [f"## {name} ({' then '.join(order)})", ""]
        for side in ("before", "after"):
            lines += [f"{side}:", "", *[f"    {ln}" for ln in kept[side]], ""]
    lines += [f"load average at end {os.getloadavg()[0]:.2f}"]
    path = results / f"before_after-{commits['before'].removesuffix('+changes')}.md"
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
