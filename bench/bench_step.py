"""Whole-step time of ExtGRPOTrainer over a vanilla trl.GRPOTrainer, with TRL's generation and with the fast backend.

Same config, seed, prompts and model (builtin, batch 32, 16 generations, 64 tokens, beta 0.02); every trainer sees
the same prompt token ids (the vanilla one gets a tokenizer copy that does not append [EOS], which is what
ExtGRPOTrainer's `_tokenize_prompts` does). Each round runs vanilla, ours (``--generation_backend trl``), fast
(``--generation_backend fast``) and vanilla again ("vanilla2") one after the other in one process, the order rotated
every round so that no arm always runs in the same position; a round's ratio is the median step time of the arm over
vanilla's in that round. Printed: min / median / max of the per-round ratios and the load average.

vanilla2/vanilla is the noise floor: the same trainer twice. On a shared machine it strays from 1 by as much as
ours/vanilla does (other load slows whole runs of one arm), so read ours/vanilla against it. Also printed: each arm
over the mean of the round's two vanilla runs (a baseline with half the variance).

Like with like: the reward function counts the completion tokens of every step. Runs are seeded, so step k of every
round does the same work; vanilla, vanilla2 and ours must generate the same tokens (checked, printed), fast samples
its own: its ratio per generated token is printed as well.

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
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from environments.stories import load_prompts  # noqa: E402
from trl_ext.config import ExtGRPOConfig, train_config  # noqa: E402
from trl_ext.models import model_source, load_tokenizer, prepare_tokenizer  # noqa: E402
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


def counting_reward(tokens: list[int]):
    """Reward 1 if "happy" occurs, else 0; appends each call's completion tokens (one call a step) to ``tokens``."""

    def happy_binary(completions, completion_ids, **kw):
        tokens.append(sum(len(ids) for ids in completion_ids))
        return [float("happy" in c.lower().split()) for c in completions]

    return happy_binary


def run(trainer_cls, config_cls, tokenizer, dataset, steps, warmup, out):
    common = dict(
        output_dir=out, per_device_train_batch_size=32, num_generations=16, max_completion_length=64,
        learning_rate=3e-4, beta=0.02, loss_type="grpo", max_steps=steps + warmup, logging_steps=1000,
        save_strategy="no", report_to=[], seed=42, bf16=False, activation_checkpointing=False, use_cpu=True,
        disable_tqdm=True,
    )  # fmt: skip
    timer, tokens = StepTimer(), []
    torch.manual_seed(42)
    trainer = trainer_cls(
        model=model_source("builtin"), reward_funcs=[counting_reward(tokens)], args=config_cls(**common),
        train_dataset=dataset, processing_class=tokenizer, callbacks=[timer],
    )  # fmt: skip
    trainer.train()
    if len(tokens) != len(timer.times):
        raise RuntimeError(f"{len(tokens)} reward calls for {len(timer.times)} steps: one generation per step expected")
    return timer.times[warmup:], timer.cpu[warmup:], tokens[warmup:]


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
    tok = prepare_tokenizer(load_tokenizer(source))
    vanilla_tok = copy.deepcopy(tok)
    vanilla_tok._tokenizer.post_processor = None  # no [EOS] appended, as ExtGRPOTrainer tokenizes prompts
    dataset = load_prompts("builtin", tok, 8, "train", 512, 42)
    arms = {
        "vanilla": (GRPOTrainer, GRPOConfig, vanilla_tok),
        "ours": (ExtGRPOTrainer, ExtGRPOConfig, tok),
        "fast": (ExtGRPOTrainer, functools.partial(ExtGRPOConfig, generation_backend="fast"), tok),
        "vanilla2": (GRPOTrainer, GRPOConfig, vanilla_tok),  # the noise floor
    }
    load_before = os.getloadavg()
    medians = {name: [] for name in arms}  # per round: median wall seconds per step
    cpu = {name: [] for name in arms}  # per round: median CPU seconds per step (less sensitive to other load)
    tokens = {name: None for name in arms}  # completion tokens of every measured step (the same every round)
    names = list(arms)
    with tempfile.TemporaryDirectory() as out:
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                trainer_cls, config_cls, tokenizer = arms[name]
                wall, cpu_s, toks = run(trainer_cls, config_cls, tokenizer, dataset, args.steps, args.warmup, out)
                if tokens[name] is not None and toks != tokens[name]:
                    raise RuntimeError(f"{name}: round {r + 1} generated {toks} tokens per step, "
                                       f"round 1 {tokens[name]}")  # fmt: skip
                tokens[name] = toks
                medians[name].append(statistics.median(wall))
                cpu[name].append(statistics.median(cpu_s))
            done = ", ".join(f"{n} {m[-1]:.3f} s ({cpu[n][-1]:.3f} CPU s)" for n, m in medians.items())
            print(f"round {r + 1}: {done} (load {os.getloadavg()[0]:.2f})", flush=True)
    load_after = os.getloadavg()
    same = {name: "the same" if tokens[name] == tokens["vanilla"] else "DIFFERENT" for name in ("ours", "vanilla2")}
    print(f"completion tokens per step: vanilla {tokens['vanilla']}; ours {same['ours']}, vanilla2 "
          f"{same['vanilla2']}; fast {tokens['fast']}")  # fmt: skip
    if "DIFFERENT" in same.values():
        print("ours or vanilla2 generated other completions than vanilla: its ratio is not like with like")
    for name in arms:
        print(f"step time {name}: wall {spread(medians[name])} s, CPU {spread(cpu[name])} s")
    for name, goal in (("ours", "goal <= 1.03"), ("fast", "goal <= 0.6"), ("vanilla2", "noise floor")):
        ratios = [a / v for a, v in zip(medians[name], medians["vanilla"], strict=True)]
        cpu_ratios = [a / v for a, v in zip(cpu[name], cpu["vanilla"], strict=True)]
        per_token = sum(tokens["vanilla"]) / sum(tokens[name])  # times this: the ratio per generated token
        print(f"ratio {name}/vanilla: wall {spread(ratios)}  ({goal}; {args.rounds} rounds); "
              f"CPU time {spread(cpu_ratios)}; per generated token: wall median "
              f"{statistics.median(ratios) * per_token:.3f}")  # fmt: skip
        if name != "vanilla2":
            both = [a / ((v + v2) / 2) for a, v, v2 in zip(medians[name], medians["vanilla"], medians["vanilla2"])]
            print(f"ratio {name}/(both vanilla runs): wall {spread(both)}")
    print(f"{args.steps} steps per run after {args.warmup} warm-up, {args.threads} torch threads, load average "
          f"{load_before[0]:.2f} before, {load_after[0]:.2f} after, on {os.cpu_count()} CPUs")  # fmt: skip


if __name__ == "__main__":
    main()
