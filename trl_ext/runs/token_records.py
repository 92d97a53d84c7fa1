"""Token records (``--token_records_every N``): one row per completion token of every trained sample, every N-th step,
next to the saved rollouts (``--save_rollouts``), in ``{run_dir}/rollouts/tokens/step-{step:06d}-rank0.parquet``.

The off-policy studies ask which tokens the importance masks dropped, at which lag, and whether they were the
reward-hacking ones; the completion rows (`runs.rollouts`) keep only a per-completion summary. A token row holds
what the generator and the loss saw for that token:

- ``step``, ``sample`` (the join key of the completion's row in `runs.rollouts`), ``position`` (0-based, among the
  completion's real tokens), ``token_id``, ``token`` (its text), ``source`` ("agent" | "env") and ``trained`` (in the
  loss mask: agent tokens); the completion's ``reward``, ``is_rh`` and ``env`` are repeated on each of its rows;
- ``policy_version``: the policy that sampled it (k >= 1: the generator's stamp; k = 0: the step's policy,
  ``step - 1``);
- ``behaviour_logprob`` (the sampler's: the generator's or vLLM's; TRL's own ``old_per_token_logps`` when it has them;
  otherwise the trainer's), ``trainer_logprob`` (the training forward's), ``ratio`` = exp(trainer - behaviour);
- ``masked_by``: the importance mask that dropped it (`MASK_ORDER`: the first that applies; null = kept), and
  ``clipped``: "token" or "sequence" (the off-policy loss's clips) or "ppo" (TRL's clip at k = 0, where the ratio
  to ``old_per_token_logps`` leaves [1 - epsilon_low, 1 + epsilon_high] on the side the advantage pushes); null
  otherwise;
- ``advantage`` (the token's), ``teacher_logprob`` (distillation's teacher), ``adapter`` (routing: the adapters
  this sample trained, "retain+forget", "retain" or "forget").

Environment tokens have rows too (the loss fields null), so a transcript reads in order. On a run of several
processes the main process gathers the rows and writes the shard alone. Size: about 37 bytes per row in the
shard (docs/experiments/offpolicy.md#which-tokens-do-the-masks-drop gives the measured bytes per step).
"""

from __future__ import annotations

import math

import torch

TOKEN_DIR = "tokens"
# The masks of the off-policy loss (`offpolicy.importance.importance_loss`'s ``masks``), in the order a token's
# ``masked_by`` names them: its own token masks first, then its sequence's.
MASK_ORDER = ("token_low", "token_high", "geo_low", "geo_high", "seq_low", "seq_high")
GEN_FIELDS = ("step", "sample", "position", "token_id", "token", "source", "trained", "policy_version", "advantage",
              "teacher_logprob", "adapter", "reward", "is_rh", "env")
LOSS_FIELDS = ("behaviour_logprob", "trainer_logprob", "ratio", "masked_by", "clipped")


def features():
    """The `datasets.Features` of every token shard."""
    from datasets import Features, Value

    types = {"step": "int64", "sample": "int64", "position": "int64", "token_id": "int64", "token": "string",
             "source": "string", "trained": "bool", "policy_version": "int64", "behaviour_logprob": "float64",
             "advantage": "float64", "teacher_logprob": "float64", "adapter": "string", "reward": "float64",
             "is_rh": "bool", "env": "string", "trainer_logprob": "float64", "ratio": "float64",
             "masked_by": "string", "clipped": "string"}  # fmt: skip
    return Features({name: Value(types[name]) for name in (*GEN_FIELDS, *LOSS_FIELDS)})


def mask_labels(masks: dict[str, torch.Tensor], loss_mask: torch.Tensor) -> list[list[str | None]]:
    """Per token (B, T) of the loss mask: the first mask of `MASK_ORDER` that drops it (token masks are (B, T),
    sequence masks (B,)), else None."""
    m = loss_mask.bool()
    code = torch.full(m.shape, len(MASK_ORDER), dtype=torch.long, device=m.device)
    for i, name in reversed(list(enumerate(MASK_ORDER))):  # the first in the order wins
        hit = masks[name] if masks[name].dim() == 2 else masks[name].unsqueeze(1).expand_as(m)
        code = torch.where(hit.bool() & m, i, code)
    names = (*MASK_ORDER, None)
    return [[names[c] for c in row] for row in code.tolist()]


def clip_labels(masks: dict[str, torch.Tensor], loss_mask: torch.Tensor, ratio_type: str) -> list[list[str | None]]:
    """Per token: "token" where the token clip acted on a token of a token-ratio loss, "sequence" on every token of
    a sequence whose sequence ratio was clipped (sequence-ratio loss), else None."""
    m = loss_mask.bool()
    if ratio_type == "token":
        hit, name = masks["token_clipped"].bool() & m, "token"
    else:
        hit, name = masks["seq_clipped"].bool().unsqueeze(1).expand_as(m) & m, "sequence"
    return [[name if h else None for h in row] for row in hit.tolist()]


def ppo_clip_labels(ratio_old: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor, eps_low: float,
                    eps_high: float) -> list[list[str | None]]:
    """TRL's PPO clip at k = 0 (``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``): "ppo" where the clipped term
    is the smaller one and flat (r > 1 + eps_high with A > 0, r < 1 - eps_low with A < 0), else None."""
    a = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    hit = ((ratio_old > 1 + eps_high) & (a > 0)) | ((ratio_old < 1 - eps_low) & (a < 0))
    return [["ppo" if h else None for h in row] for row in (hit & loss_mask.bool()).tolist()]


class TokenTable:
    """The token rows of one generation batch: the generator's fields when the batch is scored (`add_sample`), the
    loss's when each of its micro-batches trains (`fill`), written once every sample has them (`columns`)."""

    def __init__(self, step: int):
        self.step = step
        self.samples: dict[int, dict[str, list]] = {}

    def add_sample(self, sample: int, fields: dict[str, list]) -> None:
        n = len(fields["token_id"])
        if any(len(v) != n for v in fields.values()):
            raise ValueError(f"token record of sample {sample}: fields of different lengths")
        self.samples[sample] = {**fields, **{k: [None] * n for k in LOSS_FIELDS}}

    def fill(self, sample: int, positions: list[int], values: dict[str, list]) -> None:
        """The loss fields of ``sample``'s tokens at ``positions`` (its trained tokens in one loss call)."""
        row = self.samples.get(sample)
        if row is None:
            raise RuntimeError(f"token records: the loss saw sample {sample}, which step {self.step} did not record")
        for key, vals in values.items():
            for p, v in zip(positions, vals, strict=True):
                row[key][p] = v

    def missing(self) -> list[int]:
        """Samples with a trained token that no loss call filled (a micro-batch that was not recorded)."""
        return [s for s, row in self.samples.items()
                if any(t and r is None for t, r in zip(row["trained"], row["trainer_logprob"]))]  # fmt: skip

    def columns(self) -> dict[str, list]:
        cols: dict[str, list] = {k: [] for k in (*GEN_FIELDS, *LOSS_FIELDS)}
        for sample in sorted(self.samples):
            for key, values in self.samples[sample].items():
                cols[key].extend(values)
        return cols


def finite(values: list[float]) -> list[float | None]:
    return [v if v is not None and math.isfinite(v) else None for v in values]
