"""Step-time overhead of ExtGRPOTrainer (all extensions off) over a vanilla trl.GRPOTrainer.

Same config, seed, prompts and model; both trainers see the same prompt token ids (the vanilla one gets a
tokenizer copy that does not append [EOS], which is what ExtGRPOTrainer's `_tokenize_prompts` does).
Runs alternate vanilla / ours `--rounds` times in one process and compares median step times.

    uv run python bench/bench_step.py            # prints the ratio ours / vanilla (goal <= 1.03)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import torch
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from environments.stories import load_prompts
from trl_ext.config import ExtGRPOConfig
from trl_ext.models import model_source, prepare_tokenizer
from trl_ext.trainer import ExtGRPOTrainer


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times, self._t = [], None

    def on_step_begin(self, args, state, control, **kw):
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter() - self._t)


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
    return timer.times[warmup:]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(2)
    source = model_source("builtin")
    tok = prepare_tokenizer(AutoTokenizer.from_pretrained(source))
    vanilla_tok = copy.deepcopy(tok)
    vanilla_tok._tokenizer.post_processor = None  # no [EOS] appended, as ExtGRPOTrainer tokenizes prompts
    dataset = load_prompts("builtin", tok, 8, "train", 512, 42)
    times = {"vanilla": [], "ours": []}
    with tempfile.TemporaryDirectory() as out:
        for _ in range(args.rounds):
            times["vanilla"] += run(GRPOTrainer, GRPOConfig, vanilla_tok, dataset, args.steps, args.warmup, out)
            times["ours"] += run(ExtGRPOTrainer, ExtGRPOConfig, tok, dataset, args.steps, args.warmup, out)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"median step time: vanilla {med['vanilla']:.3f} s, ours {med['ours']:.3f} s "
          f"({len(times['ours'])} steps each)")  # fmt: skip
    print(f"ratio ours/vanilla = {med['ours'] / med['vanilla']:.3f}  (goal <= 1.03)")


if __name__ == "__main__":
    main()
