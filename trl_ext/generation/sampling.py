"""Pure sampling math of the fast generation backend: the logit filter, one fused sampling step and the EOS rule.

Distribution: transformers' sampling path (``GenerationMixin._sample`` with the TemperatureLogitsWarper,
TopKLogitsWarper and TopPLogitsWarper, in that order) followed by ``torch.multinomial``. Here the categorical draw is
the exponential race (equivalently Gumbel-max: ``argmax(z_i - log E_i)``, ``E_i ~ Exp(1)``; e.g. Huijben et al. 2022,
"A Review of the Gumbel-max Trick"), which samples exactly ``softmax(z)`` without a softmax or a CPU round trip.

Behaviour log-probs are ``log_softmax(logits / temperature)`` of the sampled token, from the raw logits: top-k / top-p
restrict only what is sampled. This is what TRL's trainer computes for the same token. Computed in float32 (float64
for a float64 model).
"""

from __future__ import annotations

import torch
from torch import Tensor


def restrict_logits(scaled: Tensor, top_k: int, top_p: float) -> Tensor:
    """Sampling-only filter, top-k then top-p as transformers' TopK/TopP warpers: -inf outside the kept set."""
    if 0 < top_k < scaled.size(-1):
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, -torch.inf)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1)  # ascending
        drop_sorted = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p
        drop_sorted[..., -1] = False  # the most likely token is always kept
        scaled = scaled.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), -torch.inf)
    return scaled


def sample_step(logits: Tensor, temperature: float, top_k: int, top_p: float, noise: Tensor | None = None,
                rng: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """One sampling step over ``logits`` [B, V]: the sampled token ids [B] and their behaviour log-probs [B] (float32 or
    wider).

    With ``noise`` [B, V] ~ Exp(1) (filled by the caller): ``tok = argmax(restrict(z) - log(noise))``, the exponential
    race. Without: the inverse CDF of ``softmax(restrict(z))`` at one uniform per row drawn from ``rng`` (CPU: 32x
    fewer random numbers than ``torch.multinomial``, which draws one per vocabulary entry). Both sample it exactly,
    ``z = logits / temperature``; ``logp = z_tok - logsumexp(z)``.
    """
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    kept = restrict_logits(z, top_k, top_p)
    if noise is not None:
        tok = (kept - noise.clamp_min(torch.finfo(noise.dtype).tiny).log()).argmax(-1)
    else:  # inverse CDF: the first token whose cumulative probability exceeds u ~ U[0, total)
        cdf = kept.softmax(-1).cumsum(-1)
        u = torch.rand(cdf.size(0), 1, generator=rng, device=cdf.device) * cdf[:, -1:]
        tok = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_max(cdf.size(1) - 1)
    logp = z.gather(1, tok[:, None]).squeeze(1) - z.logsumexp(-1)
    return tok, logp


def finish_step(tok: Tensor, done: Tensor, eos: Tensor, pad_token_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """EOS bookkeeping of one step, as transformers' generate pads finished rows.

    Returns ``(tok', alive, done')``: finished rows emit ``pad_token_id``, ``alive`` marks the rows whose token belongs
    to the completion (a row's EOS is its last completion token), ``done'`` includes the rows that just emitted EOS.
    """
    alive = ~done
    tok = torch.where(done, pad_token_id, tok)
    return tok, alive, done | torch.isin(tok, eos)


def completions_from_steps(tokens: Tensor, logps: Tensor, alive: Tensor) -> tuple[list[list[int]], list[list[float]]]:
    """Per row, the tokens and log-probs of its completion (up to and including EOS): what TRL's batch keeps after
    masking everything past the first EOS. ``tokens``, ``logps``, ``alive``: [B, T] on any device."""
    lengths = alive.sum(1).tolist()
    tok_rows, lp_rows = tokens.cpu().tolist(), logps.cpu().tolist()
    return ([row[:n] for row, n in zip(tok_rows, lengths, strict=True)],
            [row[:n] for row, n in zip(lp_rows, lengths, strict=True)])  # fmt: skip


def left_padded(prompt_ids: list[list[int]], pad_token_id: int, device) -> tuple[list[Tensor], Tensor]:
    """(each prompt as a tensor, the prompts as one left-padded ``[B, P]`` batch) on ``device``: how both samplers
    take their prompts. Every prompt needs a token."""
    from trl.trainer.utils import pad

    if not prompt_ids or min(len(p) for p in prompt_ids) == 0:
        raise ValueError("every prompt needs at least one token")
    rows = [torch.tensor(p, dtype=torch.long, device=device) for p in prompt_ids]
    return rows, pad(rows, padding_value=pad_token_id, padding_side="left")
