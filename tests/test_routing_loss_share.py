"""The passes' shares of the full-batch loss (trl_ext/routing/loss_share.py), hand-computed; the gradients they give
are checked against their definition in tests/test_routing_step.py."""

import pytest
import torch

from trl_ext.registry import ConfigError
from trl_ext.routing.loss_share import LOSS_TYPES, check_loss_type, pass_share

ROWS = torch.tensor([True, False, True, False])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]])  # 3 + 1 + 2 + 4 = 10 tokens


@pytest.mark.parametrize("loss_type", ["grpo", "sapo", "luspo", "dr_grpo"])
def test_sample_normalised_losses_take_the_sample_fraction(loss_type):
    assert pass_share(loss_type, ROWS, MASK, keep_rows=False) == 2 / 4
    assert pass_share(loss_type, ROWS, MASK, keep_rows=True) == 1.0  # the masked rows still count in the mean


def test_token_normalised_loss_takes_the_token_fraction():
    assert pass_share("bnpo", ROWS, MASK, keep_rows=False) == 5 / 10
    assert pass_share("bnpo", ~ROWS, MASK, keep_rows=True) == 5 / 10
    assert pass_share("bnpo", torch.tensor([False, True, False, False]), MASK, keep_rows=False) == 1 / 10
    assert pass_share("bnpo", ROWS, torch.zeros_like(MASK), keep_rows=False) == 0.0  # no tokens: a zero loss


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo", "token"])
def test_constant_normalised_losses_take_all(loss_type):
    assert pass_share(loss_type, ROWS, MASK, keep_rows=False) == 1.0 == pass_share(loss_type, ROWS, MASK, True)


def test_unknown_loss_type_is_refused():
    assert len(set(LOSS_TYPES)) == len(LOSS_TYPES) == 9
    with pytest.raises(ConfigError, match="does not know how loss_type 'new_one' normalises"):
        check_loss_type("new_one")
    with pytest.raises(ConfigError, match="known: grpo, sapo"):
        pass_share("new_one", ROWS, MASK, keep_rows=False)
