"""The decode weights of a supported model (``trl_ext.generation.families``) as a few fused matrices: per layer one
[H, (n_q + 2 n_kv) d] QKV matrix, the output projection, one [H, 2 I] gate/up matrix and the down projection (each
stored transposed, ready for ``addmm``), plus the RMSNorm weights of the family's layout (Gemma's as ``1 + w`` in
float32, as ``Gemma2RMSNorm`` applies them).

Every projection is read as the affine map it computes: a plain ``nn.Linear`` gives its own weight (a view, no
copy); any wrapper (PEFT LoRA, the project's dual LoRA) is applied to the identity matrix, ``W^T = f(I) - f(0)``,
``b = f(0)``, which is its merged weight (``W + s B A`` for LoRA) with no knowledge of the wrapper. Buffers are
allocated once and refreshed in place, so a CUDA graph captured on them reads the current weights.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from trl_ext.generation.families import FAMILIES, Family


def affine_of(module: nn.Module, in_features: int, like: Tensor) -> tuple[Tensor, Tensor | None]:
    """``(W^T [in, out], b [out] or None)`` of a projection that computes ``x -> x W^T + b``."""
    if type(module) is nn.Linear:
        return module.weight.t(), module.bias
    eye = torch.eye(in_features, dtype=like.dtype, device=like.device)
    zero = module(torch.zeros(1, in_features, dtype=like.dtype, device=like.device))
    w_t = module(eye) - zero
    return w_t, (zero[0] if bool(zero.ne(0).any()) else None)


def _cat_cols(parts: list[tuple[Tensor, Tensor | None]]) -> tuple[Tensor, Tensor | None]:
    w_t = torch.cat([w for w, _ in parts], dim=1)
    if all(b is None for _, b in parts):
        return w_t, None
    return w_t, torch.cat([b if b is not None else w.new_zeros(w.shape[1]) for w, b in parts])


def check_generation_safe(model: nn.Module) -> None:
    """ValueError when sampling would run a dropout module in training mode (TRL generates with the model in training
    mode): e.g. a PEFT adapter's ``lora_dropout`` or Phi-3's resid_pdrop (functional config dropouts are refused by
    ``families.fast_backend_refusal``)."""
    if model.training and any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()):
        raise ValueError("the fast generation backend cannot sample with dropout active (set the dropouts to 0, or use "
                         "--generation_backend trl)")  # fmt: skip


def _norm_weight(norm: nn.Module, family: Family) -> Tensor:
    """The weight an RMSNorm multiplies by: its own (a view), or ``1 + w`` in float32 for Gemma."""
    return 1.0 + norm.weight.float() if family.gemma_norm else norm.weight


_NORMS = {
    "pre": {"ln1": "input_layernorm", "ln2": "post_attention_layernorm"},
    "sandwich": {"ln1": "input_layernorm", "post_attn": "post_attention_layernorm", "ln2": "pre_feedforward_layernorm",
                 "post_ff": "post_feedforward_layernorm"},
    "post": {"post_attn": "post_attention_layernorm", "post_ff": "post_feedforward_layernorm"},
}  # fmt: skip
"""Per layout (`Family.layout`), the decode step's norm slots and the decoder layer's modules that fill them."""


def _layer_weights(layer: nn.Module, family: Family, hidden: int, like: Tensor) -> dict[str, Tensor | None]:
    attn, mlp = layer.self_attn, layer.mlp
    if family.fused:  # Phi-3: [q; k; v] and [gate; up] already fused
        qkv, gate_up = affine_of(attn.qkv_proj, hidden, like), affine_of(mlp.gate_up_proj, hidden, like)
    else:
        qkv = _cat_cols([affine_of(m, hidden, like) for m in (attn.q_proj, attn.k_proj, attn.v_proj)])
        gate_up = _cat_cols([affine_of(m, hidden, like) for m in (mlp.gate_proj, mlp.up_proj)])
    o = affine_of(attn.o_proj, attn.o_proj.in_features, like)
    down = affine_of(mlp.down_proj, mlp.down_proj.in_features, like)
    out = {"qkv": qkv[0], "qkv_b": qkv[1], "gate_up": gate_up[0], "gate_up_b": gate_up[1], "o": o[0], "o_b": o[1],
           "down": down[0], "down_b": down[1]}  # fmt: skip
    out |= {key: _norm_weight(getattr(layer, name), family) for key, name in _NORMS[family.layout].items()}
    if family.qk_norm == "head":  # one [n_q + n_kv, d] weight over the q and k heads of the fused QKV output
        q_w, k_w = _norm_weight(attn.q_norm, family), _norm_weight(attn.k_norm, family)
        n_q, n_kv = attn.config.num_attention_heads, attn.config.num_key_value_heads
        out["qk_norm"] = torch.cat([q_w.expand(n_q, -1), k_w.expand(n_kv, -1)])
    elif family.qk_norm == "proj":
        out["q_norm"], out["k_norm"] = _norm_weight(attn.q_norm, family), _norm_weight(attn.k_norm, family)
    return out


class DecodeWeights:
    """Fused decode weights of ``decoder`` (a supported ``*ForCausalLM``); `refresh` re-reads them from the modules."""

    def __init__(self, decoder: nn.Module) -> None:
        self.decoder = decoder
        self.family = FAMILIES[decoder.config.model_type]
        self.layers: list[dict[str, Tensor | None]] = []
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        inner = self.decoder.model
        like = inner.embed_tokens.weight
        hidden = like.shape[1]
        fresh = [_layer_weights(layer, self.family, hidden, like) for layer in inner.layers]
        head = affine_of(self.decoder.lm_head, hidden, like)
        fresh_head = {"head": head[0], "head_b": head[1], "norm": _norm_weight(inner.norm, self.family)}
        if not self.layers:
            self.layers, self.head = fresh, fresh_head
            norm = inner.norm
            self.eps = norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps  # Llama's, Gemma's
            return
        for old, new in zip([*self.layers, self.head], [*fresh, fresh_head], strict=True):
            for name, tensor in new.items():
                if (old[name] is None) != (tensor is None):
                    raise RuntimeError(f"decode weight {name} appeared or vanished between refreshes")
                if tensor is not None and old[name].data_ptr() != tensor.data_ptr():
                    old[name].copy_(tensor)
