"""The share of a routed step's full-batch loss that one pass over part of the batch carries
(`trl_ext.routing.step.two_pass_backward`), for every TRL loss type.

TRL 1.16 (``GRPOTrainer._compute_loss``; the off-policy loss normalises alike, `trl_ext.offpolicy.importance`)
reduces the masked per-token loss l (B samples x T tokens, mask m) as
    grpo, sapo          mean_i ( sum_t l_it m_it / max(1, sum_t m_it) )
    luspo               mean_i sum_t l_it m_it
    dr_grpo             sum_it l_it m_it / (B * max_completion_length)
    bnpo                sum_it l_it m_it / max(1, sum_it m_it)             (the micro-batch's tokens)
    dapo, cispo, vespo  sum_it l_it m_it / N                                (N: num_items_in_batch, a constant
    (and "token")                                                            of the generation batch)
Each is a sum over samples sum_i c_i, where c_i reads sample i and one batch constant: B, sum m or N. A pass over a
subset S evaluates the same formula with S's constants; the factor that turns it into S's share sum_{i in S} c_i of
the full-batch loss (so that the passes' gradients add up to the full batch's):
    by the sample count (grpo, sapo, luspo, dr_grpo)   |S| / B
    by the micro-batch's tokens (bnpo)                 sum_{i in S} m_i / sum_i m_i
    by a constant (dapo, cispo, vespo, token)          1
With ``keep_rows`` a pass sees all B rows, the other rows' mask zeroed: B stays the full batch's and the token count
becomes S's, so the factors are 1, sum_S m / sum m, 1.
"""

from __future__ import annotations

import torch

from trl_ext.registry import ConfigError

BY_SAMPLES = ("grpo", "sapo", "luspo", "dr_grpo")
BY_TOKENS = ("bnpo",)
BY_CONSTANT = ("dapo", "cispo", "vespo", "token")
LOSS_TYPES = BY_SAMPLES + BY_TOKENS + BY_CONSTANT


def check_loss_type(loss_type: str) -> None:
    """ConfigError unless the two-pass step knows how ``loss_type`` normalises (a new TRL loss type is refused, not
    split with a wrong share)."""
    if loss_type not in LOSS_TYPES:
        raise ConfigError(f"--gradient_routing does not know how loss_type {loss_type!r} normalises (it needs that to "
                          f"split the batch into passes); known: {', '.join(LOSS_TYPES)}")


def pass_share(loss_type: str, rows: torch.Tensor, token_mask: torch.Tensor, keep_rows: bool) -> float:
    """The factor of a pass over the samples ``rows`` (1-D bool over the B samples) whose loss is computed over those
    rows alone (``keep_rows`` False) or over all rows with the others' mask zeroed (True); ``token_mask`` (B, T): the
    tokens the loss trains on (`trl_ext.batch.loss_mask`)."""
    check_loss_type(loss_type)
    if loss_type in BY_CONSTANT or (loss_type in BY_SAMPLES and keep_rows):
        return 1.0
    if loss_type in BY_SAMPLES:
        return int(rows.sum()) / len(rows)
    counts = token_mask.detach().sum(-1).to(torch.float64).cpu()
    total = float(counts.sum())
    return float(counts[rows.cpu()].sum()) / total if total > 0 else 0.0
