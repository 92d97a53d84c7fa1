"""Which tokens do the importance masks drop, and are they the reward-hacking ones? A question the per-completion
rollout rows cannot answer, asked of the token records (``--token_records_every``).

Task: arithmetic with a planted grader bug (``lenient_grader=true``: the grader pays when the result's digits occur
anywhere in the answer; the episode detector ``env_loophole`` labels such completions ``is_rh``), small operands
(``max_operand=4,max_factor=3``, where the base model already finds the loophole in about 15% of completions),
from ``recipes/offpolicy_math.toml`` (builtin_env, full fine-tune, batch 32, 8 per group, lr 2e-4, the fast backend).

Arms, each over ``SEEDS``, ``STEPS`` steps, token records every ``EVERY`` steps:
    k1, k4, k16   strict lag k with prime-rl's default masks (token [0.125, 8], geo [0.1, 10], sequence [0, 100])
    k16_nomask    strict k = 16 with every mask and clip off (recipes/no_masks.toml): nothing is dropped; the
                  default masks are applied to its records afterwards (`would_mask`), the same function the loss uses

Per run, over the recorded steps from ``FROM_STEP`` on (the lag is k there): the masked rate of the trained tokens
in hack completions and in the others, their difference (the concentration), and the hack completions' share of the
trained and of the masked tokens. Comparisons: mean +- SE over seeds, paired by seed; an effect only beyond 2 SE.

    OMP_NUM_THREADS=1 uv run python experiments/token_records_experiment.py [--jobs 2]

Writes experiments/results/token_records.json (every run's numbers) and experiments/results/token_records.md.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from stats import fmt_diff, fmt_mean_se, mean_se, paired_difference, verdict  # noqa: E402

OUT = ROOT / "output" / "token_records"
RESULTS = ROOT / "experiments" / "results"
SEEDS = (0, 1, 2)
STEPS, EVERY, FROM_STEP = 120, 5, 20
BASE = ["@", "recipes/offpolicy_math.toml", "--env_params", "max_operand=4,max_factor=3,lenient_grader=true",
        "--rh_detector", "env_loophole", "--save_rollouts", "--token_records_every", str(EVERY), "--max_steps",
        str(STEPS), "--save_steps", str(STEPS), "--logging_steps", "20", "--output_dir", str(OUT)]  # fmt: skip
ARMS = {
    "k1": ["--max_async_level", "1", "--strict_async_level"],
    "k4": ["--max_async_level", "4", "--strict_async_level"],
    "k16": ["--max_async_level", "16", "--strict_async_level"],
    "k16_nomask": ["@", "recipes/no_masks.toml", "--max_async_level", "16", "--strict_async_level"],
}


def run_argv(arm: str, seed: int) -> list[str]:
    return [*BASE, *ARMS[arm], "--seed", str(seed)]


def train(arm: str, seed: int, run_dir: Path) -> Path:
    """``run_dir`` (train.py's for the arm and seed), trained unless its run_summary.json says done."""
    argv = run_argv(arm, seed)
    summary = run_dir / "run_summary.json"
    if summary.is_file() and json.loads(summary.read_text()).get("status") == "done":
        return run_dir
    start = time.time()
    proc = subprocess.run([sys.executable, "train.py", *argv, "--overwrite_run"], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "WANDB_MODE": "disabled"})  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"{arm} seed {seed} failed: {proc.stderr[-2000:]}")
    print(f"{arm} seed {seed}: {time.time() - start:.0f} s", flush=True)
    return run_dir


def would_mask(trained) -> list:
    """The default masks' labels of a run trained without masks: `importance_loss` with prime-rl's defaults on each
    completion's recorded trainer and behaviour log-probs (one row per completion, right-padded)."""
    import torch

    from trl_ext.offpolicy.importance import PRIME_RL_DEFAULTS, ImportanceConfig, importance_loss
    from trl_ext.runs.token_records import mask_labels

    cfg = ImportanceConfig(**PRIME_RL_DEFAULTS)
    groups = list(trained.groupby(["step", "sample"], sort=False))
    width = max(len(g) for _, g in groups)
    lp, lb, m = (torch.zeros(len(groups), width, dtype=torch.float64) for _ in range(3))
    for i, (_, g) in enumerate(groups):
        n = len(g)
        lp[i, :n] = torch.tensor(g["trainer_logprob"].to_numpy())
        lb[i, :n] = torch.tensor(g["behaviour_logprob"].to_numpy())
        m[i, :n] = 1
    out = importance_loss(lp, lb, torch.zeros(len(groups), dtype=torch.float64), m, cfg, "grpo")
    labels = mask_labels(out.masks, m)
    return [labels[i][j] for i, (_, g) in enumerate(groups) for j in range(len(g))]


def analyse(run_dir: Path, counterfactual: bool) -> dict:
    from trl_ext.runs.rollouts import token_table

    table = token_table(run_dir)
    trained = table[table["trained"] & (table["step"] >= FROM_STEP)].copy()
    labels = pd_labels(would_mask(trained)) if counterfactual else trained["masked_by"].reset_index(drop=True)
    trained["masked"] = labels.notna().values
    rh = trained["is_rh"].astype(bool)
    rate = lambda x: float(x["masked"].mean()) if len(x) else float("nan")  # noqa: E731
    masked = trained[trained["masked"]]
    return {
        "steps": sorted(int(s) for s in trained["step"].unique()),
        "lag_mean": float((trained["step"] - 1 - trained["policy_version"]).mean()),
        "trained_tokens": len(trained), "masked_tokens": int(trained["masked"].sum()),
        "masked_rate": rate(trained), "masked_rate_rh": rate(trained[rh]), "masked_rate_other": rate(trained[~rh]),
        "rh_share_trained": float(rh.mean()),
        "rh_share_masked": float(masked["is_rh"].astype(bool).mean()) if len(masked) else float("nan"),
        "masked_by": {str(k): int(v) for k, v in labels.value_counts().items()},  # applied afterwards: would-be
        "shard_bytes": [p.stat().st_size for p in sorted((run_dir / "rollouts" / "tokens").glob("step-*.parquet"))],
        "rows_per_shard": [int(n) for n in table.groupby("step").size().tolist()],
    }  # fmt: skip


def reproduces_masks(run_dir: Path) -> dict:
    """`would_mask` against the masks a run trained with: the tokens where the labels agree, of all trained ones."""
    from trl_ext.runs.rollouts import token_table

    table = token_table(run_dir)
    trained = table[table["trained"]]
    again = pd_labels(would_mask(trained))
    recorded = trained["masked_by"].reset_index(drop=True)
    agree = (again.fillna("kept") == recorded.fillna("kept")).sum()
    return {"tokens": len(trained), "agree": int(agree), "masked": int(recorded.notna().sum())}


def prose_numbers(runs: dict, check: list[dict]) -> str:
    """The numbers the docs' prose quotes: rates in percent, the shards' sizes, the masks' reproduction."""
    import statistics

    pct = {arm: {key: 100 * statistics.fmean([r[key] for r in per.values() if r[key] == r[key]] or [float("nan")])
                 for key in ("masked_rate", "masked_rate_rh", "masked_rate_other", "rh_share_trained",
                             "rh_share_masked")} for arm, per in runs.items()}  # fmt: skip
    sizes = [b for per in runs.values() for r in per.values() for b in r["shard_bytes"]]
    rows = [n for per in runs.values() for r in per.values() for n in r["rows_per_shard"]]
    per_row = statistics.median(b / n for b, n in zip(sizes, rows))
    lines = ["", "Percent (mean over seeds): " + "; ".join(
        f"{arm}: masked {p['masked_rate']:.2f}%, in hack completions {p['masked_rate_rh']:.1f}%, in the others "
        f"{p['masked_rate_other']:.1f}%, hack share of trained {p['rh_share_trained']:.0f}%, of masked "
        f"{p['rh_share_masked']:.1f}%" for arm, p in pct.items()) + ".",  # fmt: skip
        f"Token shards: {len(sizes)}, median {statistics.median(sizes) / 1000:.1f} KB (range "
        f"{min(sizes) / 1000:.1f} to {max(sizes) / 1000:.1f}), {statistics.median(rows):.0f} rows (range {min(rows)} to "
        f"{max(rows)}), {per_row:.0f} bytes per row; every step of a {STEPS}-step run: "
        f"{STEPS * statistics.median(sizes) / 1e6:.1f} MB.",
        "The default masks applied afterwards reproduce the masks of the k16 runs: " + ", ".join(
            f"{c['agree']} of {c['tokens']} tokens ({c['masked']} masked)" for c in check) + "."]  # fmt: skip
    return "\n".join(lines) + "\n"


def pd_labels(labels: list):
    import pandas as pd

    return pd.Series(labels, dtype="object")


def _cell(values: list[float]) -> str:
    """mean +- SE over the seeds that have a value (a run without masked tokens has no hack share of them)."""
    have = [v for v in values if v == v]
    if not have:
        return "none masked"
    return fmt_mean_se(have, 4) + (f" (n = {len(have)})" if len(have) < len(values) else "")


def report(runs: dict) -> str:
    lines = ["| arm | masked rate | masked rate, hack completions | masked rate, others | concentration (hack - others) "
             "| hack share of trained tokens | hack share of masked tokens |", "|---|---|---|---|---|---|---|"]
    conc = {}
    for arm in ARMS:
        per = runs[arm]
        conc[arm] = {s: r["masked_rate_rh"] - r["masked_rate_other"] for s, r in per.items()}
        cell = lambda key: _cell([r[key] for r in per.values()])  # noqa: E731
        m, se = mean_se(list(conc[arm].values()))
        lines.append(f"| {arm}{' (default masks applied afterwards)' if arm.endswith('nomask') else ''} | "
                     f"{cell('masked_rate')} | {cell('masked_rate_rh')} | {cell('masked_rate_other')} | "
                     f"{fmt_diff(m, se, 4)}: {verdict(m, se, len(per))} | {cell('rh_share_trained')} | "
                     f"{cell('rh_share_masked')} |")  # fmt: skip
    lines += ["", "| comparison (paired by seed) | difference | verdict |", "|---|---|---|"]
    rate = {arm: {s: r["masked_rate"] for s, r in per.items()} for arm, per in runs.items()}
    for label, table, a, b in (("masked rate, k16 - k1", rate, "k16", "k1"), ("masked rate, k16 - k4", rate, "k16", "k4"),
                               ("concentration, k16 - k1", conc, "k16", "k1"),
                               ("masked rate, k16 trained with masks - k16 without (defaults applied)", rate, "k16",
                                "k16_nomask")):  # fmt: skip
        d, se, n = paired_difference(table[a], table[b])
        lines.append(f"| {label} | {fmt_diff(d, se, 4)} (n = {n}) | {verdict(d, se, n)} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    from trl_ext.cli_train import build_plan

    jobs = [(arm, seed) for seed in SEEDS for arm in ARMS]
    dirs = {job: build_plan(run_argv(*job)).run_dir for job in jobs}  # one at a time: HF's parser is not thread-safe
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda job: train(*job, dirs[job]), jobs))
    runs = {arm: {seed: analyse(dirs[(arm, seed)], arm.endswith("nomask")) for seed in SEEDS} for arm in ARMS}
    check = [reproduces_masks(dirs[("k16", seed)]) for seed in SEEDS]
    RESULTS.mkdir(parents=True, exist_ok=True)
    settings = {"base": BASE, "arms": ARMS, "seeds": SEEDS, "steps": STEPS, "every": EVERY, "from_step": FROM_STEP}
    (RESULTS / "token_records.json").write_text(json.dumps({"settings": settings, "runs": runs,
                                                            "masks_reproduced": check}, indent=1) + "\n")
    text = report(runs) + prose_numbers(runs, check)
    (RESULTS / "token_records.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
