"""The Python API (README "Use it from Python"): examples/python_api.py builds ExtGRPOConfig and ExtGRPOTrainer as a
TRL user would, with its own dataset and reward function, and turns on each extension through the config."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "python_api.py"


def _example():
    spec = importlib.util.spec_from_file_location("python_api_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dataset_columns_reach_the_reward():
    ex = _example()
    assert ex.mentions_target(["she was happy today", "it was fine"], target=["happy", "happy"]) == [1.0, 0.0]
    assert set(ex.your_dataset(8).column_names) == {"prompt", "target"}


def test_api_conveniences_refuse_what_train_py_refuses():
    from trl_ext.api import trainer_arguments
    from trl_ext.config import train_config

    cfg = train_config(output_dir="unused", teacher_tau=0.5, student_tau=0.5, teacher_context="A happy story.",
                       beta=0.0, report_to=[])  # fmt: skip
    with pytest.raises(ValueError, match="needs a teacher"):
        trainer_arguments((), {"model": "unused", "args": cfg, "reward_funcs": []})
    with pytest.raises(TypeError, match="ExtGRPOConfig, a trl.GRPOConfig or None"):
        trainer_arguments(("m", []), {"args": object()})
    named = trainer_arguments((), {"model": object(), "args": train_config(output_dir="u", report_to=[]),
                                   "rh_detector": _example().says_happy})  # fmt: skip
    assert named["rh_detector"][0] == "says_happy"


@pytest.mark.slow
@pytest.mark.parametrize("feature", ["plain", "lora", "offpolicy", "routing", "distill", "env"])
def test_example_trains_each_extension(builtin_path, tmp_path, feature):
    trainer = _example().main(["--feature", feature, "--max_steps", "2", "--output_dir", str(tmp_path)])
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logs] == [1, 2] and all(math.isfinite(h["loss"]) for h in logs)
    reward_key = "rewards/env_reward/mean" if feature == "env" else "rewards/mentions_target/mean"
    assert all(reward_key in h for h in logs)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    if feature == "lora":
        assert trainable and all("lora_" in n for n in trainable)
    elif feature == "routing":
        assert trainable and all(n.split(".")[-1] in ("retain_A", "retain_B", "forget_A", "forget_B") for n in trainable)
        assert trainer.components.routing.detector_name == "says_happy" and trainer.loss_type == "dapo"  # TRL's default loss
        evals = [json.loads(line) for line in (tmp_path / "routing_eval.jsonl").read_text().splitlines()]
        assert [e["step"] for e in evals] == [2] and evals[0]["n_prompts"] == 16  # built from train_dataset
        assert set(evals[0]["modes"]) == {"both", "retain_only", "forget_only"}
        assert all("reward/mentions_target" in m for m in evals[0]["modes"].values())
    if feature == "offpolicy":
        assert all(h["offpolicy/policy_lag_max"] <= 1 for h in logs)
    if feature == "distill":
        assert trainer.components.distill.cfg is not None


def test_routing_eval_is_built_from_the_dataset_with_trl_style_rewards():
    """Without routing_eval_prompts/rewards the API takes eval_dataset's (else train_dataset's) first rows and calls
    the reward functions as TRL does: prompts, completions and the rows' other columns."""
    from datasets import Dataset

    from trl_ext.api import routing_eval_from_data
    from trl_ext.config import train_config

    ex = _example()
    cfg = train_config(output_dir="u", report_to=[], gradient_routing=True, routing_mode="shared", lora_config="r4",
                       eval_routing_prompts=4)  # fmt: skip
    seen = {}

    def reward(prompts, completions, target, **kwargs):
        seen.update(prompts=prompts, target=target)
        return [float(t in c) for c, t in zip(completions, target)]

    prompts, rewards = routing_eval_from_data({"train_dataset": ex.your_dataset(8), "reward_funcs": [reward]}, cfg)
    assert prompts == list(ex.your_dataset(4)["prompt"]) and list(rewards) == ["reward"]
    assert rewards["reward"](["so happy", "not glad", "brave"]) == [1.0, 0.0, 1.0]
    assert seen == {"prompts": prompts[:3], "target": ["happy", "sad", "brave"]}
    held_out = Dataset.from_list([{"prompt": f"held out {i}", "target": "x"} for i in range(4)])
    named = {"train_dataset": ex.your_dataset(8), "eval_dataset": held_out, "reward_funcs": reward}
    assert routing_eval_from_data(named, cfg)[0] == list(held_out["prompt"])
    for bad in ({"train_dataset": ex.your_dataset(3), "reward_funcs": [reward]},  # fewer rows than prompts asked
                {"train_dataset": ex.your_dataset(8), "reward_funcs": ["path/to/reward_model"]},
                {"reward_funcs": [reward]}):
        with pytest.raises(ValueError, match="eval_routing_steps=0"):
            routing_eval_from_data(bad, cfg)


def test_routing_eval_takes_what_a_small_dataset_has():
    """A TRL-style script (routing on, TRL's default loss, eval_routing_prompts left at its default of 64) on a
    16-row dataset: the routing eval takes the 16 rows and says so; a count set above the rows is refused."""
    from trl_ext.api import routing_eval_from_data
    from trl_ext.config import ExtGRPOConfig

    ex = _example()
    cfg = ExtGRPOConfig(output_dir="u", report_to=[], use_cpu=True, bf16=False, gradient_routing=True,
                        routing_mode="shared", lora_config="r4")  # fmt: skip
    assert cfg.loss_type == "dapo" and cfg.eval_routing_prompts == 64
    named = {"train_dataset": ex.your_dataset(16), "reward_funcs": [lambda completions, **kw: [0.0] * len(completions)]}
    with pytest.warns(UserWarning, match="samples all 16 rows of train_dataset"):
        prompts, _ = routing_eval_from_data(named, cfg)
    assert prompts == list(ex.your_dataset(16)["prompt"])
    cfg.eval_routing_prompts = 32
    with pytest.raises(ValueError, match="--eval_routing_prompts 32 exceeds the 16 rows of train_dataset"):
        routing_eval_from_data(named, cfg)


def test_a_scripts_own_routing_eval_rewards_are_kept():
    from trl_ext.api import trainer_arguments
    from trl_ext.config import train_config

    ex = _example()
    cfg = train_config(output_dir="u", report_to=[], gradient_routing=True, routing_mode="shared", lora_config="r4",
                       eval_routing_prompts=4)  # fmt: skip
    mine = {"mine": lambda texts: [0.0] * len(texts)}
    named = trainer_arguments((), {"model": object(), "args": cfg, "train_dataset": ex.your_dataset(8),
                                   "reward_funcs": [ex.mentions_target], "dual_lora_layout": object(),
                                   "routing_eval_rewards": mine})  # fmt: skip
    assert named["routing_eval_rewards"] is mine and named["routing_eval_prompts"] == list(ex.your_dataset(4)["prompt"])
