import math

import pytest
import torch

from trl_ext.advantages import ADV_ESTIMATORS, compute_advantages
from trl_ext.registry import ConfigError

EPS = 1e-6


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=1e-6, atol=1e-7)


def test_grpo_normalises_within_groups():
    # group [1, 3]: mean 2, unbiased std sqrt((1 + 1) / 1) = sqrt 2; group [2, 2]: std 0 -> 0
    r = torch.tensor([1.0, 3.0, 2.0, 2.0])
    s = math.sqrt(2) + EPS
    close(compute_advantages("grpo", r, 2), [-1 / s, 1 / s, 0.0, 0.0])


def test_grpo_group_of_four():
    # mean 0.25; unbiased var (3 * 0.0625 + 0.5625) / 3 = 0.25 -> std 0.5
    r = torch.tensor([0.0, 0.0, 0.0, 1.0])
    s = 0.5 + EPS
    close(compute_advantages("grpo", r, 4), [-0.25 / s] * 3 + [0.75 / s])


def test_brpo_normalises_whole_batch():
    # mean 2.5; unbiased var (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5 / 3
    r = torch.tensor([1.0, 2.0, 3.0, 4.0])
    s = math.sqrt(5 / 3) + EPS
    close(compute_advantages("brpo", r, 2), [-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s])
    # grpo on the same rewards sees two groups [1, 2], [3, 4], each +-0.5 / (sqrt(0.5) + eps)
    g = 0.5 / (math.sqrt(0.5) + EPS)
    close(compute_advantages("grpo", r, 2), [-g, g, -g, g])


def test_arpo_is_raw_reward_copy():
    r = torch.tensor([0.5, -1.0, 10.9])
    a = compute_advantages("arpo", r, 1)
    close(a, [0.5, -1.0, 10.9])
    assert a.data_ptr() != r.data_ptr()


def test_equal_rewards_give_zero_and_dtype_kept():
    r = torch.full((6,), 0.7, dtype=torch.float32)
    for name in ("grpo", "brpo"):
        a = compute_advantages(name, r, 3)
        assert a.dtype == torch.float32 and a.abs().max().item() < 1e-9


@pytest.mark.parametrize("name", ["grpo", "brpo", "arpo"])
def test_indivisible_batch_is_config_error(name):
    with pytest.raises(ConfigError, match="not divisible"):
        compute_advantages(name, torch.zeros(5), 2)
    with pytest.raises(ConfigError, match="group_size"):
        compute_advantages(name, torch.zeros(4), 0)


def test_degenerate_groups_and_bad_inputs():
    with pytest.raises(ConfigError, match="grpo needs group_size >= 2"):
        compute_advantages("grpo", torch.zeros(4), 1)
    with pytest.raises(ConfigError, match="brpo needs a batch"):
        compute_advantages("brpo", torch.zeros(1), 1)
    with pytest.raises(ConfigError, match="unknown advantage estimator 'ppo'; registered: arpo, brpo, grpo"):
        compute_advantages("ppo", torch.zeros(4), 2)
    with pytest.raises(ValueError, match="1-D float"):
        compute_advantages("grpo", torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="1-D float"):
        compute_advantages("grpo", torch.tensor([1, 2]), 2)
    with pytest.raises(ValueError, match="non-finite"):
        compute_advantages("brpo", torch.tensor([1.0, float("nan")]), 1)
    assert ADV_ESTIMATORS.names() == ["arpo", "brpo", "grpo"]
