"""Environment experiments on the builtin_env model (CPU, a few minutes): every stage runs train.py.

1. FrozenLake 4x4 (non-slippery) SFT on BFS trajectories -> success on held-out maps; then GRPO from the
   SFT checkpoint and the same validation (it should not drop). Success is measured on ``N_MAPS`` held-out
   maps both greedily and sampled (temperature 1, one episode per map, seed 0).
2. Two-armed bandit GRPO (brpo): the sampled share of the high-mean arm before and after.
3. Arithmetic GRPO: greedy accuracy on held-out problems before and after.

    uv run python experiments/env_experiments.py [--out experiments/results/environments.md]

The SFT stage (20 minutes measured on 2 shared cores) is reused when its run directory already holds a
``run_summary.json`` (same flags give the same run name).
"""

from __future__ import annotations

import argparse
import json
import os
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
from environments.base import make_env, run_episodes  # noqa: E402
from trl_ext.env_trainer import HELDOUT_LEVELS  # noqa: E402
from trl_ext.models import load_model_and_tokenizer  # noqa: E402
from trl_ext.sft import model_policy, validate  # noqa: E402

OUT = ROOT / "output" / "env_experiments"
COMMON = ["--no_wandb", "--logging_steps", "10", "--max_completion_length", "16", "--beta", "0.0"]
SFT = ["--mode", "sft", "--env", "frozenlake", "--model", "builtin_env", "--sft_train_size", "3000",
       "--sft_test_size", "100", "--sft_epochs", "5", "--lr", "1e-3", "--batch_size", "32"]  # fmt: skip
RL = ["--batch_size", "32", "--n_rollout", "8", "--adv_estimator", "brpo", "--lr", "5e-4"]
RL_AFTER_SFT = ["--batch_size", "32", "--n_rollout", "8", "--adv_estimator", "brpo", "--lr", "1e-4"]
RL_AFTER_SFT_STEPS = 100
N_EVAL = 200
N_MAPS = 400


def train(argv: list[str]) -> Path:
    """Run train.py; return its run directory (the last 'run dir:' line)."""
    cmd = [sys.executable, "train.py", *argv, *COMMON, "--output_dir", str(OUT)]
    print("$", " ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"train.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("run dir: "))
    return Path(line.removeprefix("run dir: "))


def checkpoint(run_dir: Path) -> str:
    return str(max(run_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1])))


def arm_share(model_dir: str, n: int = N_EVAL) -> dict:
    """Sampled (temperature 1) first answers on held-out bandit seeds: share of each arm and of invalid."""
    model, tok = load_model_and_tokenizer(model_dir)
    torch.manual_seed(0)
    envs = [make_env("two_armed_bandit") for _ in range(n)]
    trajs = run_episodes(envs, model_policy(model, tok, envs[0], 16, do_sample=True),
                         list(range(HELDOUT_LEVELS, HELDOUT_LEVELS + n)), 1)  # fmt: skip
    actions = [t.turns[0].info["action"] for t in trajs]
    return {"high": actions.count("high") / n, "low": actions.count("low") / n, "invalid": actions.count(None) / n}


def greedy(model_dir: str, env: str, n: int, turns: int) -> dict:
    model, tok = load_model_and_tokenizer(model_dir)
    return validate(model, tok, env, n, turns, 16, batch=100)


def greedy_and_sampled(model_dir: str, env: str, n: int, turns: int) -> dict:
    model, tok = load_model_and_tokenizer(model_dir)
    torch.manual_seed(0)
    sampled = validate(model, tok, env, n, turns, 16, batch=100, do_sample=True)
    return {"greedy": validate(model, tok, env, n, turns, 16, batch=100), "sampled": sampled}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(ROOT / "experiments" / "results" / "environments.md"))
    args = p.parse_args()
    torch.set_num_threads(2)
    from trl_ext.builtin_env_model import ensure_builtin_env

    base = str(ensure_builtin_env())
    res, t0 = {}, time.time()
    sft_dir = cli.build_plan([*SFT, *COMMON, "--output_dir", str(OUT)]).run_dir
    if not (sft_dir / "run_summary.json").is_file():
        train(SFT)
    res["frozenlake_sft"] = json.loads((sft_dir / "run_summary.json").read_text())
    res["frozenlake_base_eval"] = greedy_and_sampled(base, "frozenlake", N_MAPS, 5)
    res["frozenlake_sft_eval"] = greedy_and_sampled(str(sft_dir / "model"), "frozenlake", N_MAPS, 5)
    steps = str(RL_AFTER_SFT_STEPS)
    rl_dir = train(["--env", "frozenlake", "--model", str(sft_dir / "model"), *RL_AFTER_SFT, "--max_steps", steps,
                    "--save_steps", steps, "--seed", "0"])  # fmt: skip
    res["frozenlake_rl_eval"] = greedy_and_sampled(checkpoint(rl_dir), "frozenlake", N_MAPS, 5)

    res["bandit_before"] = arm_share(base)
    bandit_dir = train(["--env", "two_armed_bandit", "--model", "builtin_env", *RL, "--max_steps", "30",
                        "--save_steps", "30", "--seed", "0"])  # fmt: skip
    res["bandit_after"] = arm_share(checkpoint(bandit_dir))

    res["arithmetic_before"] = greedy(base, "arithmetic", N_EVAL, 1)
    arith_dir = train(["--env", "arithmetic", "--model", "builtin_env", *RL, "--max_steps", "30",
                       "--save_steps", "30", "--seed", "0"])  # fmt: skip
    res["arithmetic_after"] = greedy(checkpoint(arith_dir), "arithmetic", N_EVAL, 1)
    res["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(res, indent=2))
    (OUT / "results.json").write_text(json.dumps(res, indent=2))
    write_table(Path(args.out), res)


def write_table(path: Path, r: dict) -> None:
    b, s, fl = r["frozenlake_base_eval"], r["frozenlake_sft_eval"], r["frozenlake_rl_eval"]
    rate = lambda e: f"{e['greedy']['success_rate']:.3f} greedy / {e['sampled']['success_rate']:.3f} sampled"  # noqa: E731
    rows = [
        (f"FrozenLake 4x4 non-slippery, success on {N_MAPS} held-out maps (5 turns)", f"{rate(b)} (builtin_env)",
         f"{rate(s)} after SFT; {rate(fl)} after {RL_AFTER_SFT_STEPS} GRPO steps from SFT"),
        ("Two-armed bandit, sampled share of the high-mean arm (200 held-out seeds)",
         f"{r['bandit_before']['high']:.2f}", f"{r['bandit_after']['high']:.2f} after 30 GRPO steps (brpo)"),
        ("Arithmetic, greedy accuracy on 200 held-out problems",
         f"{r['arithmetic_before']['success_rate']:.3f}", f"{r['arithmetic_after']['success_rate']:.3f} after 30 GRPO steps"),
    ]  # fmt: skip
    sft = r["frozenlake_sft"]
    lines = ["# Environment experiments (builtin_env model, CPU)", "",
             "Produced by `uv run python experiments/env_experiments.py`; numbers as measured, one seed.", "",
             f"SFT: `{' '.join(SFT)}` ({sft['records']} BFS records, full fine-tune, {sft['wall_s']:.0f} s of "
             f"training). GRPO from the SFT model: `{' '.join(RL_AFTER_SFT)} --max_steps {RL_AFTER_SFT_STEPS}`. "
             f"Bandit and arithmetic GRPO: `{' '.join(RL)}`. All with `{' '.join(COMMON)}`. "
             f"Wall time without the SFT stage {r['wall_s']:.0f} s.", "",
             "| task | before | after |", "|---|---|---|"]  # fmt: skip
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    lines += ["", "Raw results:", "", "```json", json.dumps(r, indent=2), "```", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
