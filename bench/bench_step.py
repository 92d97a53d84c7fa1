"""Whole-step time of ExtGRPOTrainer over a vanilla trl.GRPOTrainer, with TRL's generation and with the fast backend.

Same config, seed, prompts and model (builtin, batch 32, 16 generations, 64 tokens, beta 0.02); every trainer sees
the same prompt token ids (the vanilla one gets a tokenizer copy that does not append [EOS], which is what
ExtGRPOTrainer's `_tokenize_prompts` does). Each round runs vanilla, ours (``--generation_backend trl``) and fast
(``--generation_backend fast``) one after the other in one process; a round's ratio is the median step time of the arm
over vanilla's in that round. Printed: min / median / max of the per-round ratios and the load average.

    uv run python bench/bench_step.py            # goals: ours/vanilla <= 1.03, fast/vanilla <= 0.6
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads starve on shared cores

import torch  # noqa: E402
from transformers import AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from environments.stories import load_prompts  # noqa: E402
from trl_ext.config import ExtGRPOConfig  # noqa: E402
from trl_ext.models import model_source, prepare_tokenizer  # noqa: E402
from trl_ext.trainer import ExtGRPOTrainer  # noqa: E402


class StepTimer(TrainerCallback):
    """Wall seconds and process CPU seconds (all threads) of every step."""

    def __init__(self):
        self.times, self.cpu, self._t = [], [], None

    def on_step_begin(self, args, state, control, **kw):
        self._t = (time.perf_counter(), time.process_time())

    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter() - self._t[0])
        self.cpu.append(time.process_time() - self._t[1])


def happy_binary(completions, **kw):
    return [float("happy" in c.lower().split()) for c in completions]


def run(trainer_cls, config_cls, tokenizer, dataset, steps, warmup, out):
    common = dict(
        output_dir=out, per_device_train_batch_size=32, num_generations=16, max_completion_length=64,
        learning_rate=3e-4, beta=0.02, loss_type="grpo", max_steps=steps + warmup, logging_steps=1000,
        save_strategy="no", report_to=[], seed=42, bf16=False, activation_checkpointing=False, use_cpu=True,
        disable_tqdm=True,
    )  # fmt: skip
    timer = StepTimer()
    torch.manual_seed(42)
    trainer = trainer_cls(
        model=model_source("builtin"), reward_funcs=[happy_binary], args=config_cls(**common),
        train_dataset=dataset, processing_class=tokenizer, callbacks=[timer],
    )  # fmt: skip
    trainer.train()
    return timer.times[warmup:], timer.cpu[warmup:]


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f} (min {min(values):.3f}, max {max(values):.3f})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    source = model_source("builtin")
    tok = prepare_tokenizer(AutoTokenizer.from_pretrained(source))
    vanilla_tok = copy.deepcopy(tok)
    vanilla_tok._tokenizer.post_processor = None  # no [EOS] appended, as ExtGRPOTrainer tokenizes prompts
    dataset = load_prompts("builtin", tok, 8, "train", 512, 42)
    arms = {
        "vanilla": (GRPOTrainer, GRPOConfig, vanilla_tok),
        "ours": (ExtGRPOTrainer, ExtGRPOConfig, tok),
        "fast": (ExtGRPOTrainer, functools.partial(ExtGRPOConfig, generation_backend="fast"), tok),
    }
    load_before = os.getloadavg()
    medians = {name: [] for name in arms}  # per round: median wall seconds per step
    cpu = {name: [] for name in arms}  # per round: median CPU seconds per step (less sensitive to other load)
    with tempfile.TemporaryDirectory() as out:
        for r in range(args.rounds):
            for name, (trainer_cls, config_cls, tokenizer) in arms.items():
                wall, cpu_s = run(trainer_cls, config_cls, tokenizer, dataset, args.steps, args.warmup, out)
                medians[name].append(statistics.median(wall))
                cpu[name].append(statistics.median(cpu_s))
            done = ", ".join(f"{n} {m[-1]:.3f} s ({cpu[n][-1]:.3f} CPU s)" for n, m in medians.items())
            print(f"round {r + 1}: {done} (load {os.getloadavg()[0]:.2f})", flush=True)
    load_after = os.getloadavg()
    for name in arms:
        print(f"step time {name}: wall {spread(medians[name])} s, CPU {spread(cpu[name])} s")
    for name, goal in (("ours", "<= 1.03"), ("fast", "<= 0.6")):
        ratios = [a / v for a, v in zip(medians[name], medians["vanilla"], strict=True)]
        cpu_ratios = [a / v for a, v in zip(cpu[name], cpu["vanilla"], strict=True)]
        print(f"ratio {name}/vanilla: wall {spread(ratios)}  (goal {goal}; {args.rounds} rounds); "
              f"CPU time {spread(cpu_ratios)}")  # fmt: skip
    print(f"{args.steps} steps per run after {args.warmup} warm-up, {args.threads} torch threads, load average "
          f"{load_before[0]:.2f} before, {load_after[0]:.2f} after, on {os.cpu_count()} CPUs")  # fmt: skip


if __name__ == "__main__":
    main()
