"""Environment experiments on the builtin_env model (CPU): every training stage runs train.py.

1. Two-armed bandit with RAGEN's named arms (phoenix = low risk, dragon = high risk, shown in a per-seed
   shuffled order): the sampled share of the high-risk arm on ``N_EVAL`` held-out seeds before and after
   ``BANDIT_STEPS`` GRPO steps (brpo), for each training seed in ``SEEDS``.
2. FrozenLake 4x4: SFT on the BFS paths of ``SFT_MAPS`` training maps (the non-slippery paths, which are
   also the SFT data of slippery ice), one SFT run per training seed; success on ``N_MAPS`` held-out maps
   on non-slippery and on slippery ice (RAGEN's default), greedy and sampled (temperature 1, one episode
   per map, torch seed 0), before and after. Reference: an oracle that takes the BFS move (non-slippery
   dynamics) from wherever it stands, on the same maps.
3. Arithmetic GRPO (one seed): greedy accuracy on held-out problems before and after.
4. Control for 1 (stage ``bandit_swapped``): the same bandit GRPO with the names swapped (``dragon`` the
   low-risk arm, ``phoenix`` the high-risk one): does the learned preference follow the payoffs or a name?

    uv run python experiments/env_experiments.py [--out experiments/results/environments.md]

Stages whose run directory already holds a ``run_summary.json`` (same flags give the same run name) are
reused. Mean and standard error (SE) are over the training seeds; every single value is in the raw JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402

import trl_ext.cli_train as cli  # noqa: E402
from environments.base import answer_text, make_env, run_episodes  # noqa: E402
from environments.solvers import shortest_actions  # noqa: E402
from trl_ext.env.args import HELDOUT_LEVELS  # noqa: E402
from trl_ext.models import load_model_and_tokenizer  # noqa: E402
from trl_ext.sft import model_policy, validate  # noqa: E402

OUT = ROOT / "output" / "env_experiments_v3"
SEEDS = (0, 1, 2)
COMMON = ["--no_wandb", "--logging_steps", "10", "--max_completion_length", "16", "--beta", "0.0"]
SFT_MAPS, SFT_EPOCHS = 1500, 2
SFT = ["--mode", "sft", "--env", "frozenlake", "--model", "builtin_env", "--sft_train_size", str(SFT_MAPS),
       "--sft_test_size", "20", "--sft_epochs", str(SFT_EPOCHS), "--lr", "1e-3", "--batch_size", "32"]  # fmt: skip
RL = ["--batch_size", "32", "--n_rollout", "8", "--adv_estimator", "brpo", "--lr", "5e-4"]
BANDIT_STEPS = 30
N_EVAL = 200
N_MAPS = 400
ICE = {"non-slippery": {"slippery": False}, "slippery": {"slippery": True}}


def train(argv: list[str]) -> Path:
    """Run train.py (reusing a finished run of the same name); return its run directory."""
    full = [*argv, *COMMON, "--output_dir", str(OUT)]
    run_dir = cli.build_plan(full).run_dir
    if (run_dir / "run_summary.json").is_file():
        return run_dir
    print("$ train.py", " ".join(full), flush=True)
    proc = subprocess.run([sys.executable, "train.py", *full], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"train.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return run_dir


def checkpoint(run_dir: Path) -> str:
    return str(max(run_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1])))


SWAPPED = {"low_risk_name": "dragon", "high_risk_name": "phoenix"}


def arm_share(model_dir: str, n: int = N_EVAL, params: dict | None = None) -> dict:
    """Sampled (temperature 1) answers on held-out bandit seeds: share of each risk and of invalid."""
    model, tok = load_model_and_tokenizer(model_dir)
    torch.manual_seed(0)
    envs = [make_env("two_armed_bandit", **(params or {})) for _ in range(n)]
    trajs = run_episodes(envs, model_policy(model, tok, envs[0], 16, do_sample=True),
                         list(range(HELDOUT_LEVELS, HELDOUT_LEVELS + n)), 1)  # fmt: skip
    risks = [t.turns[0].info.get("risk") for t in trajs]
    return {"high": risks.count("high") / n, "low": risks.count("low") / n, "invalid": risks.count(None) / n}


def lake_evals(model_dir: str) -> dict:
    """Success on N_MAPS held-out maps: {ice: {greedy, sampled}}."""
    model, tok = load_model_and_tokenizer(model_dir)
    out = {}
    for ice, params in ICE.items():
        torch.manual_seed(0)
        sampled = validate(model, tok, "frozenlake", N_MAPS, 5, 16, batch=100, env_params=params, do_sample=True)
        greedy = validate(model, tok, "frozenlake", N_MAPS, 5, 16, batch=100, env_params=params)
        out[ice] = {"greedy": greedy, "sampled": sampled}
    return out


def oracle(params: dict) -> float:
    """Success of the BFS move (non-slippery dynamics) from the current cell, on the held-out maps."""
    seeds = list(range(HELDOUT_LEVELS, HELDOUT_LEVELS + N_MAPS))
    envs = {s: make_env("frozenlake", **params) for s in seeds}
    policy = lambda trajs: [answer_text(shortest_actions(envs[t.seed])[0]) for t in trajs]  # noqa: E731
    trajs = run_episodes([envs[s] for s in seeds], policy, seeds, 5)
    return sum(t.success for t in trajs) / N_MAPS


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(ROOT / "experiments" / "results" / "environments.md"))
    p.add_argument("--stages", default="bandit,frozenlake,arithmetic")
    args = p.parse_args()
    torch.set_num_threads(2)
    from trl_ext.models.builtin_env import ensure_builtin_env

    base = str(ensure_builtin_env())
    raw_path = OUT / "results.json"
    res = json.loads(raw_path.read_text()) if raw_path.is_file() else {}
    stages = args.stages.split(",")
    t0 = time.time()
    if "bandit" in stages:
        res["bandit_before"] = arm_share(base)
        res["bandit_after"] = {}
        for seed in SEEDS:
            run = train(["--env", "two_armed_bandit", "--model", "builtin_env", *RL, "--max_steps", str(BANDIT_STEPS),
                         "--save_steps", str(BANDIT_STEPS), "--seed", str(seed)])  # fmt: skip
            res["bandit_after"][str(seed)] = arm_share(checkpoint(run))
            save(raw_path, res)
    if "bandit_swapped" in stages:
        res["bandit_swapped_before"] = arm_share(base, params=SWAPPED)
        res["bandit_swapped_after"] = {}
        for seed in SEEDS:
            run = train(["--env", "two_armed_bandit", "--env_params", "low_risk_name=dragon,high_risk_name=phoenix",
                         "--model", "builtin_env", *RL, "--max_steps", str(BANDIT_STEPS),
                         "--save_steps", str(BANDIT_STEPS), "--seed", str(seed)])  # fmt: skip
            res["bandit_swapped_after"][str(seed)] = arm_share(checkpoint(run), params=SWAPPED)
            save(raw_path, res)
    if "frozenlake" in stages:
        res["frozenlake_oracle"] = {ice: oracle(params) for ice, params in ICE.items()}
        res["frozenlake_base"] = lake_evals(base)
        res["frozenlake_sft"] = {}
        for seed in SEEDS:
            run = train([*SFT, "--seed", str(seed)])
            summary = json.loads((run / "run_summary.json").read_text())
            res["frozenlake_sft"][str(seed)] = {"records": summary["records"], "wall_s": summary["wall_s"],
                                                **lake_evals(str(run / "model"))}  # fmt: skip
            save(raw_path, res)
    if "arithmetic" in stages:
        res["arithmetic_before"] = validate(*load_model_and_tokenizer(base), "arithmetic", N_EVAL, 1, 16, batch=100)
        run = train(["--env", "arithmetic", "--model", "builtin_env", *RL, "--max_steps", "30", "--save_steps", "30",
                     "--seed", "0"])  # fmt: skip
        model, tok = load_model_and_tokenizer(checkpoint(run))
        res["arithmetic_after"] = validate(model, tok, "arithmetic", N_EVAL, 1, 16, batch=100)
    res[f"wall_s_{'+'.join(stages)}"] = round(time.time() - t0, 1)
    save(raw_path, res)
    print(json.dumps(res, indent=2))
    write_table(Path(args.out), res)


def save(path: Path, res: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2))


def mean_se(values: list[float]) -> str:
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return f"{statistics.fmean(values):.3f} ± {se:.3f}"


def write_table(path: Path, r: dict) -> None:
    from trl_ext.models.builtin_env import VERSION

    lines = [f"# Environment experiments (builtin_env model {VERSION}, RAGEN prompts, CPU)", "",
             "Produced by `uv run python experiments/env_experiments.py`; numbers as measured. "
             f"Mean ± standard error over the training seeds {list(SEEDS)}; raw values below.", "",
             f"SFT: `{' '.join(SFT)}`. Bandit GRPO: `{' '.join(RL)} --max_steps {BANDIT_STEPS}`. "
             f"All with `{' '.join(COMMON)}`.", ""]  # fmt: skip
    if "bandit_after" in r:
        after = [v["high"] for v in r["bandit_after"].values()]
        lines += ["| bandit (named arms), sampled share of the high-risk arm, 200 held-out seeds | value |", "|---|---|",
                  f"| builtin_env before training | {r['bandit_before']['high']:.3f} "
                  f"(invalid {r['bandit_before']['invalid']:.3f}) |",
                  f"| after {BANDIT_STEPS} GRPO steps (brpo), {len(after)} seeds | {mean_se(after)} "
                  f"({', '.join(f'{a:.3f}' for a in after)}) |"]  # fmt: skip
        if "bandit_swapped_after" in r:
            lab = [v["high"] for v in r["bandit_swapped_after"].values()]
            lines += [f"| control, names swapped (phoenix high-risk): before | {r['bandit_swapped_before']['high']:.3f} |",
                      f"| control, names swapped: after {BANDIT_STEPS} steps, {len(lab)} seeds | "
                      f"{mean_se(lab)} ({', '.join(f'{a:.3f}' for a in lab)}) |"]  # fmt: skip
        lines.append("")
    if "frozenlake_sft" in r:
        lines += [f"| FrozenLake 4x4, success on {N_MAPS} held-out maps, 5 turns | greedy | sampled |", "|---|---|---|"]
        for ice in ICE:
            b = r["frozenlake_base"][ice]
            runs = list(r["frozenlake_sft"].values())
            g = [x[ice]["greedy"]["success_rate"] for x in runs]
            s = [x[ice]["sampled"]["success_rate"] for x in runs]
            lines += [f"| {ice}: builtin_env | {b['greedy']['success_rate']:.3f} | {b['sampled']['success_rate']:.3f} |",
                      f"| {ice}: after SFT ({len(runs)} seeds) | {mean_se(g)} | {mean_se(s)} |",
                      f"| {ice}: BFS-move oracle | {r['frozenlake_oracle'][ice]:.3f} | |"]  # fmt: skip
        lines.append("")
    if "arithmetic_after" in r:
        lines += [f"Arithmetic (one seed), greedy accuracy on {N_EVAL} held-out problems: "
                  f"{r['arithmetic_before']['success_rate']:.3f} before, "
                  f"{r['arithmetic_after']['success_rate']:.3f} after 30 GRPO steps.", ""]  # fmt: skip
    lines += ["Raw results:", "", "```json", json.dumps(r, indent=2), "```", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
