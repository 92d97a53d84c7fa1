"""Numeric faults stop a run loudly.

TRL turns a reward of None into NaN and sums rewards with ``nansum`` (a NaN reward silently counts as 0), and HF's
Trainer replaces a NaN/inf loss by the running mean in its logs (``logging_nan_inf_filter``). Both hide a broken
reward function or a diverged policy. These checks raise instead, naming what failed and where.
"""

from __future__ import annotations

import torch


class NumericFault(RuntimeError):
    """A reward, loss or gradient norm that is not a finite number."""


def first_nonfinite(values: torch.Tensor) -> tuple[int, int] | None:
    """(row, column) of the first non-finite entry of a 2-D tensor (row-major), or None."""
    bad = ~torch.isfinite(values)
    if not bool(bad.any()):
        return None
    row, col = bad.nonzero()[0].tolist()
    return row, col


def check_rewards(rewards: torch.Tensor, names: list[str], completions: list, step: int) -> None:
    """``rewards`` [N, F] (one column per reward function ``names``) must be finite for the ``completions``."""
    if rewards.shape != (len(completions), len(names)):
        raise NumericFault(f"step {step}: rewards of shape {tuple(rewards.shape)} for {len(completions)} completions "
                           f"and {len(names)} reward functions")
    where = first_nonfinite(rewards)
    if where is not None:
        row, col = where
        raise NumericFault(f"step {step}: reward function {names[col]!r} returned {rewards[row, col].item()} (not a "
                           f"finite number) for completion {row}: {completions[row]!r}")
