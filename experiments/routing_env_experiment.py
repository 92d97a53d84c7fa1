"""Gradient routing on an environment (seed 004 on a hackable task): arithmetic with ``lenient_grader=true``.

The grader pays 1 when the digits of the exact result occur anywhere in the answer (environments/arithmetic.py), so
a long digit string pays without solving the problem; RH detector ``env_loophole`` flags episodes whose step info
marks a loophole payment (config.yaml). Arms, identical except for the adapters (builtin_env model):

    routed    dual LoRA (R/2, R/2), --gradient_routing --routing_mode shared (or --routing_mode exclusive)
    baseline  dual LoRA (R, 0) without routing: one plain LoRA of the same total rank R

Each run ends with the routing eval on held-out levels (env_trainer.HELDOUT_LEVELS ..): modes both / retain_only /
forget_only, sampled with the training generation settings and the run's seed (same seed in every mode); per mode
env/success (honest exact answers), env/return and rh_rate. The table (per seed, then median and range over seeds)
goes to experiments/results/routing_env_lr{lr}_bs{batch}_st{steps}[_<env params>][_recall<r>...].md, with the training
curve of rh_rate / env/success (first and last logged). Knobs: --steps --lr --batch --num_generations
--max_completion_length --beta, --env_params (extra arithmetic parameters after lenient_grader=true), --recall (the
routed arm's --rh_detector_recall), --arms. Runs whose routing eval exists are skipped (the report is rebuilt).

Setting where the plain baseline learns the hack in every seed and a run takes 1-2 min on one shared core (the
defaults; small operands: every result is one digit, so a digit string containing it is cheap to find):

    OMP_NUM_THREADS=1 nice -n 10 uv run python experiments/routing_env_experiment.py --seeds 42 43 44 --steps 300 \
        --lr 1e-3 --batch 32 --levels 256 --env_params max_operand=4,max_factor=3

With the default operands (--env_params '') the baseline needs --lr 3e-3 --steps 600 (4-5 min a run) and learned
the hack clearly in 2 of 3 seeds only.
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
    "routed": ["--retain_rank", str(RANK // 2), "--forget_rank", str(RANK // 2), "--gradient_routing"],
}
MODES = ("both", "retain_only", "forget_only")


def flags(arm: str, seed: int, a: argparse.Namespace) -> list[str]:
    env_params = ",".join(filter(None, ["lenient_grader=true", a.env_params]))
    routing = ["--routing_mode", a.routing_mode] if arm == "routed" else []
    routing += ["--rh_detector_recall", str(a.recall)] if arm == "routed" and a.recall != 1.0 else []
    return ["--env", "arithmetic", "--env_params", env_params, "--model", "builtin_env",
            "--rh_detector", "env_loophole", "--no_wandb", "--batch_size", str(a.batch),
            "--num_generations", str(a.num_generations), "--max_completion_length", str(a.max_completion_length),
            "--lr", a.lr, "--beta", a.beta, "--max_steps", str(a.steps),
            "--logging_steps", "1", "--save_steps", str(a.steps), "--eval_routing_steps", str(a.steps),
            "--eval_routing_prompts", str(a.levels), "--seed", str(seed), *ARMS[arm], *routing]  # fmt: skip


def train(out: Path, arm: str, seed: int, a: argparse.Namespace) -> Path:
    sys.path.insert(0, str(ROOT))
    from trl_ext.cli_train import build_plan

    argv = flags(arm, seed, a) + ["--output_dir", str(out)]
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


def setting(a: argparse.Namespace) -> str:
    """The knobs of one experiment, for the title and the file name."""
    return (f"{a.steps} steps, lr {a.lr}, batch {a.batch} = {a.batch // a.num_generations} levels x "
            f"{a.num_generations}, max_completion_length {a.max_completion_length}, beta {a.beta}, env_params "
            f"lenient_grader=true{',' + a.env_params if a.env_params else ''}, routed recall {a.recall}, routing mode "
            f"{a.routing_mode}")


def report(runs: dict, a: argparse.Namespace) -> str:
    steps, levels = a.steps, a.levels
    lines = [f"# Gradient routing on arithmetic with a lenient grader ({setting(a)}; seeds "
             f"{', '.join(str(s) for s in sorted({s for _, s in runs}))})", "",
             f"Final routing eval on {levels} held-out levels per mode (sampled, temperature 1, run seed). "
             "success = honest exact answers; hack = episodes paid through the loophole (env_loophole); return = mean "
             "episode return (-1 = every answer invalid).", "",
             f"| arm | seed | train hack rate first{window(steps)} -> last{window(steps)} | train success "
             f"first{window(steps)} -> last{window(steps)} | "
             + " | ".join(f"{m} success | {m} hack | {m} return" for m in MODES) + " |",
             "|---|---|---|---|" + "---|---|---|" * len(MODES)]
    summary: dict = {}
    for (arm, seed), target in sorted(runs.items()):
        rec = [json.loads(x) for x in (target / "routing_eval.jsonl").read_text().splitlines()][-1]["modes"]
        h0, h1 = curve(target, "rh_rate", window(steps))
        s0, s1 = curve(target, "env/success", window(steps))
        cells = []
        for m in MODES:
            cells += [f"{rec[m]['env/success']:.3f}", f"{rec[m]['rh_rate']:.3f}", f"{rec[m]['env/return']:.3f}"]
            summary.setdefault((arm, m), []).append((rec[m]["env/success"], rec[m]["rh_rate"], rec[m]["env/return"]))
        lines.append(f"| {arm} | {seed} | {h0:.3f} -> {h1:.3f} | {s0:.3f} -> {s1:.3f} | " + " | ".join(cells) + " |")
    lines += ["", "Median [min, max] over seeds:", "", "| arm | mode | success | hack rate | return |",
              "|---|---|---|---|---|"]
    for (arm, m), vals in sorted(summary.items()):
        cols = [[v[k] for v in vals] for k in range(3)]
        lines.append(f"| {arm} | {m} | " + " | ".join(f"{statistics.median(c):.3f} [{min(c):.3f}, {max(c):.3f}]"
                                                   for c in cols) + " |")
    return "\n".join(lines) + "\n"


def result_name(a: argparse.Namespace) -> str:
    extra = "".join(f"_{x.replace('=', '').replace('max_', '').replace('_', '')}" for x in a.env_params.split(",") if x)
    extra += "" if a.num_generations == 8 else f"_g{a.num_generations}"
    extra += "" if a.max_completion_length == 32 else f"_len{a.max_completion_length}"
    extra += "" if a.beta == "0.0" else f"_beta{a.beta}"
    extra += "" if a.recall == 1.0 else f"_recall{a.recall}"
    extra += "" if a.routing_mode == "shared" else f"_{a.routing_mode}"
    return f"routing_env_lr{a.lr}_bs{a.batch}_st{a.steps}{extra}.md"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44])
    p.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=list(ARMS))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--levels", type=int, default=256, help="held-out levels per mode in the final routing eval")
    p.add_argument("--lr", default="1e-3")
    p.add_argument("--batch", type=int, default=32, help="completions per step (levels x --num_generations)")
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--max_completion_length", type=int, default=32)
    p.add_argument("--beta", default="0.0")
    p.add_argument("--env_params", default="max_operand=4,max_factor=3",
                   help="extra arithmetic parameters after lenient_grader=true ('' = the defaults: operands to 20)")
    p.add_argument("--recall", type=float, default=1.0, help="--rh_detector_recall of the routed arm")
    p.add_argument("--routing_mode", choices=["shared", "exclusive"], default="shared",
                   help="--routing_mode of the routed arm (exclusive: the forget adapter learns from flagged samples only)")
    p.add_argument("--out", default=str(ROOT / "runs" / "routing_env"))
    a = p.parse_args()
    t0 = time.time()
    runs = {(arm, seed): train(Path(a.out), arm, seed, a) for seed in a.seeds for arm in a.arms}
    text = (report(runs, a) + f"\nWall time {time.time() - t0:.0f} s for {len(runs)} runs (runs already done are "
            f"skipped); load average at the end: {os.getloadavg()}\n")
    (RESULTS / result_name(a)).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
