"""Throughput of off-policy RL on an environment: samples/s of multi-turn FrozenLake with --max_async_level 1
(non-strict, in-flight updates: the generator thread plays the episodes) over the same run synchronous (k = 0).

builtin_env model, 3 turns, batch 32 (8 levels x 4 rollouts), 96 completion tokens, beta 0.02, lr 1e-4, 2 torch
threads in total (k = 1: 1 for the generator, 1 for the trainer). Each round runs k = 0 (TRL's generation), k = 0
with ``--generation_backend fast`` and k = 1 with ``--generation_backend fast`` (the generator's fast sampler) from
the same initial weights, prompts and seed, in one process; a round's ratio is k = 1's samples/s (completions trained per second of wall
time after the warm-up steps) over k = 0's. The fast sampler ends a turn at the closing answer tag; TRL's generation
runs to the token limit (the tail is cut off afterwards), so k = 1 / k = 0 fast is the gain of asynchrony alone. Printed: min / median / max over the rounds and the load average.

    uv run python bench/bench_async_env.py            # goal: ratio >= 1.5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads starve on shared cores

import torch  # noqa: E402
from bench_async import BATCH, WallClock  # noqa: E402  (bench/ is the script's directory)

from trl_ext.config import train_config  # noqa: E402
from trl_ext.env.episodes import env_dataset, env_reward  # noqa: E402
from trl_ext.models import model_source, load_tokenizer, prepare_tokenizer  # noqa: E402
from trl_ext.trainer import ExtGRPOTrainer  # noqa: E402


def samples_per_s(k: int, source: str, tok, steps: int, warmup: int, out: str, backend: str = "trl") -> float:
    torch.set_num_threads(2)
    clock = WallClock(warmup)
    cfg = train_config(
        output_dir=out, per_device_train_batch_size=BATCH, num_generations=4, max_completion_length=96,
        learning_rate=1e-4, beta=0.02, max_steps=steps + warmup, logging_steps=1000, save_strategy="no",
        report_to=[], seed=42, use_cpu=True, disable_tqdm=True, max_async_level=k, env="frozenlake", max_turns=3,
        generation_backend=backend,
    )  # fmt: skip
    data = env_dataset(cfg.build_env(), 512, tok)
    torch.manual_seed(42)
    trainer = ExtGRPOTrainer(model=source, reward_funcs=[env_reward], args=cfg, train_dataset=data,
                             processing_class=tok, callbacks=[clock])  # fmt: skip
    trainer.train()
    return steps * BATCH / (clock.end - clock.start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8, help="measured optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="steps before the clock starts")
    a = ap.parse_args()
    source = model_source("builtin_env")
    tok = prepare_tokenizer(load_tokenizer(source))
    load_before, ratios, fast_ratios = os.getloadavg(), [], []
    with tempfile.TemporaryDirectory() as out:
        for r in range(a.rounds):
            sync = samples_per_s(0, source, tok, a.steps, a.warmup, out)
            sync_fast = samples_per_s(0, source, tok, a.steps, a.warmup, out, backend="fast")
            async_ = samples_per_s(1, source, tok, a.steps, a.warmup, out, backend="fast")
            ratios.append(async_ / sync)
            fast_ratios.append(async_ / sync_fast)
            print(f"round {r + 1}: k=0 {sync:.1f} samples/s, k=0 fast {sync_fast:.1f}, k=1 {async_:.1f}; "
                  f"k=1/k=0 {ratios[-1]:.2f}, k=1/k=0 fast {fast_ratios[-1]:.2f}", flush=True)
    print(f"ratio k=1 / k=0 over {a.rounds} rounds: min {min(ratios):.2f} / median {statistics.median(ratios):.2f} / "
          f"max {max(ratios):.2f} (goal >= 1.5)")
    print(f"ratio k=1 / k=0 fast (both with the fast sampler): min {min(fast_ratios):.2f} / median "
          f"{statistics.median(fast_ratios):.2f} / max {max(fast_ratios):.2f}")
    print(f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}, on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
