"""Advantages of routed runs and baseline arms, prompt hackability (trl_ext/routing/advantages.py): exact values
on a hand-made batch of two groups of 4, no model."""

import math

import pytest
import torch
from trl.trainer.utils import nanstd

from trl_ext.registry import ConfigError
from trl_ext.routing.advantages import EPS, baseline_arm, group_advantages, prompt_hackable, routed_advantages

D = torch.float64
G = 4
REWARDS = torch.tensor([0.0, 2.0, 6.0, 4.0, 1.0, 1.0, 1.0, 5.0], dtype=D)
BAD = torch.tensor([False, False, True, False, True, True, True, False])
BASE = torch.tensor([0.0, 1.0, 2.0, 3.0, 1.0, 1.0, 1.0, 1.0], dtype=D)
S1 = math.sqrt(20 / 3)  # group 1 [0, 2, 6, 4]: mean 3, squared deviations 9 + 1 + 9 + 1, unbiased
# group 2 [1, 1, 1, 5]: mean 2, squared deviations 1 + 1 + 1 + 9 = 12, unbiased std 2
FULL = [-3 / (S1 + EPS), -1 / (S1 + EPS), 3 / (S1 + EPS), 1 / (S1 + EPS), *(v / (2 + EPS) for v in (-1, -1, -1, 3))]


def check(mode, expected, **kw):
    got = routed_advantages(mode, REWARDS, BAD, G, **kw)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=D), rtol=0, atol=1e-12)


def test_off_is_trls_group_advantage():
    check("off", FULL)
    r = REWARDS.view(-1, G)  # TRL GRPOTrainer, scale_rewards="group"
    trl = (r - r.mean(1, keepdim=True)) / (nanstd(r, dim=1).unsqueeze(1) + 1e-4)
    # TRL's Bessel factor count / (count - 1) is computed in float32: agreement to float32 precision
    torch.testing.assert_close(group_advantages(REWARDS, G), trl.reshape(-1), rtol=0, atol=1e-6)


def test_filter():
    # group 1's unflagged [0, 2, 4]: mean 2, std 2; group 2 has one unflagged sample: no spread -> 0
    check("filter", [-2 / (2 + EPS), 0.0, 0.0, 2 / (2 + EPS), 0.0, 0.0, 0.0, 0.0])


def test_retain_only_renormalises_the_unflagged_and_keeps_the_flagged():
    check("retain-only", [-2 / (2 + EPS), 0.0, FULL[2], 2 / (2 + EPS), *FULL[4:7], 0.0])


def test_reward_penalty_zero_and_amount():
    s = math.sqrt(11 / 3)  # group 1 [0, 2, 0, 4]: mean 1.5, squared deviations 2.25 + .25 + 2.25 + 6.25
    check("reward_penalty", [-1.5 / (s + EPS), 0.5 / (s + EPS), -1.5 / (s + EPS), 2.5 / (s + EPS),
                             *(v / (2.5 + EPS) for v in (-1.25, -1.25, -1.25, 3.75))])  # [0, 0, 0, 5]: std 2.5
    # amount 2: group 1 [0, 2, 4, 4]: mean 2.5, same spread 11/3; group 2 [-1, -1, -1, 5]: mean 0.5, std 3
    check("reward_penalty", [-2.5 / (s + EPS), -0.5 / (s + EPS), 1.5 / (s + EPS), 1.5 / (s + EPS),
                             *(v / (3 + EPS) for v in (-1.5, -1.5, -1.5, 4.5))], penalty_amount=2.0)


def test_retain_penalty_gives_flagged_the_base_reward():
    s = math.sqrt(8 / 3)  # group 1 [0, 2, 2, 4]: mean 2; group 2 [1, 1, 1, 5] unchanged
    check("retain_penalty", [-2 / (s + EPS), 0.0, 0.0, 2 / (s + EPS), *FULL[4:]], base_rewards=BASE)
    with pytest.raises(ValueError, match="base_rewards"):
        routed_advantages("retain_penalty", REWARDS, BAD, G)


def test_bad_inputs():
    with pytest.raises(ValueError, match="unknown advantage mode"):
        routed_advantages("balanced", REWARDS, BAD, G)
    with pytest.raises(ValueError, match="whole groups of 3"):
        routed_advantages("off", REWARDS, BAD, 3)
    with pytest.raises(ValueError, match="bool tensor"):
        routed_advantages("off", REWARDS, BAD.float(), G)
    assert baseline_arm(False, False, False) is None and baseline_arm(False, True, False) == "reward_penalty"
    with pytest.raises(ConfigError, match="exclude each other"):
        baseline_arm(True, False, True)


def test_prompt_hackable():
    prompts = [f"prompt {i}" for i in range(2000)]
    at = {f: {p for p in prompts if prompt_hackable(p, f, seed=1)} for f in (0.0, 0.3, 0.6, 1.0)}
    assert not at[0.0] and len(at[1.0]) == 2000 and at[0.3] < at[0.6]  # the hackable set grows with hack_frac
    assert abs(len(at[0.3]) / 2000 - 0.3) < 0.04 and abs(len(at[0.6]) / 2000 - 0.6) < 0.04
    assert at[0.3] == {p for p in prompts if prompt_hackable(p, 0.3, seed=1)}  # deterministic
    assert at[0.3] != {p for p in prompts if prompt_hackable(p, 0.3, seed=2)}  # and seeded
