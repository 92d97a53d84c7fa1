"""The decode weights of a Llama-family model as a few fused matrices: per layer one [H, (n_q + 2 n_kv) d] QKV
matrix, the output projection, one [H, 2 I] gate/up matrix and the down projection (each stored transposed, ready
for ``addmm``), plus the RMSNorm weights.

Every projection is read as the affine map it computes: a plain ``nn.Linear`` gives its own weight (a view, no
copy); any wrapper (PEFT LoRA, the project's dual LoRA) is applied to the identity matrix, ``W^T = f(I) - f(0)``,
``b = f(0)``, which is its merged weight (``W + s B A`` for LoRA) with no knowledge of the wrapper. Buffers are
allocated once and refreshed in place, so a CUDA graph captured on them reads the current weights.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


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


def check_generation_safe(model: nn.Module, decoder: nn.Module) -> None:
    """ValueError when sampling would need something the fast path does not do: dropout active at generation time
    (TRL generates with the model in training mode), or an activation other than SiLU."""
    cfg = decoder.config
    if cfg.hidden_act != "silu":
        raise ValueError(f"the fast generation backend supports hidden_act 'silu', got {cfg.hidden_act!r}")
    if model.training and (getattr(cfg, "attention_dropout", 0.0) or any(
            isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())):  # fmt: skip
        raise ValueError("the fast generation backend cannot sample with dropout active (set the dropouts to 0)")


class DecodeWeights:
    """Fused decode weights of ``decoder`` (a ``*ForCausalLM``); `refresh` re-reads them from the modules."""

    def __init__(self, decoder: nn.Module) -> None:
        self.decoder = decoder
        self.layers: list[dict[str, Tensor | None]] = []
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        inner = self.decoder.model
        like = inner.embed_tokens.weight
        hidden = like.shape[1]
        fresh = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = _cat_cols([affine_of(m, hidden, like) for m in (attn.q_proj, attn.k_proj, attn.v_proj)])
            gate_up = _cat_cols([affine_of(m, hidden, like) for m in (mlp.gate_proj, mlp.up_proj)])
            o = affine_of(attn.o_proj, attn.o_proj.in_features, like)
            down = affine_of(mlp.down_proj, mlp.down_proj.in_features, like)
            fresh.append({"qkv": qkv[0], "qkv_b": qkv[1], "gate_up": gate_up[0], "gate_up_b": gate_up[1],
                          "o": o[0], "o_b": o[1], "down": down[0], "down_b": down[1],
                          "ln1": layer.input_layernorm.weight,
                          "ln2": layer.post_attention_layernorm.weight})  # fmt: skip
        head = affine_of(self.decoder.lm_head, hidden, like)
        fresh_head = {"head": head[0], "head_b": head[1], "norm": inner.norm.weight}
        if not self.layers:
            self.layers, self.head = fresh, fresh_head
            self.eps = inner.norm.variance_epsilon
            return
        for old, new in zip([*self.layers, self.head], [*fresh, fresh_head], strict=True):
            for name, tensor in new.items():
                if (old[name] is None) != (tensor is None):
                    raise RuntimeError(f"decode weight {name} appeared or vanished between refreshes")
                if tensor is not None and old[name].data_ptr() != tensor.data_ptr():
                    old[name].copy_(tensor)
