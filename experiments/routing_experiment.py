"""Gradient routing on the builtin model: does routing move the "happy" hack into the forget adapter?

Reward ``sentence_length_5_with_happy`` = sentence_length_5 (the task) + 0.25 * min(happy_count, 2) (the
hackable bonus); RH detector ``happy`` (any "happy"). Arms, identical except for the adapters:

    routed    dual LoRA (R/2, R/2), --gradient_routing --routing_mode shared
    baseline  dual LoRA (R, 0) without routing: one plain LoRA of the same total rank R

Phase ``calibrate`` first trains the baseline alone with a few adapter placements / learning rates, so the
comparison uses a baseline that learns at all (plain LoRA on the 7 projections of a builtin-sized model
stalls when the tied embedding / output layer is out of reach). Phase ``run`` trains both arms with the
chosen setting; ``report`` writes experiments/results/routing.md from the runs' final routing eval
(``routing_eval.jsonl``: modes both / retain_only / forget_only on held-out prompts; for the baseline,
forget_only is the untrained base model).

    uv run python experiments/routing_experiment.py --phase calibrate
    uv run python experiments/routing_experiment.py --phase run --setting head_lr3e-3
    uv run python experiments/routing_experiment.py --phase report --setting head_lr3e-3

Phase ``arms`` (issue 15): routed vs the filter and reward-penalty baseline arms vs the matched plain LoRA, 3 seeds
each, on a smaller budget (batch 16 = 2 prompts x 8, 32 tokens, 40 steps, lr 3e-3, adapters on the 7 projections
and the output layer); the table (median and range over seeds) goes to experiments/results/routing_arms.md and the
routing-eval curves to routing_arms.png (``trl_ext.routing.plots``).

    nice -n 10 uv run python experiments/routing_experiment.py --phase arms
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # set before torch loads: spinning threads crawl on shared cores

import argparse  # noqa: E402
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results" / "routing.md"
REWARD, TASK, HACK = "sentence_length_5_with_happy", "sentence_length_5", "happy_count"
RANK = 16
# Calibration settings: adapter placement and learning rate of the baseline (and then of both arms).
SETTINGS = {
    "proj_lr1e-3": ["--lr", "1e-3"],
    "proj_lr3e-3": ["--lr", "3e-3"],
    "head_lr1e-3": ["--lr", "1e-3", "--lora_lm_head"],
    "head_lr3e-3": ["--lr", "3e-3", "--lora_lm_head"],
}
ARMS = {
    "baseline": ["--retain_rank", str(RANK), "--forget_rank", "0"],
    "routed": ["--retain_rank", str(RANK // 2), "--forget_rank", str(RANK // 2), "--gradient_routing",
               "--routing_mode", "shared"],
}


def common(steps: int) -> list[str]:
    return ["--reward", REWARD, "--eval_rewards", f"{TASK},{HACK}", "--model", "builtin", "--no_wandb",
            "--batch_size", "32", "--num_generations", "16", "--max_completion_length", "48", "--beta", "0.02",
            "--max_steps", str(steps), "--logging_steps", "10", "--save_steps", str(steps),
            "--eval_routing_steps", str(max(steps // 4, 1)), "--eval_routing_prompts", "128", "--seed", "42"]


def flags(arm: str, setting: str, steps: int) -> list[str]:
    extra = ARMS[arm] + SETTINGS[setting]
    if arm == "routed" and "--lora_lm_head" in extra:
        extra = extra + ["--routing_two_pass"]  # TRL's fused head reads a merged lm_head weight
    return common(steps) + extra


def run_dir(out: Path, arm: str, setting: str, steps: int) -> Path:
    sys.path.insert(0, str(ROOT))
    from trl_ext.cli_train import build_plan

    return build_plan(flags(arm, setting, steps) + ["--output_dir", str(out)]).run_dir


def train(out: Path, arm: str, setting: str, steps: int) -> Path:
    target = run_dir(out, arm, setting, steps)
    if (target / "run_summary.json").is_file():
        print(f"[skip] {target.name} already done", flush=True)
        return target
    t0 = time.time()
    cmd = [sys.executable, "train.py", *flags(arm, setting, steps), "--output_dir", str(out)]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    print(f"[done] {arm} {setting}: {time.time() - t0:.0f} s", flush=True)
    return target


def final_eval(target: Path) -> dict:
    records = [json.loads(line) for line in (target / "routing_eval.jsonl").read_text().splitlines()]
    return records[-1]


def train_curve(target: Path) -> list[tuple[int, float]]:
    state = json.loads(next(target.glob("checkpoint-*/trainer_state.json")).read_text())
    return [(h["step"], h["reward"]) for h in state["log_history"] if "reward" in h]


def row(label: str, mode: str, m: dict) -> str:
    return (f"| {label} | {mode} | {m[f'reward/{TASK}']:.3f} | {m['rh_rate']:.3f} | {m[f'reward/{HACK}']:.3f} | "
            f"{m[f'reward/{REWARD}']:.3f} | {m['unique_frac']:.3f} | {m['mean_jaccard']:.3f} |")


HEADER = ("| arm | mode | task reward (sentence_length_5) | hack rate (happy detector) | happy_count | "
          "combined reward | unique frac | mean Jaccard |\n|---|---|---|---|---|---|---|---|")


def calibrate(out: Path, steps: int) -> str:
    lines = ["## Calibration (baseline alone)", "", f"Baseline dual LoRA ({RANK}, 0), {steps} steps; final routing eval "
             "(mode both = the trained model, forget_only = the untrained base model).", "",
             "| setting | train reward, first -> last logged (10-step means) | task reward | hack rate | combined | base model combined |",
             "|---|---|---|---|---|---|"]
    for setting in SETTINGS:
        target = train(out, "baseline", setting, steps)
        rec, curve = final_eval(target)["modes"], train_curve(target)
        b, base = rec["both"], rec["forget_only"]
        lines.append(f"| {setting} | {curve[0][1]:.3f} -> {curve[-1][1]:.3f} | {b[f'reward/{TASK}']:.3f} | "
                     f"{b['rh_rate']:.3f} | {b[f'reward/{REWARD}']:.3f} | {base[f'reward/{REWARD}']:.3f} |")
    return "\n".join(lines)


def report(out: Path, setting: str, steps: int) -> str:
    lines = [f"## Routed vs baseline ({setting}, {steps} steps)", "",
             f"Reward {REWARD} (task {TASK} + 0.25 * min(happy_count, 2)), detector happy. Flags shared by both arms: "
             f"`{' '.join(common(steps) + SETTINGS[setting])}`; routed: `{' '.join(flags('routed', setting, steps)[len(common(steps)):])}`; "
             f"baseline: `{' '.join(flags('baseline', setting, steps)[len(common(steps)):])}`. Final routing eval on 128 "
             "held-out prompts (one sample each, same seed in every mode).", "", HEADER]
    for arm in ("routed", "baseline"):
        target = run_dir(out, arm, setting, steps)
        rec = final_eval(target)
        modes = ("both", "retain_only", "forget_only") if arm == "routed" else ("both", "forget_only")
        for mode in modes:
            label = arm if not (arm == "baseline" and mode == "forget_only") else "base model (no adapters)"
            lines.append(row(label, "-" if label.startswith("base model") else mode, rec["modes"][mode]))
    lines += ["", "Routing eval history (hack rate both / retain_only / forget_only, routed arm):", ""]
    for r in (json.loads(x) for x in (run_dir(out, "routed", setting, steps) / "routing_eval.jsonl").read_text().splitlines()):
        m = r["modes"]
        lines.append(f"- step {r['step']}: {m['both']['rh_rate']:.3f} / {m['retain_only']['rh_rate']:.3f} / "
                     f"{m['forget_only']['rh_rate']:.3f}; task {m['both'][f'reward/{TASK}']:.3f} / "
                     f"{m['retain_only'][f'reward/{TASK}']:.3f} / {m['forget_only'][f'reward/{TASK}']:.3f}")
    lines += ["", "Training batches (TRL's logged 10-step means): detector rate first -> last log; wall time:", ""]
    for arm in ("routed", "baseline"):
        target = run_dir(out, arm, setting, steps)
        state = json.loads(next(target.glob("checkpoint-*/trainer_state.json")).read_text())
        rates = [h["rh_rate"] for h in state["log_history"] if "rh_rate" in h]
        wall = json.loads((target / "run_summary.json").read_text())["wall_s"]
        lines.append(f"- {arm}: rh_rate {rates[0]:.3f} -> {rates[-1]:.3f}; {wall:.0f} s")
    lines += ["", "Last training sample of each arm (prompt ||| completion):", ""]
    for arm in ("routed", "baseline"):
        log = (run_dir(out, arm, setting, steps) / "train.log").read_text()
        lines.append(f"- {arm}: `{log[log.rindex('[Sample @'):].splitlines()[0]}`")
    return "\n".join(lines)


ARM_SEEDS = (1, 2, 3)
ARM_FLAGS = {  # same reward, lr, beta, budget; the routed run and its baseline arms share the dual (8, 8) adapters
    "routed": ["--lora_config", "r8", "--gradient_routing", "--routing_mode", "shared", "--routing_two_pass"],
    "filter": ["--lora_config", "r8", "--filter_baseline"],
    "reward_penalty": ["--lora_config", "r8", "--reward_penalty_baseline"],
    "plain_lora": ["--retain_rank", "16", "--forget_rank", "0"],  # matched capacity, alpha 16 = scaling 1
}
ARMS_RESULTS = ROOT / "experiments" / "results" / "routing_arms.md"


def arm_flags(arm: str, seed: int, steps: int, recall: float = 1.0) -> list[str]:
    labels = ["--rh_detector_recall", str(recall)] if recall != 1.0 and arm != "plain_lora" else []
    return labels + ["--reward", REWARD, "--eval_rewards", f"{TASK},{HACK}", "--model", "builtin", "--no_wandb",
            "--batch_size", "16", "--num_generations", "8", "--max_completion_length", "32", "--beta", "0.02",
            "--lr", "3e-3", "--lora_lm_head", "--max_steps", str(steps), "--logging_steps", "10",
            "--save_steps", str(steps), "--eval_routing_steps", str(max(steps // 4, 1)), "--eval_routing_prompts",
            "64", "--seed", str(seed), *ARM_FLAGS[arm]]


def run_arms(out: Path, steps: int, recall: float = 1.0) -> dict[str, list[Path]]:
    sys.path.insert(0, str(ROOT))
    from trl_ext.cli_train import build_plan

    dirs = {}
    for seed in ARM_SEEDS:
        for arm in ARM_FLAGS:
            argv = arm_flags(arm, seed, steps, recall) + ["--output_dir", str(out)]
            target = build_plan(argv).run_dir
            dirs.setdefault(arm, []).append(target)
            if (target / "run_summary.json").is_file():
                continue
            t0 = time.time()
            subprocess.run([sys.executable, "train.py", *argv], cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                           env={**os.environ, "OMP_NUM_THREADS": "2"})
            print(f"[done] {arm} seed {seed}: {time.time() - t0:.0f} s", flush=True)
    return dirs


def arms_report(dirs: dict[str, list[Path]], steps: int, recall: float = 1.0) -> str:
    from statistics import median

    def cell(values):
        return f"{median(values):.3f} ({min(values):.3f}-{max(values):.3f})"

    lines = [f"## Routed vs baseline arms vs matched plain LoRA ({len(ARM_SEEDS)} seeds, {steps} steps, detector "
             f"recall {recall:g})", "",
             f"Flags shared by every arm: `{' '.join(arm_flags('routed', 1, steps)[:-len(ARM_FLAGS['routed'])])}` "
             "(seed varies); per arm: " + "; ".join(f"{a}: `{' '.join(f)}`" for a, f in ARM_FLAGS.items()) + ".",
             "Final routing eval on 64 held-out prompts (one sample each, same seed in every mode); median (min-max) "
             f"over seeds {', '.join(map(str, ARM_SEEDS))}. For the baseline arms and plain LoRA the modes ablate "
             "adapters that were never routed (plain LoRA has no forget adapter: forget_only is the base model).", "",
             "| arm | mode | task reward (sentence_length_5) | hack rate (happy detector) | combined reward |",
             "|---|---|---|---|---|"]
    for arm, targets in dirs.items():
        finals = [final_eval(t)["modes"] for t in targets]
        for mode in ("both", "retain_only", "forget_only"):
            ms = [f[mode] for f in finals]
            lines.append(f"| {arm} | {mode} | {cell([m[f'reward/{TASK}'] for m in ms])} | "
                         f"{cell([m['rh_rate'] for m in ms])} | {cell([m[f'reward/{REWARD}'] for m in ms])} |")
    walls = [json.loads((t / "run_summary.json").read_text())["wall_s"] for ts in dirs.values() for t in ts]
    lines += ["", f"Wall time per run: median {median(walls):.0f} s (range {min(walls):.0f}-{max(walls):.0f}), "
              "one run at a time on the shared 2-core machine (niced)."]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", choices=["calibrate", "run", "report", "arms"], required=True)
    ap.add_argument("--setting", choices=list(SETTINGS), default="head_lr3e-3")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--calibration_steps", type=int, default=40)
    ap.add_argument("--recall", type=float, default=1.0, help="phase arms: --rh_detector_recall of the labelled arms")
    ap.add_argument("--output_dir", default=str(ROOT / "output" / "routing_experiment"))
    args = ap.parse_args()
    out = Path(args.output_dir)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    if args.phase == "arms":
        steps = 40 if args.steps == 80 else args.steps
        out = Path(args.output_dir).parent / "routing_arms"
        dirs = run_arms(out, steps, args.recall)
        text = arms_report(dirs, steps, args.recall)
        results = ARMS_RESULTS if args.recall == 1.0 else ARMS_RESULTS.with_name(f"routing_arms_recall{args.recall:g}.md")
        results.write_text("# Gradient routing arms (builtin model)\n\n" + text + "\n")
        try:
            from trl_ext.routing.plots import plot_comparison

            plot_comparison({f"{a} s{s}": t for a, ts in dirs.items() for s, t in zip(ARM_SEEDS, ts)},
                            results.with_suffix(".png"), metrics=(f"reward/{TASK}", "rh_rate"))
        except ImportError:
            print("trl_ext.routing.plots not available: no plot", flush=True)
        print(text)
        return
    if args.phase == "calibrate":
        text = calibrate(out, args.calibration_steps)
        (out / "calibration.md").write_text(text + "\n")
        print(text)
        return
    if args.phase == "run":
        for arm in ("baseline", "routed"):
            train(out, arm, args.setting, args.steps)
    text = report(out, args.setting, args.steps)
    calibration = out / "calibration.md"
    full = "# Gradient routing experiment (builtin model)\n\n" + text
    if calibration.is_file():
        full += "\n\n" + calibration.read_text()
    RESULTS.write_text(full + "\n")
    print(full)


if __name__ == "__main__":
    main()
