"""Step time of the routed training step on the builtin model, against plain LoRA of the same total rank.

Variants (same model, prompts and seed; batch 32, 16 generations, 64 tokens, beta 0.02):
    lora        PEFT LoRA of rank R on the 7 projections: the matched-capacity plain LoRA step
    dual_plain  dual LoRA with ranks (R, 0), no routing: our adapter module alone
    single      dual LoRA (R/2, R/2), gradient routing "shared", single pass (the default)
    two_pass    the same with the two-pass reference step
The detector flags completions with an odd word count, so every batch is mixed (the two-pass worst case).
Completions are generated every K steps (``steps_per_generation``); the K-1 steps in between reuse the
buffer, so their time is the update alone (forward, routed backward, optimizer step). Runs alternate the
variants ``--rounds`` times in one process; each ratio is taken per round (medians within the round) and printed
as min / median / max over the rounds, with the load average.

    uv run python bench/bench_routing.py      # prints single/lora (goal <= 1.10) and two_pass/single
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # set before torch loads: spinning threads crawl on shared cores

import argparse  # noqa: E402
import statistics
import tempfile
import time

import torch
from transformers import TrainerCallback

from environments.stories import load_prompts
from rewards.config import as_trl_reward
from trl_ext.config import train_config
from trl_ext.models import model_source, load_tokenizer, prepare_tokenizer
from trl_ext.models.arch import architecture_of, model_config
from trl_ext.routing.setup import build_dual_lora_model
from trl_ext.trainer import ExtGRPOTrainer

ALPHA = 16.0
VARIANTS = ("lora", "dual_plain", "single", "two_pass")


class StepTimer(TrainerCallback):
    """(global step before the step, seconds) of every optimizer step."""

    def __init__(self):
        self.times, self._t = [], None

    def on_step_begin(self, args, state, control, **kw):
        self._t = (state.global_step, time.perf_counter())

    def on_step_end(self, args, state, control, **kw):
        self.times.append((self._t[0], time.perf_counter() - self._t[1]))


def happy_binary(texts):
    return [float("happy" in t.lower().split()) for t in texts]


def odd_words(texts):
    return [len(t.split()) % 2 == 1 for t in texts]


def run(variant: str, rank: int, tokenizer, dataset, steps: int, k: int, out: str) -> list[tuple[int, float]]:
    routed = variant in ("single", "two_pass")
    extra = {}
    if routed:
        extra = dict(gradient_routing=True, routing_mode="shared", retain_rank=rank // 2, forget_rank=rank // 2,
                     routing_two_pass=variant == "two_pass", eval_routing_steps=0)
    elif variant == "dual_plain":
        extra = dict(retain_rank=rank, forget_rank=0, eval_routing_steps=0)
    cfg = train_config(
        output_dir=out, per_device_train_batch_size=32, num_generations=16, max_completion_length=64,
        steps_per_generation=k, learning_rate=3e-4, beta=0.02, max_steps=steps, logging_steps=1000,
        save_strategy="no", report_to=[], seed=42, use_cpu=True, disable_tqdm=True, **extra,
    )  # fmt: skip
    source = model_source("builtin")
    kwargs, peft_config, layout = {}, None, None
    if variant == "lora":
        from peft import LoraConfig

        model = source
        targets = architecture_of(model_config("builtin")).resolve(None)  # every linear of a block, as train.py
        peft_config = LoraConfig(r=rank, lora_alpha=ALPHA, task_type="CAUSAL_LM", **targets.peft_kwargs())
    else:
        torch.manual_seed(42)
        model, layout = build_dual_lora_model(source, cfg, ALPHA)
        kwargs["dual_lora_layout"] = layout
    if routed:
        kwargs["rh_detector"] = ("odd_words", odd_words)
    timer = StepTimer()
    torch.manual_seed(42)
    trainer = ExtGRPOTrainer(
        model=model, reward_funcs=[as_trl_reward("happy_binary", happy_binary)], args=cfg, train_dataset=dataset,
        processing_class=tokenizer, peft_config=peft_config, callbacks=[timer], **kwargs,
    )  # fmt: skip
    trainer.train()
    return timer.times


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16, help="total adapter rank R (routed: R/2 + R/2)")
    ap.add_argument("--cycles", type=int, default=3, help="generation cycles per run (the first is warm-up)")
    ap.add_argument("--steps_per_generation", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if args.rank % 2 or args.cycles < 2 or args.steps_per_generation < 2:
        ap.error("--rank must be even, --cycles >= 2 and --steps_per_generation >= 2")
    torch.set_num_threads(2)
    k = args.steps_per_generation
    tok = prepare_tokenizer(load_tokenizer(model_source("builtin")))
    dataset = load_prompts("builtin", tok, 8, "train", 512, 42)
    update = {v: [] for v in VARIANTS}  # per round: median update-step time
    whole = {v: [] for v in VARIANTS}  # per round: mean whole-step time (generation included)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as out:
        for r in range(args.rounds):
            for v in VARIANTS:
                times = [(s, t) for s, t in run(v, args.rank, tok, dataset, args.cycles * k, k, out) if s >= k]
                update[v].append(statistics.median([t for s, t in times if s % k]))
                whole[v].append(sum(t for _, t in times) / len(times))
            print(f"round {r + 1}: update step " + ", ".join(f"{v} {update[v][-1]:.4f} s" for v in VARIANTS)
                  + f" (load {os.getloadavg()[0]:.2f})", flush=True)  # fmt: skip

    def ratio(a: dict, x: str, y: str) -> str:
        values = [p / q for p, q in zip(a[x], a[y], strict=True)]
        return f"median {statistics.median(values):.3f} (min {min(values):.3f}, max {max(values):.3f})"

    print(f"update step (no generation), per-round medians over {args.rounds} rounds:")
    for v in VARIANTS:
        print(f"  {v:<10} {statistics.median(update[v]):.4f} s   whole step incl. generation "
              f"{statistics.median(whole[v]):.3f} s")  # fmt: skip
    print(f"ratio single-pass routed / plain LoRA rank {args.rank} = {ratio(update, 'single', 'lora')}  (goal <= 1.10)")
    print(f"ratio two-pass / single-pass = {ratio(update, 'two_pass', 'single')}")
    print(f"ratio dual LoRA ({args.rank}, 0) / PEFT LoRA = {ratio(update, 'dual_plain', 'lora')}")
    print(f"whole-step ratio single-pass routed / plain LoRA = {ratio(whole, 'single', 'lora')}")
    print(f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after, on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
