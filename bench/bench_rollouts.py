"""Cost of ``--save_rollouts``: whole-step time with the rollout writer on over off, in one training run.

Quickstart config (builtin model, happy_binary, batch 32, 16 generations, 64 tokens, lr 3e-4, beta 0.02). One trainer
runs ``2 x rounds x steps`` steps; the writer is switched on and off every ``steps`` steps (alternating, starting with
off), after ``warmup`` steps. A round's ratio is the median step time with the writer over the median without.
Printed: min / median / max of the per-round ratios, the writer's own time per step, and the load average.

    uv run python bench/bench_rollouts.py            # goal: ratio <= 1.05
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads starve on shared cores

from transformers import TrainerCallback  # noqa: E402

from environments.stories import load_prompts  # noqa: E402
from trl_ext.config import train_config  # noqa: E402
from trl_ext.models import model_source, load_tokenizer, prepare_tokenizer  # noqa: E402
from trl_ext.trainer import ExtGRPOTrainer  # noqa: E402


def happy_binary(completions, **kw):
    return [float("happy" in c.lower().split()) for c in completions]


class Alternate(TrainerCallback):
    """Times each step and switches the writer on for odd blocks of ``steps`` steps after the warmup."""

    def __init__(self, steps: int, warmup: int):
        self.steps, self.warmup, self.records, self.write = steps, warmup, None, None
        self.times: list[tuple[int, bool, float]] = []  # (block, writer on, seconds)

    def on_step_begin(self, args, state, control, **kw):
        k = state.global_step - self.warmup
        self.block = k // self.steps if k >= 0 else -1
        self.on = self.block >= 0 and self.block % 2 == 1
        self.records.record = self.write if self.on else (lambda batch, ctx: None)
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        if self.block >= 0:
            self.times.append((self.block, self.on, time.perf_counter() - self._t))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    tok = prepare_tokenizer(load_tokenizer(model_source("builtin")))
    data = load_prompts("builtin", tok, 8, "train", 2048, 42)
    load_before = os.getloadavg()
    timer = Alternate(a.steps, a.warmup)
    with tempfile.TemporaryDirectory() as out:
        cfg = train_config(
            output_dir=out, per_device_train_batch_size=32, num_generations=16, max_completion_length=64,
            learning_rate=3e-4, beta=0.02, max_steps=a.warmup + 2 * a.rounds * a.steps, logging_steps=1000,
            save_strategy="no", report_to=[], seed=42, use_cpu=True, disable_tqdm=True, save_rollouts=True,
        )  # fmt: skip
        trainer = ExtGRPOTrainer(model=model_source("builtin"), reward_funcs=[happy_binary], args=cfg,
                                 train_dataset=data, processing_class=tok, callbacks=[timer])  # fmt: skip
        records = trainer.components.records  # the saved-rollouts component (trl_ext/runs/component.py)
        write_times, write = [], records.record

        def timed_write(*args, **kwargs):
            t = time.perf_counter()
            write(*args, **kwargs)
            write_times.append(time.perf_counter() - t)

        timer.records, timer.write = records, timed_write
        trainer.train()
    ratios = []
    for r in range(a.rounds):
        off = [t for b, on, t in timer.times if b == 2 * r and not on]
        on = [t for b, on, t in timer.times if b == 2 * r + 1 and on]
        ratios.append(statistics.median(on) / statistics.median(off))
        print(f"round {r + 1}: off {statistics.median(off):.3f} s/step, on {statistics.median(on):.3f} s/step, "
              f"ratio {ratios[-1]:.3f}")
    step_off = statistics.median([t for _, on, t in timer.times if not on])
    print(f"writer: {statistics.median(write_times) * 1e3:.1f} ms per step (median of {len(write_times)}), "
          f"{statistics.median(write_times) / step_off:.1%} of the median step without it")
    print(f"ratio on/off over {a.rounds} rounds: min {min(ratios):.3f} / median {statistics.median(ratios):.3f} / "
          f"max {max(ratios):.3f} (goal <= 1.05)")
    print(f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
