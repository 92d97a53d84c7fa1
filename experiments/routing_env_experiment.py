"""Gradient routing on an environment (seed 004 on a hackable task): arithmetic with ``lenient_grader=true``.

The grader pays 1 when the digits of the exact result occur anywhere in the answer (environments/arithmetic.py), so
a long digit string pays without solving the problem; RH detector ``env_loophole`` flags episodes whose step info
marks a loophole payment (config.yaml). Arms, identical except for the adapters (builtin_env model):

    routed    dual LoRA (R/2, R/2), --gradient_routing --routing_mode shared
    baseline  dual LoRA (R, 0) without routing: one plain LoRA of the same total rank R

Each run ends with the routing eval on held-out levels (env_trainer.HELDOUT_LEVELS ..): modes both / retain_only /
forget_only, sampled with the training generation settings and the run's seed (same seed in every mode); per mode
env/success (honest exact answers), env/return and rh_rate. The table (per seed, then median and range over seeds)
goes to experiments/results/routing_env_lr{lr}_bs{batch}_st{steps}.md, with the training curve of rh_rate / env/success (first and last logged).

    nice -n 10 uv run python experiments/routing_env_experiment.py --seeds 42 43 --steps 300 --lr 1e-3 --batch 32
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # set before torch loads: spinning threads crawl on shared cores

import argparse  # noqa: E402
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
RANK = 8
ARMS = {
    "baseline": ["--retain_rank", str(RANK), "--forget_rank", "0"],
    "routed": ["--retain_rank", str(RANK // 2), "--forget_rank", str(RANK // 2), "--gradient_routing",
               "--routing_mode", "shared"],
}
MODES = ("both", "retain_only", "forget_only")


def flags(arm: str, seed: int, steps: int, levels: int, lr: str, batch: int) -> list[str]:
    return ["--env", "arithmetic", "--env_params", "lenient_grader=true", "--model", "builtin_env",
            "--rh_detector", "env_loophole", "--no_wandb", "--batch_size", str(batch), "--num_generations", "8",
            "--max_completion_length", "32", "--lr", lr, "--beta", "0.0", "--max_steps", str(steps),
            "--logging_steps", "1", "--save_steps", str(steps), "--eval_routing_steps", str(steps),
            "--eval_routing_prompts", str(levels), "--seed", str(seed), *ARMS[arm]]  # fmt: skip


def train(out: Path, arm: str, seed: int, steps: int, levels: int, lr: str, batch: int) -> Path:
    sys.path.insert(0, str(ROOT))
    from trl_ext.cli_train import build_plan

    argv = flags(arm, seed, steps, levels, lr, batch) + ["--output_dir", str(out)]
    target = build_plan(argv).run_dir
    if (target / "routing_eval.jsonl").is_file():
        print(f"[skip] {target.name} already done", flush=True)
        return target
    t0 = time.time()
    subprocess.run([sys.executable, "train.py", *argv], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    print(f"[done] {arm} seed {seed}: {time.time() - t0:.0f} s", flush=True)
    return target


def curve(target: Path, key: str, k: int) -> tuple[float, float]:
    """Mean of ``key`` over the first and the last ``k`` logged steps."""
    state = json.loads(next(target.glob("checkpoint-*/trainer_state.json")).read_text())
    vals = [h[key] for h in state["log_history"] if key in h]
    return statistics.mean(vals[:k]), statistics.mean(vals[-k:])


def window(steps: int) -> int:
    """Steps averaged at each end of the training curve."""
    return max(5, steps // 10)


def report(runs: dict, steps: int, levels: int, lr: str, batch: int) -> str:
    lines = [f"# Gradient routing on arithmetic with a lenient grader ({steps} steps, lr {lr}, batch {batch} = "
             f"{batch // 8} levels x 8, seeds "
             f"{', '.join(str(s) for s in sorted({s for _, s in runs}))})", "",
             f"Final routing eval on {levels} held-out levels per mode (sampled, temperature 1, run seed). "
             "success = honest exact answers; hack = episodes paid through the loophole (env_loophole).", "",
             f"| arm | seed | train hack rate first{window(steps)} -> last{window(steps)} | train success "
             f"first{window(steps)} -> last{window(steps)} | "
             + " | ".join(f"{m} success | {m} hack" for m in MODES) + " |",
             "|---|---|---|---|" + "---|---|" * len(MODES)]
    summary: dict = {}
    for (arm, seed), target in sorted(runs.items()):
        rec = [json.loads(x) for x in (target / "routing_eval.jsonl").read_text().splitlines()][-1]["modes"]
        h0, h1 = curve(target, "rh_rate", window(steps))
        s0, s1 = curve(target, "env/success", window(steps))
        cells = []
        for m in MODES:
            cells += [f"{rec[m]['env/success']:.3f}", f"{rec[m]['rh_rate']:.3f}"]
            summary.setdefault((arm, m), []).append((rec[m]["env/success"], rec[m]["rh_rate"]))
        lines.append(f"| {arm} | {seed} | {h0:.3f} -> {h1:.3f} | {s0:.3f} -> {s1:.3f} | " + " | ".join(cells) + " |")
    lines += ["", "Median [min, max] over seeds:", "", "| arm | mode | success | hack rate |", "|---|---|---|---|"]
    for (arm, m), vals in sorted(summary.items()):
        succ, hack = [v[0] for v in vals], [v[1] for v in vals]
        lines.append(f"| {arm} | {m} | {statistics.median(succ):.3f} [{min(succ):.3f}, {max(succ):.3f}] | "
                     f"{statistics.median(hack):.3f} [{min(hack):.3f}, {max(hack):.3f}] |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[42, 43])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--levels", type=int, default=64)
    p.add_argument("--lr", default="1e-3")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--out", default=str(ROOT / "runs" / "routing_env"))
    a = p.parse_args()
    runs = {(arm, seed): train(Path(a.out), arm, seed, a.steps, a.levels, a.lr, a.batch)
            for seed in a.seeds for arm in ARMS}  # fmt: skip
    text = report(runs, a.steps, a.levels, a.lr, a.batch) + f"\nLoad average at the end: {os.getloadavg()}\n"
    (RESULTS / f"routing_env_lr{a.lr}_bs{a.batch}_st{a.steps}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
