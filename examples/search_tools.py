"""The search environment through TRL's tool convention: search, read and answer as tools of
``environment_factory``, trained by ExtGRPOTrainer with LoRA, gradient routing or the fast sampler on top.

    uv run python examples/search_tools.py --model Qwen/Qwen2.5-0.5B-Instruct --max_steps 200   # a GPU and the hub
    uv run python -m trl_ext.models.tiny qwen2 out/tiny-tools --tokenizer bytes --chat_template trl:qwen2_5 \\
        --positions 4096 && uv run python examples/search_tools.py --model out/tiny-tools --max_steps 2

The model needs a chat template whose tool calls TRL parses (Qwen2.5 / Qwen3 / Llama 3.1+ and the others of
``trl.chat_template_utils.add_response_schema``). A tiny random model built with the byte-level tokenizer and TRL's
Qwen2.5 template runs the loop offline, but writes no tool call: tests/test_search_tools.py scripts its turns.
``--feature``: plain | lora | routing | fast (docs/environments.md lists what composes).
"""

from __future__ import annotations

import argparse

from peft import LoraConfig

from environments.search import SearchEnv
from environments.search_tools import SearchTools, tool_dataset
from trl_ext import ExtGRPOConfig, ExtGRPOTrainer

FEATURES = {
    "plain": {},
    "lora": {},  # PEFT LoRA through TRL's peft_config, below
    "routing": {"gradient_routing": True, "routing_mode": "shared", "lora_config": "r4", "eval_routing_steps": 0},
    "fast": {"generation_backend": "fast"},
}


def answers_without_reading(completions: list[str]) -> list[bool]:
    """A reward-hacking detector for gradient routing: the rollout answered without reading a page. A tool rollout
    reaches detectors as text, its tool calls written ``call NAME({...})`` (``trl_ext.routing.text.as_text``)."""
    return ["call answer(" in c and "call read(" not in c for c in completions]


def build_trainer(model: str, feature: str = "plain", max_steps: int = 2, output_dir: str = "output/search_tools",
                  n_pages: int = 400, trainer_class: type = ExtGRPOTrainer, **config) -> ExtGRPOTrainer:
    """ExtGRPOTrainer on the search tools: 8 rollouts a step (4 questions x 2), ``max_turns`` tool calls each."""
    max_turns = SearchEnv.max_turns_default
    cfg = ExtGRPOConfig(output_dir=output_dir, max_steps=max_steps, learning_rate=1e-4, per_device_train_batch_size=8,
                        num_generations=2, max_completion_length=1024, max_tool_calling_iterations=max_turns,
                        logging_steps=1, save_strategy="no", report_to=[], beta=0.0,
                        **{"bf16": False, "activation_checkpointing": False, "loss_type": "grpo",  # TRL's otherwise
                           **FEATURES[feature], **config})  # fmt: skip
    extra = {}
    if feature == "lora":
        extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    if feature == "routing":
        extra["rh_detector"] = answers_without_reading
    return trainer_class(model=model, args=cfg, train_dataset=tool_dataset(4 * max_steps),
                         environment_factory=SearchTools.factory(max_turns=max_turns, n_pages=n_pages), **extra)


def main(argv: list[str] | None = None) -> ExtGRPOTrainer:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--feature", choices=FEATURES, default="plain")
    p.add_argument("--max_steps", type=int, default=2)
    p.add_argument("--output_dir", default="output/search_tools")
    args = p.parse_args(argv)
    trainer = build_trainer(args.model, args.feature, args.max_steps, args.output_dir)
    trainer.train()
    return trainer


if __name__ == "__main__":
    main()
