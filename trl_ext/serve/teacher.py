"""A teacher's log-probs from its vLLM servers (`server_teacher_logprobs`: a server's prompt log-probs of each
row's tokens), the servers' side of ``trl_ext.distill.teacher.teacher_logprobs``."""

from __future__ import annotations

import torch
from torch import Tensor

from trl_ext.serve.client import Replica, concurrently


def server_teacher_logprobs(replicas: list[Replica], input_ids: Tensor, attention_mask: Tensor,
                            logits_to_keep: int, score_mask: Tensor | None = None) -> Tensor:  # fmt: skip
    """`trl_ext.distill.teacher.teacher_logprobs` (temperature 1) from teacher servers: each row's real tokens
    (``attention_mask``) are scored by a server's prompt log-probs; ``[B, C]``, 0 where masked. The completion block
    (the last ``logits_to_keep`` columns) must be right-padded, as TRL's completions are."""
    c = logits_to_keep
    comp = attention_mask[:, -c:].bool()
    if (comp[:, 1:] > comp[:, :-1]).any():
        raise ValueError("the completion block must be right-padded")
    rows = [ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask)]
    lengths = comp.sum(1).tolist()

    def one(i: int) -> list[float]:
        if lengths[i] == 0:
            return []
        return replicas[i % len(replicas)].prompt_logprobs(rows[i])[-lengths[i]:]

    out = torch.zeros(input_ids.size(0), c, dtype=torch.float32)
    for i, lps in enumerate(concurrently(one, list(range(len(rows))))):
        out[i, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
    scored = comp.cpu() if score_mask is None else comp.cpu() & score_mask.bool().cpu()
    return torch.where(scored, out, 0.0).to(input_ids.device)
