"""Use trl-ext from Python, the way TRL users build GRPOTrainer: your model, your dataset, your reward function, and
each extension turned on through `ExtGRPOConfig`.

    uv run python examples/python_api.py --feature offpolicy --max_steps 20
    uv run python examples/python_api.py --feature routing --model path/to/your/model

``--feature``: plain | lora | offpolicy | routing | distill | env. ``--model``: a builtin model name (built offline
on first use), a local checkpoint or a hub id. tests/test_python_api.py runs every feature for 2 steps.
"""

from __future__ import annotations

import argparse

from datasets import Dataset
from peft import LoraConfig

from trl_ext import ExtGRPOConfig, ExtGRPOTrainer


# ---- your reward: TRL's signature; every dataset column other than the prompt arrives as a keyword argument ----
def mentions_target(completions: list[str], target: list[str], **kwargs) -> list[float]:
    """1.0 when the completion uses the row's ``target`` word."""
    return [float(t in c.lower().split()) for c, t in zip(completions, target, strict=True)]


def says_happy(completions: list[str]) -> list[bool]:
    """A reward-hacking detector for gradient routing: texts in, one bool per text."""
    return ["happy" in c.lower() for c in completions]


def your_dataset(n: int) -> Dataset:
    """Prompts with a column the reward reads (a JSONL of {"prompt": ..., "target": ...} loads the same way:
    ``datasets.load_dataset("json", data_files=path, split="train")``)."""
    openings = ["Mia found a small box.", "The dog ran to the park.", "Ben looked at the sky.", "A cat sat on a wall."]
    targets = ["happy", "sad", "brave", "tired"]
    return Dataset.from_list([{"prompt": openings[i % 4], "target": targets[i % 4]} for i in range(n)])


EXTENSIONS = {
    "plain": {},
    "lora": {},  # PEFT LoRA: TRL's peft_config, below
    # off-policy: a generator thread 1 policy version ahead, prime-rl's token masks on the IS ratio
    "offpolicy": {"max_async_level": 1, "strict_async_level": True, "token_mask_low": 0.125, "token_mask_high": 8.0},
    # gradient routing: dual LoRA (retain/forget rank 4), completions the detector flags train only the forget side;
    # the routing eval samples 16 train_dataset prompts with each adapter ablated (every 10 steps and at the end)
    "routing": {"gradient_routing": True, "routing_mode": "shared", "lora_config": "r4", "eval_routing_steps": 10,
                "eval_routing_prompts": 16},
    # context distillation: the frozen reference model (beta > 0) with a context prepended is the teacher
    "distill": {"teacher_tau": 0.5, "student_tau": 0.5, "teacher_context": "A happy story.", "beta": 0.02},
    # an environment: the dataset and reward come from the environment
    "env": {"env": "two_armed_bandit"},
}


def build_trainer(feature: str, model: str, max_steps: int, output_dir: str) -> ExtGRPOTrainer:
    env = feature == "env"
    cfg = ExtGRPOConfig(
        output_dir=output_dir, max_steps=max_steps, learning_rate=1e-4, per_device_train_batch_size=8,
        num_generations=4, max_completion_length=24 if env else 16, logging_steps=1, save_strategy="no",
        report_to=[], **{"beta": 0.0, **EXTENSIONS[feature]},
        # TRL's defaults otherwise (its loss_type "dapo" included): on a CPU fp32 without activation checkpointing
        bf16=False, activation_checkpointing=False,
    )  # fmt: skip
    kwargs = {}
    if env:
        from trl_ext.env.episodes import env_dataset, env_reward
        from trl_ext.models import load_tokenizer, model_source, prepare_tokenizer

        tokenizer = prepare_tokenizer(load_tokenizer(model_source(model)))
        kwargs = {"processing_class": tokenizer, "reward_funcs": [env_reward],
                  "train_dataset": env_dataset(cfg.build_env(), 64, tokenizer)}  # fmt: skip
    else:
        kwargs = {"reward_funcs": [mentions_target], "train_dataset": your_dataset(64)}
    if feature == "lora":
        kwargs["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    if feature == "routing":
        kwargs["rh_detector"] = says_happy
    return ExtGRPOTrainer(model=model, args=cfg, **kwargs)


def main(argv: list[str] | None = None) -> ExtGRPOTrainer:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--feature", choices=list(EXTENSIONS), default="plain")
    p.add_argument("--model", default=None, help="default: builtin (builtin_env for --feature env)")
    p.add_argument("--max_steps", type=int, default=20)
    p.add_argument("--output_dir", default="output/python_api")
    a = p.parse_args(argv)
    model = a.model or ("builtin_env" if a.feature == "env" else "builtin")
    trainer = build_trainer(a.feature, model, a.max_steps, a.output_dir)
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    print(f"{a.feature}: mean reward per step {[round(r, 3) for r in rewards]}")
    return trainer


if __name__ == "__main__":
    main()
