"""Numeric faults stop a run loudly.

TRL turns a reward of None into NaN and sums rewards with ``nansum``: None is a reward function's "not applicable"
(a math reward on a code sample), and TRL combines the other functions' values around it. A NaN or inf that a
reward function *computes* would be hidden the same way, and HF's Trainer replaces a NaN/inf loss by the running
mean in its logs (``logging_nan_inf_filter``). So `guard_reward` stops a computed non-finite value at its source,
where it is still told apart from None, and `check_rewards` refuses any other non-finite reward, naming what failed
and where.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

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


def _nonfinite(value) -> bool:
    try:
        return not math.isfinite(float(value))
    except (TypeError, ValueError):
        return False  # not a number at all: TRL's own conversion reports it


def guard_reward(fn: Callable, name: str, faults: list[str] | None = None) -> Callable:
    """``fn`` (a TRL reward function, sync or async) with its computed NaN / inf values caught at the source, where
    they are still told apart from None (TRL's "not applicable", passed through): without ``faults`` a `NumericFault`
    naming the function, the step and the completion is raised at once; with it, the message is appended and the
    value returned as inf (never a None's NaN), so the trainer raises after TRL has gathered the rewards, on every
    process at the same step."""
    from trl.trainer.utils import is_async_callable

    def check(out, kwargs):
        out = list(out)
        for i, value in enumerate(out):
            if value is not None and _nonfinite(value):
                state, completions = kwargs.get("trainer_state"), kwargs.get("completions") or []
                step = f"step {state.global_step + 1}: " if state is not None else ""
                text = f": {completions[i]!r}" if i < len(completions) else ""
                message = (f"{step}reward function {name!r} returned {value} (not a finite number) for completion "
                           f"{i}{text} (return None for a completion it does not apply to)")
                if faults is None:
                    raise NumericFault(message)
                faults.append(message)
                out[i] = math.inf
        return out

    if is_async_callable(fn):
        @functools.wraps(fn)
        async def guarded_async(*args, **kwargs):
            return check(await fn(*args, **kwargs), kwargs)

        return guarded_async

    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        return check(fn(*args, **kwargs), kwargs)

    return guarded


def check_rewards(rewards: torch.Tensor, names: list[str], completions: list, step: int,
                  none_ok: list[bool] | None = None) -> None:
    """``rewards`` [N, F] (one column per reward function ``names``) must be finite for the ``completions``, except
    NaN in the columns ``none_ok`` marks: a guarded function's None (`guard_reward` refused its computed NaNs)."""
    if rewards.shape != (len(completions), len(names)):
        raise NumericFault(f"step {step}: rewards of shape {tuple(rewards.shape)} for {len(completions)} completions "
                           f"and {len(names)} reward functions")
    if none_ok is not None and any(none_ok):
        rewards = torch.where(torch.isnan(rewards) & torch.tensor(none_ok, device=rewards.device), 0.0, rewards)
    where = first_nonfinite(rewards)
    if where is not None:
        row, col = where
        raise NumericFault(f"step {step}: reward function {names[col]!r} returned {rewards[row, col].item()} (not a "
                           f"finite number) for completion {row}: {completions[row]!r}")
