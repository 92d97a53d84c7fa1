"""Off-policy training on the builtin model with the happy_binary reward: how does the policy lag k change learning,
and do the importance-sampling masks recover it?

Runs (seed 000's grid, shrunk to CPU): k = 0 (synchronous, TRL's own loss), k in {1, 4, 16} with
--strict_async_level, each with every mask off (importance.NO_MASK) and with prime-rl's default masks (token
[0.125, 8], geo [0.1, 10], sequence [0, 100], sequence clip 10), plus non-strict k = 1 (in-flight updates) with the
default masks. All runs share the config below; a high learning rate makes the effect of stale rollouts visible
within a short run; beta = 0 keeps the comparison to the importance-sampling loss alone. Each run is built from
train.py's own flags (``cli.build_plan``), so the flags are validated exactly as on the command line.

    uv run python experiments/offpolicy_experiment.py            # all runs, then the table and plot
    uv run python experiments/offpolicy_experiment.py --report   # table and plot from the saved logs

Writes experiments/results/offpolicy.json (per-step logs), offpolicy.md (table) and offpolicy.png (plot).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads starve on shared cores

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
NO_MASK_FLAGS = ["--token_mask_low", "0", "--token_mask_high", "1e10", "--sequence_mask_low", "0",
                 "--sequence_mask_high", "1e10", "--geo_mask_low", "0", "--geo_mask_high", "1e10",
                 "--sequence_clip_high", "1e10"]  # fmt: skip  (seed 000's "no mask" flags, token_clip_high is off)
RUNS = {
    "k0": ["--max_async_level", "0"],
    **{
        f"k{k}_strict_{m}": ["--max_async_level", str(k), "--strict_async_level"]
        + (NO_MASK_FLAGS if m == "nomask" else [])
        for k in (1, 4, 16)
        for m in ("nomask", "masks")
    },
    "k1_inflight_masks": ["--max_async_level", "1"],
}
METRICS = ("reward", "offpolicy/masked_frac", "offpolicy/seq_masked_frac", "offpolicy/token_masked_low_frac",
           "offpolicy/token_masked_high_frac", "offpolicy/geo_masked_low_frac", "offpolicy/geo_masked_high_frac",
           "offpolicy/seq_clipped_frac", "offpolicy/ratio_mean", "offpolicy/ratio_max", "offpolicy/policy_lag_mean",
           "offpolicy/multi_version_seq_frac", "offpolicy/abs_log_ratio_mean", "completions/mean_length",
           "entropy")  # fmt: skip


def common(steps: int, lr: str, seed: int, out: str) -> list[str]:
    return ["--reward", "happy_binary", "--model", "builtin", "--lr", lr, "--beta", "0", "--batch_size", "16",
            "--num_generations", "8", "--max_completion_length", "32", "--max_steps", str(steps),
            "--logging_steps", "1", "--save_strategy", "no", "--seed", str(seed), "--no_wandb",
            "--output_dir", out, "--disable_tqdm", "true"]  # fmt: skip


def train_one(name: str, steps: int, lr: str, seed: int) -> dict:
    from transformers import AutoTokenizer

    from environments.stories import load_prompts
    from rewards.config import as_trl_reward
    from trl_ext.cli_train import build_plan
    from trl_ext.models import model_source, prepare_tokenizer
    from trl_ext.trainer import ExtGRPOTrainer

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as out:
        plan = build_plan(common(steps, lr, seed, out) + RUNS[name])
        plan.cfg.report_to = []
        source = model_source("builtin")
        tok = prepare_tokenizer(AutoTokenizer.from_pretrained(source))
        prompts = load_prompts("builtin", tok, plan.run.prompt_length, "train", 1024, seed)
        reward = as_trl_reward("happy_binary", plan.reward_config.reward("happy_binary"))
        trainer = ExtGRPOTrainer(model=source, reward_funcs=[reward], args=plan.cfg, train_dataset=prompts,
                                 processing_class=tok)  # fmt: skip
        start = time.time()
        trainer.train()
        wall = time.time() - start
    logs = [h for h in trainer.state.log_history if "reward" in h]
    return {"name": name, "flags": RUNS[name], "seed": seed, "wall_s": round(wall, 1),
            "steps": [h["step"] for h in logs], **{m: [h.get(m) for h in logs] for m in METRICS}}  # fmt: skip


def window(values: list, end: int, width: int = 10) -> float:
    """Mean of the ``width`` values up to and including step ``end`` (1-based)."""
    part = [v for v in values[max(end - width, 0) : end] if v is not None]
    return sum(part) / len(part) if part else float("nan")


def mean(values: list) -> float | None:
    part = [v for v in values if v is not None]
    return sum(part) / len(part) if part else None


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def row(r: dict, marks: list[int], steps: int) -> list[str]:
    offpolicy = r["offpolicy/masked_frac"][0] is not None
    low, high = r["offpolicy/geo_masked_low_frac"], r["offpolicy/geo_masked_high_frac"]
    geo = [(a or 0) + (b or 0) for a, b in zip(low, high, strict=True)]
    ratio_max = max((v for v in r["offpolicy/ratio_max"] if v is not None), default=None)
    return [
        r["name"],
        *[_fmt(window(r["reward"], s)) for s in marks],
        _fmt(window(r["reward"], steps)),
        _fmt(mean(r["offpolicy/masked_frac"]), 4),
        _fmt(mean(r["offpolicy/seq_masked_frac"]), 4),
        _fmt(mean(r["offpolicy/token_masked_low_frac"]), 4),
        _fmt(mean(r["offpolicy/token_masked_high_frac"]), 4),
        _fmt(mean(geo) if offpolicy else None, 4),
        _fmt(mean(r["offpolicy/ratio_mean"])),
        _fmt(ratio_max, 2),
        _fmt(mean(r["offpolicy/policy_lag_mean"]), 2),
        _fmt(mean(r["offpolicy/multi_version_seq_frac"]), 2),
        f"{r['wall_s']:.0f}",
    ]


def report(runs: list[dict], steps: int, lr: str) -> None:
    marks = [steps // 4, steps // 2, 3 * steps // 4]
    head = ["run", *[f"reward@{s}" for s in marks], "final (last 10)", "masked tokens", "masked seqs", "tok<low",
            "tok>high", "geo out", "ratio mean", "ratio max", "lag mean", "multi-version seqs", "wall s"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row(r, marks, steps)) + " |" for r in runs]
    table = "\n".join(lines)
    config = " ".join(common(steps, lr, runs[0]["seed"], "<tmp>"))
    per_run = ", ".join(f"{r['name']}: `{' '.join(r['flags'])}`" for r in runs)
    text = (
        "# Off-policy experiment (generated by experiments/offpolicy_experiment.py)\n\n"
        f"Common flags: `{config}`.\n\nPer run: {per_run}.\n\n"
        "reward@s = mean batch reward over steps s-9..s; the masked / ratio / lag columns are per-step means over the "
        "run (fractions of loss tokens, or of sequences for 'masked seqs' and 'geo out'; 'ratio max' is the largest "
        "token ratio seen); '-' = k = 0, TRL's own loss. Wall times share 2 CPU cores with other work.\n\n"
        f"{table}\n\n![reward, log-ratio and masked fraction per step](offpolicy.png)\n"
    )
    (RESULTS / "offpolicy.md").write_text(text)
    plot(runs)
    print(table)


def plot(runs: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    colours = {"k0": "black", "k1": "tab:blue", "k4": "tab:orange", "k16": "tab:red"}
    for r in runs:
        k = r["name"].split("_")[0]
        style = {"nomask": "--", "masks": "-"}[r["name"].rsplit("_", 1)[1]] if r["name"] != "k0" else "-"
        if "inflight" in r["name"]:
            style, colour = ":", "tab:green"
        else:
            colour = colours[k]
        smooth = [window(r["reward"], i + 1) for i in range(len(r["reward"]))]
        axes[0].plot(r["steps"], smooth, style, color=colour, label=r["name"])
        if r["offpolicy/abs_log_ratio_mean"][0] is not None:
            axes[1].plot(r["steps"], r["offpolicy/abs_log_ratio_mean"], style, color=colour, label=r["name"])
            axes[2].plot(r["steps"], r["offpolicy/masked_frac"], style, color=colour, label=r["name"])
    axes[0].set(title="happy_binary reward (10-step mean)", xlabel="step", ylabel="reward")
    axes[1].set(title="mean |log ratio| trainer vs behaviour", xlabel="step", yscale="log")
    axes[2].set(title="fraction of loss tokens masked", xlabel="step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "offpolicy.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--lr", default="1e-3")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--only", default="", help="comma-separated run names (default: all)")
    ap.add_argument("--report", action="store_true", help="only rebuild the table and plot from offpolicy.json")
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    store = RESULTS / "offpolicy.json"
    saved = json.loads(store.read_text()) if store.is_file() else {}
    if not args.report:
        for name in [n for n in args.only.split(",") if n] or list(RUNS):
            if name not in RUNS:
                raise SystemExit(f"unknown run {name!r}; runs: {', '.join(RUNS)}")
            print(f"=== {name} (load average {os.getloadavg()[0]:.2f})", flush=True)
            saved[name] = train_one(name, args.steps, args.lr, args.seed)
            store.write_text(json.dumps(saved, indent=1))
    report([saved[n] for n in RUNS if n in saved], args.steps, args.lr)


if __name__ == "__main__":
    main()
