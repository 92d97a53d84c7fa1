"""The estimator stage (trl_ext/estimator.py) on hand-made tensors: which source decides the advantages, and how a
routing arm composes with TRL's group advantage and with distillation's unscaled baseline. Hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from trl_ext.distill.advantages import DistillAdvantages, RewardParts
from trl_ext.estimator import RoutingArm, check_estimator_flags, estimate_advantages, local_slice, weighted_rewards
from trl_ext.registry import ConfigError

S2 = 1 / math.sqrt(2)


def distill(total, task=None, token_level=False):
    total = torch.tensor(total)
    task = torch.zeros_like(total) if task is None else torch.tensor(task)
    parts = RewardParts(task, total - task, torch.zeros_like(total))
    base = (task if token_level else total).view(-1, 2)
    return DistillAdvantages((base - base.mean(1, keepdim=True)).view(-1), None, parts, token_level)


def test_weighted_rewards_and_local_slice():
    # weighted sums [1*1 + 0.5*2, 0, nan -> 0 + 0.5*4, 3]
    per_func = torch.tensor([[1.0, 2.0], [0.0, 0.0], [float("nan"), 4.0], [3.0, 0.0]])
    rewards = weighted_rewards(per_func, torch.tensor([1.0, 0.5]))
    assert rewards.tolist() == [2.0, 0.0, 2.0, 3.0]
    assert local_slice(rewards, 1, 2).tolist() == [2.0, 3.0]


def test_trl_advantage_stands_when_nothing_overrides():
    est = estimate_advantages(torch.tensor([1.0, 0.0]), 2)
    assert est.advantages is None and est.base is None and est.source == "trl"


def test_env_estimator_on_weighted_rewards():
    rewards = torch.tensor([2.0, 0.0, 0.0, 0.0])
    est = estimate_advantages(rewards, 4, env_estimator="brpo")  # mean 0.5, unbiased std 1
    assert torch.allclose(est.advantages, torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-5)
    est = estimate_advantages(rewards, 2, env_estimator="grpo")  # [2, 0] -> +-1/sqrt(2); [0, 0] -> 0
    assert torch.allclose(est.advantages, torch.tensor([S2, -S2, 0.0, 0.0]), atol=1e-4)
    assert estimate_advantages(rewards, 2, env_estimator="arpo").advantages.tolist() == [2.0, 0.0, 0.0, 0.0]
    assert est.source == "adv_estimator:grpo"


def test_distillation_advantage_is_the_base():
    d = distill([3.0, 1.0, -2.0, 0.0])
    est = estimate_advantages(torch.zeros(4), 2, distill=d)
    assert est.advantages.tolist() == [1.0, -1.0, -1.0, 1.0] and est.source == "distill"


def test_routing_retain_only_on_trl_rewards():
    # group [1, 0, 1, 0] with sample 2 flagged: flagged keeps the full-group advantage (mean 0.5, std
    # sqrt(1/3)); unflagged renormalised among {1, 0, 0}: mean 1/3, std sqrt(1/3).
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    arm = RoutingArm("retain-only", torch.tensor([False, False, True, False]))
    est = estimate_advantages(rewards, 4, routing=arm)
    s = math.sqrt(1 / 3) + 1e-4
    assert torch.allclose(est.advantages, torch.tensor([(2 / 3) / s, (-1 / 3) / s, 0.5 / s, (-1 / 3) / s]), atol=1e-5)
    assert est.base is None and est.source == "routing:retain-only"


def test_routing_retain_only_on_distillation_reward_is_unscaled():
    # full reward R = [4, 2, 0, 2] (one group of 4), sample 0 flagged: flagged -> R - mean(R) = 4 - 2 = 2;
    # unflagged -> R - mean over {2, 0, 2} = R - 4/3.
    d = distill([4.0, 2.0, 0.0, 2.0])
    d = DistillAdvantages(d.parts.total - d.parts.total.mean(), None, d.parts, False)
    arm = RoutingArm("retain-only", torch.tensor([True, False, False, False]))
    est = estimate_advantages(torch.zeros(4), 4, distill=d, routing=arm)
    assert torch.allclose(est.advantages, torch.tensor([2.0, 2 / 3, -4 / 3, 2 / 3]), atol=1e-6)
    assert est.base.tolist() == [2.0, 0.0, -2.0, 0.0] and est.source == "routing:retain-only+distill"


def test_routing_filter_on_distillation_token_path_uses_the_task_part():
    # token path: the sequence part is adv_tau * task = [1, 0, 1, 1]; filter drops flagged sample 3 -> 0 and
    # centres the rest on mean {1, 0, 1} = 2/3 (the teacher part [5, 5, 5, 5] is not in the sequence advantage).
    d = distill([6.0, 5.0, 6.0, 6.0], task=[1.0, 0.0, 1.0, 1.0], token_level=True)
    arm = RoutingArm("filter", torch.tensor([False, False, False, True]))
    est = estimate_advantages(torch.zeros(4), 4, distill=d, routing=arm)
    assert torch.allclose(est.advantages, torch.tensor([1 / 3, -2 / 3, 1 / 3, 0.0]), atol=1e-6)


def test_routing_reward_penalty_on_trl_rewards():
    # flagged sample 0's reward 1 -> 0: group [0, 0] -> 0, 0
    arm = RoutingArm("reward_penalty", torch.tensor([True, False]))
    assert estimate_advantages(torch.tensor([1.0, 0.0]), 2, routing=arm).advantages.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("kwargs,message", [
    (dict(adv_estimator="grpo", distill_on=True, routing_arm=None), "distillation's advantage is its own"),
    (dict(adv_estimator="brpo", distill_on=False, routing_arm="retain-only"), "the estimator would be unused"),
    (dict(adv_estimator="", distill_on=True, routing_arm="retain_penalty"), "rewrites the task reward"),
    (dict(adv_estimator="", distill_on=True, routing_arm="reward_penalty"), "rewrites the task reward"),
])
def test_combinations_that_would_leave_a_source_unused_are_rejected(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        check_estimator_flags(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(adv_estimator="grpo", distill_on=False, routing_arm="off"),
    dict(adv_estimator="", distill_on=True, routing_arm="retain-only"),
    dict(adv_estimator="", distill_on=True, routing_arm="filter"),
    dict(adv_estimator="arpo", distill_on=False, routing_arm=None),
])
def test_combinations_that_compose_are_accepted(kwargs):
    check_estimator_flags(**kwargs)


BASE = ["--batch_size", "8", "--num_generations", "4", "--max_steps", "1", "--no_wandb"]


@pytest.mark.parametrize("argv,reason", [
    (["--env", "two_armed_bandit", "--model", "builtin_env", "--adv_estimator", "grpo", "--teacher_tau", "1",
      "--teacher_context", "hint"], "distillation's advantage is its own"),
    (["--reward", "sentence_length_5_with_happy", "--gradient_routing", "--routing_mode", "shared",
      "--lora_config", "r4", "--adv_estimator", "brpo"], "the estimator would be unused"),
    (["--reward", "sentence_length_5_with_happy", "--lora_config", "r4", "--reward_penalty_baseline",
      "--teacher_tau", "1"], "rewrites the task reward"),
])
def test_train_py_exits_2_before_loading_a_model(tmp_path, capsys, argv, reason):
    import trl_ext.cli_train as cli

    assert cli.main([*argv, *BASE, "--output_dir", str(tmp_path)]) == 2
    assert reason in capsys.readouterr().err
