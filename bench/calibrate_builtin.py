"""Calibration: can plain TRL GRPO teach the builtin model to say "happy" within 120 steps on CPU?

Runs vanilla ``trl.GRPOTrainer`` (no project extensions) with reward 1.0 when the whole word "happy"
occurs in the completion (case-insensitive), prompts from ``load_prompts(split="train")``, and
GRPOConfig(bs 32, 16 generations, 64 tokens, beta 0.02, loss_type "grpo", fp32, CPU). Prompts are
tokenized with ``add_special_tokens=False`` (TRL's default would append [EOS] to every prompt).

Prints the reward curve, the first logged steps with reward >= 0.5 and >= 0.9, the mean over the last
20 logged steps and the last 20 steps, s/step, and fresh samples from the trained model (happy rate,
unique fraction). Goal: start < 0.3, last-20 mean >= 0.9.

    uv run python bench/calibrate_builtin.py [--lr 3e-4] [--max_steps 120]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp (see trl_ext.models.builtin)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from environments.stories import load_prompts  # noqa: E402
from trl_ext.config import DEFAULT_PROMPT_LENGTH as PROMPT_LENGTH  # noqa: E402
from trl_ext.models import model_source, load_tokenizer, prepare_tokenizer  # noqa: E402

HAPPY = re.compile(r"\bhappy\b", re.IGNORECASE)


class PlainPromptGRPOTrainer(GRPOTrainer):
    """Vanilla GRPOTrainer except that text prompts are tokenized without special tokens (no [EOS] appended)."""

    def _tokenize_prompts(self, prompts: list):
        if isinstance(prompts[0], str):
            return self.processing_class(text=prompts, add_special_tokens=False)["input_ids"], None, {}
        return super()._tokenize_prompts(prompts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin", help="'builtin' or a local copy of a builtin-shaped model")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--max_steps", type=int, default=120)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--output_dir", default="output/calibrate_builtin")
    args = ap.parse_args()
    torch.set_num_threads(2)

    path = model_source(args.model)
    tokenizer = prepare_tokenizer(load_tokenizer(path))
    prompts = load_prompts("builtin", tokenizer, PROMPT_LENGTH, "train", 2048, args.seed)
    step_rewards: list[float] = []

    def happy_binary(completions, **kwargs):
        rewards = [1.0 if HAPPY.search(c) else 0.0 for c in completions]
        step_rewards.append(sum(rewards) / len(rewards))
        return rewards

    cfg = GRPOConfig(
        output_dir=args.output_dir, per_device_train_batch_size=32, num_generations=16, max_completion_length=64,
        learning_rate=args.lr, beta=0.02, loss_type="grpo", bf16=False, gradient_checkpointing=False, use_cpu=True,
        logging_steps=5, max_steps=args.max_steps, report_to="none", seed=args.seed, temperature=1.0,
        save_strategy="no",
    )  # fmt: skip
    trainer = PlainPromptGRPOTrainer(
        model=path, reward_funcs=happy_binary, args=cfg, train_dataset=prompts, processing_class=tokenizer
    )
    start = time.time()
    trainer.train()
    wall = time.time() - start

    logged = [(h["step"], h["reward"]) for h in trainer.state.log_history if "reward" in h]
    cross = {t: next((s for s, r in logged if r >= t), None) for t in (0.5, 0.9)}
    last20_logged = sum(r for _, r in logged[-20:]) / len(logged[-20:])
    last20_steps = sum(step_rewards[-20:]) / len(step_rewards[-20:])
    print("logged (step, reward):", [(s, round(r, 3)) for s, r in logged])
    print(f"first-step reward {step_rewards[0]:.3f}; first logged reward {logged[0][1]:.3f}")
    print(f"first logged step with reward >= 0.5: {cross[0.5]}, >= 0.9: {cross[0.9]}")
    print(f"mean reward over last 20 logged steps {last20_logged:.3f}, over last 20 steps {last20_steps:.3f}")
    print(f"{wall / args.max_steps:.3f} s/step ({wall:.0f} s for {args.max_steps} steps)")

    test = list(load_prompts("builtin", tokenizer, PROMPT_LENGTH, "test", 64, 0)["prompt"])
    model = trainer.model.eval()
    enc = tokenizer(test, add_special_tokens=False, return_tensors="pt", padding=True)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            **enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=64,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    summary = {
        "lr": args.lr,
        "cross_0.5": cross[0.5],
        "cross_0.9": cross[0.9],
        "first_step_reward": step_rewards[0],
        "last20_logged": last20_logged,
        "last20_steps": last20_steps,
        "s_per_step": wall / args.max_steps,
        "final_happy_rate": sum(bool(HAPPY.search(t)) for t in texts) / len(texts),
        "final_unique_fraction": len(set(texts)) / len(texts),
        "samples": [p + " ||| " + t for p, t in zip(test[:3], texts[:3])],
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
