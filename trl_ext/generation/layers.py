"""The decode step's math: every decoder layer of a supported family (``trl_ext.generation.families``) on fused
weights (``trl_ext.generation.weights``) with a static KV cache, in transformers' order of operations and dtype casts.

RMSNorm in float32 (F.rms_norm), scaled after the cast back (Llama) or before it (Gemma, OLMo 2); rotate-half RoPE as
one product over the fused QKV heads (tables hold cos 1 / sin 0 on the v heads and on the dims a partial RoPE leaves
alone, so those pass through exactly); softmax attention: ``F.scaled_dot_product_attention`` on CUDA, the plain
product on CPU and wherever logits are soft-capped (Gemma 2's eager attention: ``tanh(s / c) * c`` then the mask);
the gated MLP ``act(gate) * up``. Bias-free projections are ``torch.mm``, biased ones ``torch.addmm``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trl_ext.generation.families import ACTIVATIONS, FAMILIES, Family, layer_windows, rope_keys

_ACT = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu,
        "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}  # transformers' ACT2FN, as computed
assert set(_ACT) == set(ACTIVATIONS)


@dataclass
class DecodePlan:
    """The static shape of a model's decode step, read from its config and first attention module."""

    family: Family
    n_heads: int
    n_kv: int
    head_dim: int
    rotary_dim: int
    scaling: float
    windows: list[int | None]
    rope_keys: list[str | None]
    act: object
    attn_softcap: float | None
    final_softcap: float | None

    @classmethod
    def of(cls, decoder: nn.Module) -> DecodePlan:
        cfg = decoder.config
        family = FAMILIES[cfg.model_type]  # a supported family (``sampler.decoder_of`` refuses the others)
        attn, keys = decoder.model.layers[0].self_attn, rope_keys(cfg)
        # the rotated dims: the width of the rotary module's own table (< head_dim for a partial RoPE, e.g. Phi-3's
        # partial_rotary_factor)
        one = torch.zeros(1, 1, dtype=torch.long, device=decoder.model.embed_tokens.weight.device)
        args = () if keys[0] is None else (keys[0],)
        rotary_dim = decoder.model.rotary_emb(torch.zeros((), device=one.device), one, *args)[0].shape[-1]
        return cls(family, cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim, rotary_dim,
                   attn.scaling, layer_windows(cfg), keys,
                   _ACT[getattr(cfg, family.act_field)],
                   cfg.attn_logit_softcapping if family.attn_softcap else None,
                   cfg.final_logit_softcapping if family.final_softcap else None)  # fmt: skip


def rms_norm(h: Tensor, weight: Tensor, eps: float, scale_first: bool) -> Tensor:
    """RMSNorm over the last dim in float32: ``weight * n.to(dtype)`` (LlamaRMSNorm) or ``(n * weight).to(dtype)``
    (Gemma, with weight = 1 + w in float32; OLMo 2)."""
    n = F.rms_norm(h.float(), (h.shape[-1],), None, eps)
    return (n * weight).to(h.dtype) if scale_first else weight * n.to(h.dtype)


def _linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    return torch.mm(x, w) if b is None else torch.addmm(b, x, w)


def rope_tables(rotary_emb: nn.Module, key: str | None, total: int, plan: DecodePlan, dtype: torch.dtype,
                device: torch.device) -> tuple[Tensor, Tensor]:  # fmt: skip
    """cos / sin [total, n_q + 2 n_kv, d] of the model's own rotary module over positions 0..total-1, laid out for
    ``x * cos + rotated(x) * sin`` on the fused QKV heads (sin's first rotary half negated: rotated is a roll)."""
    positions = torch.arange(total, device=device)[None]
    x = torch.zeros((), dtype=torch.float32, device=device)
    cos, sin = rotary_emb(x, positions) if key is None else rotary_emb(x, positions, key)
    cos, sin, r, d = cos[0].float(), sin[0].float(), plan.rotary_dim, plan.head_dim
    sin = torch.cat([-sin[:, : r // 2], sin[:, r // 2 :]], -1)
    if r < d:  # partial RoPE: the last d - r dims pass through
        cos = torch.cat([cos, torch.ones(total, d - r, device=device)], -1)
        sin = torch.cat([sin, torch.zeros(total, d - r, device=device)], -1)
    nqk, nkv = plan.n_heads + plan.n_kv, plan.n_kv
    cos = torch.cat([cos[:, None].expand(total, nqk, d), torch.ones(total, nkv, d, device=device)], 1)
    sin = torch.cat([sin[:, None].expand(total, nqk, d), torch.zeros(total, nkv, d, device=device)], 1)
    table_dtype = torch.float32 if plan.family.rope_float32 else dtype
    return cos.to(table_dtype), sin.to(table_dtype)


def window_mask(key_valid: Tensor, arange: Tensor, pos: Tensor, window: int | None) -> Tensor:
    """Decode-step mask [B, 1, 1, L]: the valid keys at or before ``pos`` (within ``window`` of it when set)."""
    keep = arange <= pos
    if window is not None:
        keep = keep & (arange > pos - window)
    return (key_valid & keep)[:, None, None, :]


def prefill_masks(key_valid: Tensor, p: int, windows: set[int | None]) -> dict[int | None, Tensor]:
    """Prompt-pass masks [B, 1, p, p] per window: causal (and within the window), valid keys; padding queries attend to
    themselves only (their outputs are never used; this keeps every row finite)."""
    ones = torch.ones(p, p, dtype=torch.bool, device=key_valid.device)
    eye = torch.eye(p, dtype=torch.bool, device=key_valid.device)
    out = {}
    for w in windows:
        band = ones.tril() if w is None else ones.tril() & ~ones.tril(-w)
        out[w] = (band & key_valid[:, None, None, :p]) | eye
    return out


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, plan: DecodePlan) -> Tensor:
    """Softmax attention of ``q`` [B, n_q, S, d] over ``k``/``v`` [B, n_kv, L, d]; ``mask`` [B, 1, S, L] bool.
    CUDA: PyTorch's fused kernel. CPU: the plain product (the fused CPU kernel costs ~0.4 ms per call at decode sizes,
    more than the layer's matmuls). Soft-capped logits: transformers' eager order on any device."""
    cap = plan.attn_softcap
    if q.is_cuda and cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=plan.scaling,
                                              enable_gqa=plan.n_kv != plan.n_heads)  # fmt: skip
    b, nq, s, d = q.shape
    g = nq // plan.n_kv  # query heads per kv head (GQA): grouped, not copied
    q = q.reshape(b, plan.n_kv, g * s, d)
    mask = mask if g == 1 or s == 1 else mask.repeat(1, 1, g, 1)
    if cap is None:
        scores = torch.matmul(q * plan.scaling, k.transpose(-1, -2)).masked_fill_(~mask, -torch.inf)
        return torch.matmul(scores.softmax(-1), v).view(b, nq, s, d)
    scores = torch.matmul(q, k.transpose(-1, -2)) * plan.scaling
    scores = (torch.tanh(scores / cap) * cap).masked_fill_(~mask, -torch.inf)
    return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(q.dtype), v).view(b, nq, s, d)


def _qk_norm(qkv: Tensor, lw: dict, plan: DecodePlan, eps: float, b: int, s: int) -> Tensor:
    """Queries and keys normalised before RoPE: per head (Qwen3, Gemma 3) or over the whole projection (OLMo 2)."""
    fam, nq, nkv, d = plan.family, plan.n_heads, plan.n_kv, plan.head_dim
    if fam.qk_norm == "head":
        qkv = qkv.view(b, s, -1, d)
        return torch.cat([rms_norm(qkv[:, :, : nq + nkv], lw["qk_norm"], eps, fam.norm_scale_first),
                          qkv[:, :, nq + nkv :]], 2)  # fmt: skip
    q, k, v = qkv.split([nq * d, nkv * d, nkv * d], 1)
    return torch.cat([rms_norm(q, lw["q_norm"], eps, fam.norm_scale_first),
                      rms_norm(k, lw["k_norm"], eps, fam.norm_scale_first), v], 1)  # fmt: skip


def decode_layers(plan: DecodePlan, weights, h: Tensor, pos: Tensor, ropes: dict, masks: dict, ks: list[Tensor],
                  vs: list[Tensor], kv_len: int | None) -> Tensor:  # fmt: skip
    """Every decoder layer on ``h`` [B, S, H] at positions ``pos`` [S] (``ropes[key]``: cos / sin [S, n, d] over the
    n = n_q + 2 n_kv fused heads; ``masks[window]``), writing K/V into the cache ``ks``/``vs`` (keys beyond ``kv_len``
    ignored when given); returns the final-norm hidden states [B * S, H]."""
    b, s, hidden = h.shape
    fam, eps, nq, nkv, d = plan.family, weights.eps, plan.n_heads, plan.n_kv, plan.head_dim
    first, r = fam.norm_scale_first, plan.rotary_dim
    h = h.reshape(b * s, hidden)
    for i, lw in enumerate(weights.layers):
        x = h if fam.layout == "post" else rms_norm(h, lw["ln1"], eps, first)
        qkv = _linear(x, lw["qkv"], lw["qkv_b"])
        if fam.qk_norm is not None:
            qkv = _qk_norm(qkv, lw, plan, eps, b, s)
        qkv = qkv.view(b, s, -1, d)
        cos, sin = ropes[plan.rope_keys[i]]
        # RoPE (rotate-half convention) on the q and k heads; products and sums in the order of transformers' layers
        rot = qkv.roll(r // 2, -1) if r == d else torch.cat([qkv[..., :r].roll(r // 2, -1), qkv[..., r:]], -1)
        roped = qkv * cos + rot * sin
        qkv = (roped.to(qkv.dtype) if fam.rope_float32 else roped).transpose(1, 2)  # [B, n, S, d]
        k, v = ks[i], vs[i]
        k.index_copy_(2, pos, qkv[:, nq : nq + nkv].to(k.dtype))
        v.index_copy_(2, pos, qkv[:, nq + nkv :].to(v.dtype))
        if kv_len is not None:
            k, v = k[:, :, :kv_len], v[:, :, :kv_len]
        o = attend(qkv[:, :nq], k.to(qkv.dtype), v.to(qkv.dtype), masks[plan.windows[i]], plan)
        o = _linear(o.transpose(1, 2).reshape(b * s, nq * d), lw["o"], lw["o_b"])
        if fam.layout != "pre":
            o = rms_norm(o, lw["post_attn"], eps, first)
        h = h + o
        x = h if fam.layout == "post" else rms_norm(h, lw["ln2"], eps, first)
        gu = _linear(x, lw["gate_up"], lw["gate_up_b"])
        inter = gu.shape[1] // 2
        m = _linear(plan.act(gu[:, :inter]) * gu[:, inter:], lw["down"], lw["down_b"])
        if fam.layout != "pre":
            m = rms_norm(m, lw["post_ff"], eps, first)
        h = h + m
    return rms_norm(h, weights.head["norm"], eps, first)


def logits_of(plan: DecodePlan, weights, h: Tensor) -> Tensor:
    """The LM head on final-norm hidden states, soft-capped when the family does (Gemma: ``tanh(z / c) * c``)."""
    logits = _linear(h, weights.head["head"], weights.head["head_b"])
    cap = plan.final_softcap
    return logits if cap is None else torch.tanh(logits / cap) * cap
