"""Environment experiments on the builtin_env model (CPU, a few minutes): every stage runs train.py.

1. FrozenLake 4x4 (non-slippery) SFT on BFS trajectories -> greedy success on held-out maps; then GRPO
   from the SFT checkpoint and the same validation (it should not drop).
2. Two-armed bandit GRPO (brpo): the sampled share of the high-mean arm before and after.
3. Arithmetic GRPO: greedy accuracy on held-out problems before and after.

    uv run python experiments/env_experiments.py [--out experiments/results/environments.md]
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

from environments.base import make_env, run_episodes  # noqa: E402
from trl_ext.env_trainer import HELDOUT_LEVELS  # noqa: E402
from trl_ext.models import load_model_and_tokenizer  # noqa: E402
from trl_ext.sft import model_policy, validate  # noqa: E402

OUT = ROOT / "output" / "env_experiments"
COMMON = ["--no_wandb", "--logging_steps", "10", "--max_completion_length", "16", "--beta", "0.0"]
SFT = ["--mode", "sft", "--env", "frozenlake", "--model", "builtin_env", "--sft_train_size", "500",
       "--sft_test_size", "100", "--sft_epochs", "3", "--lr", "1e-3", "--batch_size", "32"]  # fmt: skip
RL = ["--batch_size", "32", "--n_rollout", "8", "--adv_estimator", "brpo", "--lr", "5e-4"]
N_EVAL = 200


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
    return validate(model, tok, env, n, turns, 16)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(ROOT / "experiments" / "results" / "environments.md"))
    args = p.parse_args()
    torch.set_num_threads(2)
    from trl_ext.builtin_env_model import ensure_builtin_env

    base = str(ensure_builtin_env())
    res, t0 = {}, time.time()

    done = sorted(OUT.glob("sft-frozenlake*/run_summary.json"))  # reuse a finished SFT stage
    sft_dir = done[0].parent if done else train([*SFT, "--seed", "0"])
    sft = json.loads((sft_dir / "run_summary.json").read_text())
    res["frozenlake_sft"] = sft
    rl_dir = train(["--env", "frozenlake", "--model", str(sft_dir / "model"), *RL, "--max_steps", "20",
                    "--save_steps", "20", "--seed", "0"])  # fmt: skip
    res["frozenlake_rl_after_sft"] = greedy(checkpoint(rl_dir), "frozenlake", 100, 5)

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
    s, fl = r["frozenlake_sft"], r["frozenlake_rl_after_sft"]
    rows = [
        ("FrozenLake 4x4 non-slippery, greedy success on 100 held-out maps (5 turns)",
         f"{s['validation_before']['success_rate']:.2f} (builtin_env)",
         f"{s['validation_after']['success_rate']:.2f} after SFT; {fl['success_rate']:.2f} after 20 GRPO steps from SFT"),
        ("Two-armed bandit, sampled share of the high-mean arm (200 held-out seeds)",
         f"{r['bandit_before']['high']:.2f}", f"{r['bandit_after']['high']:.2f} after 30 GRPO steps (brpo)"),
        ("Arithmetic, greedy accuracy on 200 held-out problems",
         f"{r['arithmetic_before']['success_rate']:.3f}", f"{r['arithmetic_after']['success_rate']:.3f} after 30 GRPO steps"),
    ]  # fmt: skip
    lines = ["# Environment experiments (builtin_env model, CPU)", "",
             "Produced by `uv run python experiments/env_experiments.py`; numbers as measured, one seed.", "",
             f"SFT: {s['records']} BFS records from 500 training maps, 3 epochs, lr 1e-3, full fine-tune. "
             f"GRPO: batch 32, n_rollout 8, brpo, lr 5e-4, beta 0, max 16 completion tokens. "
             f"Total wall time {r['wall_s']:.0f} s.", "",
             "| task | before | after |", "|---|---|---|"]  # fmt: skip
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    lines += ["", "Raw results:", "", "```json", json.dumps(r, indent=2), "```", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
