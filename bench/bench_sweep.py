"""Aggregate training throughput of concurrent sweep runs over a single run, on CPU.

Both phases go through trl_ext.sweep's scheduler, so the children get the thread settings a sweep gives
them: first one train.py run alone (``--parallel 1``: all cores' threads), then ``--runs`` runs at once
(``--parallel runs``: ``max(1, cores // runs)`` threads each). Same config, seeds differ per run.

Steps/s of a run counts trainer.train() only (run_summary.json's ``wall_s``): process start-up and model
loading are excluded. The concurrent aggregate is total steps / (last train end - first train start), with
end = run_summary.json's mtime and start = end - wall_s, so any start-up skew between the concurrent
runs counts against them.

The two phases alternate ``--rounds`` times; the ratio is taken per round and printed as min / median / max.

    uv run python bench/bench_sweep.py              # prints aggregate / single (goal >= 1.7: 4 runs, 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from trl_ext.sweep import SweepArgs, build_spec, execute, plan_runs, resolve_resources


def phase(out: Path, seeds: list[int], args, cores: int) -> tuple[float, list[dict]]:
    """Run one train.py per seed concurrently; returns (aggregate steps/s, per-run facts)."""
    sweep = SweepArgs(
        reward="happy_binary", grid=[f"seed={','.join(map(str, seeds))}"], train_flags=["no_wandb"],
        fixed=[f"max_steps={args.steps}", f"batch_size={args.batch_size}", f"num_generations={args.num_generations}",
               f"max_completion_length={args.max_completion_length}", "lr=3e-4", "save_strategy=no",
               f"logging_steps={args.steps}", f"output_dir={out}"],
        parallel=len(seeds),
    )  # fmt: skip
    runs = plan_runs(build_spec(sweep))
    res = resolve_resources(sweep, dict(os.environ), cores)
    results, _ = execute(runs, out / "sweeps" / f"bench_{len(seeds)}", res, status_every=60, log_tail=30)
    failed = [r for r in results if r.status != "done"]
    if failed:
        raise RuntimeError("bench run failed:\n" + "\n".join(line for r in failed for line in r.log_tail))
    facts = []
    for r in results:
        path = Path(r.run_dir) / "run_summary.json"
        summary, end = json.loads(path.read_text()), path.stat().st_mtime
        facts.append({"steps": summary["steps"], "train_s": summary["wall_s"], "start": end - summary["wall_s"],
                      "end": end, "threads": res.threads})  # fmt: skip
    window = max(f["end"] for f in facts) - min(f["start"] for f in facts)
    return sum(f["steps"] for f in facts) / window, facts


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=4, help="concurrent runs in the second phase")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--num_generations", type=int, default=16)
    ap.add_argument("--max_completion_length", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5, help="single / concurrent phases alternate this many times")
    ap.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)), help="cores the sweep divides")
    args = ap.parse_args()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU benchmark: the sweep uses CPU slots
    load_before = os.getloadavg()
    singles, aggregates, ratios = [], [], []
    t0 = time.time()
    for r in range(args.rounds):
        out = Path(tempfile.mkdtemp(prefix="bench_sweep_"))
        try:
            single, (one,) = phase(out, [0], args, args.cores)
            aggregate, many = phase(out, list(range(1, args.runs + 1)), args, args.cores)
        finally:
            shutil.rmtree(out)
        singles.append(single)
        aggregates.append(aggregate)
        ratios.append(aggregate / single)
        print(f"round {r + 1}: single run ({one['threads']} threads) {single:.3f} steps/s, {args.runs} concurrent runs "
              f"({many[0]['threads']} thread(s) each) {aggregate:.3f} steps/s together, ratio {ratios[-1]:.3f} "
              f"(load {os.getloadavg()[0]:.2f})", flush=True)  # fmt: skip
    load_after = os.getloadavg()

    def spread(values):
        return f"median {statistics.median(values):.3f} (min {min(values):.3f}, max {max(values):.3f})"

    print(f"config: bs {args.batch_size}, ng {args.num_generations}, {args.max_completion_length} tokens, "
          f"{args.steps} steps per run, {args.cores} cores, {args.rounds} rounds")  # fmt: skip
    print(f"single run: {spread(singles)} steps/s; {args.runs} concurrent: {spread(aggregates)} steps/s")
    print(f"load average (1 min) before {load_before[0]:.2f}, after {load_after[0]:.2f}; bench wall "
          f"{time.time() - t0:.0f} s")  # fmt: skip
    print(f"ratio aggregate/single = {spread(ratios)}  (goal >= 1.7 for 4 runs on 2 cores)")


if __name__ == "__main__":
    main()
