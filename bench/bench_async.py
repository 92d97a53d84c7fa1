"""Throughput of asynchronous rollouts: samples/s with --max_async_level 1 (non-strict, in-flight updates; the
generator thread samples with the fast sampler, ``--generation_backend fast``) over --max_async_level 0 (synchronous
generate-then-train, with TRL's generation and with --generation_backend fast) on the builtin model; and k = 1 with
the generator's transformers sampler (``--generation_backend trl``) beside it.

Same config for every arm (bench_step.py's: batch 32, 16 generations, 64 completion tokens, beta 0.02, lr 3e-4), same
prompts and seed, 2 torch threads in total (with k = 1 the generator thread gets 1 and the trainer keeps 1).
samples/s = completions trained per second of wall time from the end of the warm-up steps to the last step. The arms
alternate for --rounds rounds; the ratios are per round, printed as min / median / max with the load average.

    uv run python bench/bench_async.py            # goal: k=1 / k=0 >= 1.6
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads starve on shared cores

import torch  # noqa: E402
from transformers import TrainerCallback

from environments.stories import load_prompts
from trl_ext.config import train_config
from trl_ext.models import model_source, load_tokenizer, prepare_tokenizer
from trl_ext.trainer import ExtGRPOTrainer

BATCH = 32
ARMS = {"k=0 trl": (0, "trl"), "k=0 fast": (0, "fast"), "k=1": (1, "fast"), "k=1 trl": (1, "trl")}
"""name -> (max_async_level, generation_backend); k=1 trl: the generator samples with the transformers sampler."""


class WallClock(TrainerCallback):
    def __init__(self, warmup: int):
        self.warmup, self.start, self.end = warmup, None, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.warmup:
            self.start = time.perf_counter()
        self.end = time.perf_counter()


def happy_binary(completions, **kwargs):
    return [float("happy" in c.lower().split()) for c in completions]


def samples_per_s(k: int, backend: str, model: str, tokenizer, dataset, steps: int, warmup: int, out: str,
                  threads: int) -> float:  # fmt: skip
    torch.set_num_threads(threads)
    clock = WallClock(warmup)
    args = train_config(
        output_dir=out, per_device_train_batch_size=BATCH, num_generations=16, max_completion_length=64,
        learning_rate=3e-4, beta=0.02, loss_type="grpo", max_steps=steps + warmup, logging_steps=1000,
        save_strategy="no", report_to=[], seed=42, use_cpu=True, disable_tqdm=True, max_async_level=k,
        generation_backend=backend,
    )  # fmt: skip
    torch.manual_seed(42)
    trainer = ExtGRPOTrainer(model=model, reward_funcs=[happy_binary], args=args, train_dataset=dataset,
                             processing_class=tokenizer, callbacks=[clock])  # fmt: skip
    trainer.train()
    return steps * BATCH / (clock.end - clock.start)


def spread(values: list[float], fmt: str = ".2f") -> str:
    return f"median {statistics.median(values):{fmt}} (min {min(values):{fmt}}, max {max(values):{fmt}})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="measured optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="steps before the clock starts")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", default="builtin", help="'builtin' or a builtin-shaped model directory")
    ap.add_argument("--threads", type=int, default=2, help="torch threads in total (k = 1 splits them)")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    args = ap.parse_args()
    source = model_source(args.model)
    tokenizer = prepare_tokenizer(load_tokenizer(source))
    dataset = load_prompts("builtin", tokenizer, 8, "train", 1024, 42)  # the builtin held-out stories
    arms = {name: ARMS[name] for name in args.arms}
    load_before = os.getloadavg()
    rates = {name: [] for name in arms}
    with tempfile.TemporaryDirectory() as out:
        for r in range(args.rounds):
            for name, (k, backend) in arms.items():
                rates[name].append(samples_per_s(k, backend, source, tokenizer, dataset, args.steps, args.warmup, out,
                                                 args.threads))  # fmt: skip
            print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in rates.items())
                  + f" samples/s (load {os.getloadavg()[0]:.2f})", flush=True)  # fmt: skip
    load_after = os.getloadavg()
    for name in arms:
        print(f"{name}: {spread(rates[name], '.1f')} samples/s")
    for name, base in (("k=1", "k=0 trl"), ("k=1", "k=0 fast"), ("k=1 trl", "k=1")):
        if name in rates and base in rates:
            ratios = [a / b for a, b in zip(rates[name], rates[base], strict=True)]
            print(f"ratio {name} / {base} = {spread(ratios)}  ({args.rounds} rounds, {args.threads} threads)")
    print(f"{args.steps} steps per run after {args.warmup} warm-up, load average {load_before[0]:.2f} before, "
          f"{load_after[0]:.2f} after, on {os.cpu_count()} CPUs")  # fmt: skip


if __name__ == "__main__":
    main()
