"""The architectures of the fast generation backend, described by how their decoder layer departs from Llama's, and
`fast_backend_refusal`: whether a config (no weights) can be sampled exactly. Pure: no torch, usable at parse time.

Every entry restates its transformers ``models/<family>/modeling_<family>.py`` (5.x) in the terms of the fast decode
step (``trl_ext.generation.layers``):

- llama, qwen2, mistral: pre-norm layers (``h + attn(norm(h))``, ``h + mlp(norm(h))``), RMSNorm ``w * n(x).to(dtype)``;
  qwen2 and mistral with their sliding windows (qwen2 on the layers its ``layer_types`` marks ``sliding_attention``,
  mistral on every layer when ``sliding_window`` is set: ``create_sliding_window_causal_mask``).
- qwen3: qwen2 plus a per-head RMSNorm of the queries and keys before RoPE (``q_norm``/``k_norm`` over head_dim).
- phi3: Llama with fused ``qkv_proj`` and ``gate_up_proj`` ([gate; up]), partial RoPE (``partial_rotary_factor``:
  the first ``rotary_dim`` dims of a head rotate), ``sliding_window`` on every layer when set.
- olmo2: post-norm layers (``h + norm(attn(h))``, ``h + norm(mlp(h))``), RMSNorm ``(w * n(x)).to(dtype)``, q_norm /
  k_norm over the whole q / k projection before the head split, RoPE in float32.
- gemma2: Gemma RMSNorm ``(n(x) * (1 + w)).to(dtype)``, sandwich layers (``h + post(attn(pre(h)))``, the same around
  the MLP), the embedding scaled by sqrt(hidden) in the model dtype (the model's own embedding module), GELU (tanh)
  gate, ``query_pre_attn_scalar ** -0.5`` scaling, attention logits soft-capped (``tanh(s / c) * c``) before the mask,
  final logits soft-capped, sliding windows on the ``sliding_attention`` layers.
- gemma3_text: gemma2 plus per-head q_norm / k_norm (Gemma form), a RoPE table per layer type (the sliding layers'
  ``rope_parameters["sliding_attention"]``: the local base, ``rope_local_base_freq`` in older configs). Its attention
  applies no logit soft-cap even when ``attn_logit_softcapping`` is set (``Gemma3Attention`` does not pass it), so
  neither does this backend; the final soft-cap applies when configured.
"""

from __future__ import annotations

from dataclasses import dataclass

WAY_ON = "use --generation_backend trl"
ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh")
"""MLP activations the fast backend computes as transformers' ``ACT2FN`` does (F.silu, F.gelu, F.gelu tanh)."""
LAYER_TYPES = ("full_attention", "sliding_attention")
_DYNAMIC_ROPE = ("dynamic", "longrope")  # frequencies recomputed from the forward's sequence length
FUNCTIONAL_DROPOUTS = ("attention_dropout",)
"""Config dropouts every supported family applies in training mode as a functional argument (no nn.Dropout module:
TRL's ``--disable_dropout`` leaves them on)."""


@dataclass(frozen=True)
class Family:
    """How a decoder layer differs from Llama's (defaults: Llama)."""

    norm_scale_first: bool = False
    """RMSNorm multiplies by its weight in float32 before the cast back (Gemma, OLMo 2), not after (Llama)."""
    gemma_norm: bool = False
    """RMSNorm weight w acts as ``1 + w`` (Gemma)."""
    layout: str = "pre"
    """'pre': h + f(norm(h)); 'sandwich': h + post_norm(f(pre_norm(h))); 'post': h + norm(f(h))."""
    qk_norm: str | None = None
    """'head': RMSNorm per head (over head_dim) before RoPE; 'proj': over the whole q / k projection."""
    fused: bool = False
    """Phi-3: ``qkv_proj`` and ``gate_up_proj`` instead of q/k/v_proj and gate/up_proj."""
    act_field: str = "hidden_act"
    windows: str = "layer_types"
    """Where sliding windows come from: 'none', 'all' (config.sliding_window on every layer), 'layer_types'."""
    attn_softcap: bool = False
    final_softcap: bool = False
    rope_per_layer_type: bool = False
    rope_float32: bool = False
    """cos/sin stay float32 and the rotation is cast back to the model dtype (OLMo 2)."""
    module_dropouts: tuple[str, ...] = ()
    """Config dropouts applied by ``nn.Dropout`` modules (zeroed by ``--disable_dropout``)."""


FAMILIES: dict[str, Family] = {
    "llama": Family(windows="none"),
    "qwen2": Family(),
    "qwen3": Family(qk_norm="head"),
    "mistral": Family(windows="all"),
    "phi3": Family(fused=True, windows="all", module_dropouts=("resid_pdrop",)),  # its embd_pdrop is unused
    "olmo2": Family(norm_scale_first=True, layout="post", qk_norm="proj", windows="none", rope_float32=True),
    "gemma2": Family(norm_scale_first=True, gemma_norm=True, layout="sandwich", act_field="hidden_activation",
                     attn_softcap=True, final_softcap=True),
    "gemma3_text": Family(norm_scale_first=True, gemma_norm=True, layout="sandwich", qk_norm="head",
                          act_field="hidden_activation", final_softcap=True, rope_per_layer_type=True),
}  # fmt: skip
"""model_type -> its layer description: the architectures the fast generation backend samples exactly."""


def layer_windows(config) -> list[int | None]:
    """Per decoder layer, its sliding window (a query at position q sees keys q - w < k <= q) or None (full causal)."""
    family, n = FAMILIES[config.model_type], config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if family.windows == "none":
        return [None] * n
    if family.windows == "all":
        return [window] * n
    types = getattr(config, "layer_types", None) or ["full_attention"] * n
    return [window if t == "sliding_attention" else None for t in types[:n]]


def rope_keys(config) -> list[str | None]:
    """Per decoder layer, the key of its RoPE table: its layer type (Gemma 3) or None (one table for all layers)."""
    if FAMILIES[config.model_type].rope_per_layer_type:
        return list(config.layer_types[: config.num_hidden_layers])
    return [None] * config.num_hidden_layers


def _rope_types(config) -> list[str]:
    params = getattr(config, "rope_parameters", None) or {}
    if "rope_type" in params or not all(isinstance(v, dict) for v in params.values()):
        return [params.get("rope_type", "default")]
    return [p.get("rope_type", "default") for p in params.values()]  # per layer type (Gemma 3)


def fast_backend_refusal(config, disable_dropout: bool = False) -> str | None:
    """None when the fast generation backend samples ``config``'s architecture exactly, else a one-line reason that
    names the model_type and the way on. Decided from the config alone (no weights): the architecture, its MLP
    activation, dropout (TRL samples with the model in training mode, where dropout is active and random; with
    ``disable_dropout`` (TRL's ``--disable_dropout``) the nn.Dropout modules are zeroed, the attention dropout is
    not), the attention pattern (layer types, bidirectional attention, sliding windows) and RoPE types that recompute
    their frequencies from the sequence length (dynamic, longrope). A dropout module the config does not describe
    (a LoRA adapter's) is checked when sampling (``weights.check_generation_safe``)."""
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        return (f"the fast generation backend does not implement model_type {model_type!r} (it runs "
                f"{', '.join(FAMILIES)}); {WAY_ON}")  # fmt: skip

    def refuse(why: str) -> str:
        return f"the fast generation backend cannot sample this {model_type!r} model: {why}; {WAY_ON}"

    act = getattr(config, family.act_field, None)
    if act not in ACTIVATIONS:
        return refuse(f"{family.act_field} {act!r} is not one of {', '.join(ACTIVATIONS)}")
    fields = FUNCTIONAL_DROPOUTS + (() if disable_dropout else family.module_dropouts)
    dropouts = [f"{k}={getattr(config, k)}" for k in fields if getattr(config, k, 0.0)]
    if dropouts:
        return refuse(f"dropout is configured ({', '.join(dropouts)}) and TRL samples in training mode; set it to 0")
    if getattr(config, "use_bidirectional_attention", False):
        return refuse("use_bidirectional_attention is set")
    types = getattr(config, "layer_types", None) or ()
    odd = sorted(set(types) - set(LAYER_TYPES))
    if odd and family.windows == "layer_types":
        return refuse(f"layer types {', '.join(odd)} (it runs {', '.join(LAYER_TYPES)})")
    if family.windows == "layer_types" and "sliding_attention" in types and not getattr(config, "sliding_window", None):
        return refuse("sliding_attention layers without a sliding_window")
    dynamic = sorted({t for t in _rope_types(config) if any(d in t for d in _DYNAMIC_ROPE)})
    if dynamic:
        return refuse(f"rope_type {', '.join(dynamic)} recomputes its frequencies from the sequence length")
    return None
