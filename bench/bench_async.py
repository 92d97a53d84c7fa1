"""Throughput of asynchronous rollouts: samples/s with --max_async_level 1 (non-strict, in-flight updates) over
--max_async_level 0 (TRL's synchronous generate-then-train) on the builtin model.

Same config for both (bench_step.py's: batch 32, 16 generations, 64 completion tokens, beta 0.02, lr 3e-4), same
prompts and seed, 2 torch threads in total (with k = 1 the generator thread gets 1 and the trainer keeps 1). One run
each; samples/s = completions trained per second of wall time from the end of the warm-up steps to the last step.
The load average is printed with the result: on a shared machine the ratio is only as good as the quiet it ran in.

    uv run python bench/bench_async.py            # prints the rates and the ratio (goal >= 1.6)

A third run, k = 0 on 1 thread, is printed for reference: for a model this small, 2 OpenMP threads can be slower
than 1, which is what lets the ratio pass 2 (the 1 + 1 split of k = 1 avoids that overhead as well as overlapping
generation with training).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads starve on shared cores

import torch  # noqa: E402
from transformers import AutoTokenizer, TrainerCallback

from environments.stories import load_prompts
from trl_ext.config import ExtGRPOConfig
from trl_ext.models import model_source, prepare_tokenizer
from trl_ext.trainer import ExtGRPOTrainer

BATCH = 32


class WallClock(TrainerCallback):
    def __init__(self, warmup: int):
        self.warmup, self.start, self.end = warmup, None, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.warmup:
            self.start = time.perf_counter()
        self.end = time.perf_counter()


def happy_binary(completions, **kwargs):
    return [float("happy" in c.lower().split()) for c in completions]


def samples_per_s(k: int, model: str, tokenizer, dataset, steps: int, warmup: int, out: str, threads: int) -> float:
    torch.set_num_threads(threads)
    clock = WallClock(warmup)
    args = ExtGRPOConfig(
        output_dir=out, per_device_train_batch_size=BATCH, num_generations=16, max_completion_length=64,
        learning_rate=3e-4, beta=0.02, loss_type="grpo", max_steps=steps + warmup, logging_steps=1000,
        save_strategy="no", report_to=[], seed=42, use_cpu=True, disable_tqdm=True, max_async_level=k,
    )  # fmt: skip
    torch.manual_seed(42)
    trainer = ExtGRPOTrainer(model=model, reward_funcs=[happy_binary], args=args, train_dataset=dataset,
                             processing_class=tokenizer, callbacks=[clock])  # fmt: skip
    trainer.train()
    return steps * BATCH / (clock.end - clock.start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="measured optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="steps before the clock starts")
    ap.add_argument("--model", default="builtin", help="'builtin' or a builtin-shaped model directory")
    ap.add_argument("--threads", type=int, default=2, help="torch threads in total (k = 1 splits them)")
    ap.add_argument("--no_reference", action="store_true", help="skip the k = 0 run with 1 thread")
    args = ap.parse_args()
    source = model_source(args.model)
    tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(source))
    dataset = load_prompts("builtin", tokenizer, 8, "train", 1024, 42)  # the builtin held-out stories
    runs = [(0, args.threads), (1, args.threads)] + ([] if args.no_reference else [(0, 1)])
    load_before = os.getloadavg()
    rates = {}
    with tempfile.TemporaryDirectory() as out:
        for k, threads in runs:
            rates[k, threads] = samples_per_s(k, source, tokenizer, dataset, args.steps, args.warmup, out, threads)
            print(f"max_async_level {k}, {threads} torch thread(s): {rates[k, threads]:.1f} samples/s", flush=True)
    load_after = os.getloadavg()
    async_rate = rates[1, args.threads]
    print(f"ratio k=1 / k=0 = {async_rate / rates[0, args.threads]:.2f}  (goal >= 1.6; both on {args.threads} threads)")
    if not args.no_reference:  # tiny models can run faster on 1 thread than on 2: the synchronous run at its best
        print(f"reference: k=1 / k=0 on 1 thread = {async_rate / rates[0, 1]:.2f}")
    print(f"{args.steps} steps each, load average {load_before[0]:.2f} before, {load_after[0]:.2f} after, "
          f"on {os.cpu_count()} CPUs")  # fmt: skip


if __name__ == "__main__":
    main()
