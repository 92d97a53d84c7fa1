"""Dual LoRA adapters for gradient routing (Cloud et al. 2024, "Gradient Routing: Masking Gradients to
Localize Computation in Neural Networks", arXiv:2410.04332; RL port after small-rl's DualLoRALinear).

Each targeted linear layer (``nn.Linear``, or transformers' ``Conv1D`` as in GPT-2; ``models.arch`` finds them in
any family's decoder blocks) becomes a :class:`DualLoRALinear`::

    y = base(x) + retain_scale * s_r * B_r A_r x + forget_scale * s_f * B_f A_f x,    s = alpha / rank

where base(x) = W x + b (``nn.Linear``, W [out, in]) or x W + b (``Conv1D``, W [in, out]; PEFT's fan_in_fan_out)
with LoRA's initialisation (Hu et al. 2021, as PEFT: A Kaiming-uniform with a = sqrt(5), B = 0). Rank 0
means the side is absent. The base model is frozen. ``retain_scale``/``forget_scale`` ablate the sides
at inference (``scales(model, 1, 0)`` = retain_only); ``adapters_disabled(model)`` is the base model,
used as the reference policy when beta > 0.

Routing (``routing.step.routing_mask``): parameter gradients of an adapter come only from the samples
routed to it; activations and input gradients are untouched, so every other parameter sees the full batch.
    mode "shared":    retain <- good samples,  forget <- all samples
    mode "exclusive": retain <- good samples,  forget <- bad samples
Both sides run as one low-rank call (stacked ranks, as one LoRA of rank r_r + r_f) whose backward
multiplies the per-sample 0/1 factor into the (tokens x rank) tensors that form dA and dB: the cost of
plain LoRA. It equals the two-pass reference ``routing.step.two_pass_backward`` (tests/test_routing_step.py).
Detaching the branch *output* per sample (``r(x)*m + r(x).detach()*(1-m)``) is not equivalent: it also
cuts the input gradient through the retain branch for bad samples, which changes the gradient of every
adapter below it once B != 0. Per-sample routing assumes samples do not interact in the forward (true
for decoder LMs; not for batch norm, nor for an MoE load-balancing loss).

TRL 1.16 computes training log-probs with a fused LM head that reads ``lm_head.weight`` directly and
never calls ``lm_head.forward``. ``DualLoRALinear.weight`` is therefore the effective (merged) weight in the wrapped
layer's own layout (W + s B A for nn.Linear, its transpose added for Conv1D, as PEFT's ``transpose``), so
an lm_head adapter is trained through that path too; a merged weight cannot carry a mixed per-sample
mask, so reading it under one raises (use the two-pass step, or an unfused head, for lm_head adapters).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from trl_ext import compat
from trl_ext.models.arch import LINEAR_TYPES, architecture, block_linears, decoder_blocks, matches
from trl_ext.routing.adapter_layout import DualLoRALayout

# Inference ablations of the routing eval: name -> (retain_scale, forget_scale).
ABLATION_SCALES = {"both": (1.0, 1.0), "retain_only": (1.0, 0.0), "forget_only": (0.0, 1.0)}
_SIDES = ("retain", "forget")


class _LowRankBranch(torch.autograd.Function):
    """``y = (x A^T) (B * scale)^T`` whose parameter gradients count only the samples each rank is routed from.

    A: (r, in) and x in the compute dtype; B: (out, r) and scale: (r,) in the adapter dtype. ``rank_mask``
    (broadcastable to x[..., :r]; None = all) is a ctx attribute, not a saved tensor: a non-reentrant
    checkpoint recompute keeps the original mask.
    """

    @staticmethod
    def forward(ctx, x, A, B, scale, rank_mask):
        h = F.linear(x, A)
        Bs = (B * scale).to(h.dtype)  # scaled in the adapter dtype: alpha/rank is not rounded to bf16
        ctx.save_for_backward(x, A, Bs, h, scale)
        ctx.rank_mask = rank_mask
        return F.linear(h, Bs)

    @staticmethod
    def backward(ctx, gy):
        x, A, Bs, h, scale = ctx.saved_tensors
        m = ctx.rank_mask
        gh = gy @ Bs  # dL/dh, (..., r)
        gx = gh @ A if ctx.needs_input_grad[0] else None
        if m is not None:
            gh, h = gh * m, h * m
        r = A.shape[0]
        gA = gh.reshape(-1, r).t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        gB = None
        if ctx.needs_input_grad[2]:
            gB = (gy.reshape(-1, gy.shape[-1]).t() @ h.reshape(-1, r)).to(scale.dtype) * scale
        return gx, gA, gB, None, None


def _cat(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim)


def _rank_mask(x: torch.Tensor, masks: list, ranks: list[int], dt: torch.dtype) -> torch.Tensor:
    """(batch, 1, ..., r): 1 where a sample trains a stacked rank, from per-side sample masks (None = all)."""
    n = next(m for m in masks if m is not None).shape[0]
    if x.dim() < 2 or x.shape[0] != n:
        raise RuntimeError(f"routing mask covers {n} samples but this layer's input has shape {tuple(x.shape)}: "
                           "the routed batch must go through the model in one call")
    cols = [(torch.ones(n, dtype=dt, device=x.device) if m is None else m.to(x.device, dt))[:, None].expand(-1, r)
            for m, r in zip(masks, ranks)]
    return _cat(cols, 1).reshape(n, *([1] * (x.dim() - 2)), -1)


class DualAdapter(nn.Module):
    """A module with a retain and a forget adapter: ``retain_scale``/``forget_scale`` (inference ablation),
    ``retain_grad_mask``/``forget_grad_mask`` (per-sample routing, set by ``routing.step.routing_mask``) and its
    adapter parameters by side. DualLoRALinear here; DualMLPAdapter in routing/mlp.py."""

    def adapter_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name local to this module, parameter) of both adapters, retain first."""
        raise NotImplementedError

    def side_parameters(self, side: str) -> list[nn.Parameter]:
        return [p for n, p in self.adapter_named_parameters() if n.startswith(f"{side}_")]


class DualLoRALinear(DualAdapter):
    """``nn.Linear`` (or ``Conv1D``) plus a retain and a forget LoRA adapter (see the module docstring)."""

    def adapter_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(f"{side}_{m}", getattr(self, f"{side}_{m}")) for side in _SIDES for m in "AB"
                if getattr(self, f"{side}_{m}") is not None]

    def __init__(self, base_layer: nn.Module, retain_rank: int, forget_rank: int, alpha: float):
        super().__init__()
        if not isinstance(base_layer, LINEAR_TYPES):
            raise TypeError(f"DualLoRALinear wraps nn.Linear or Conv1D, got {type(base_layer).__name__}")
        if not alpha > 0:
            raise ValueError(f"lora alpha must be > 0, got {alpha!r}")
        self.base_layer = base_layer
        base_layer.requires_grad_(False)
        w = base_layer.weight
        self.fan_in_fan_out = not isinstance(base_layer, nn.Linear)  # Conv1D: weight [in, out]
        self.in_features, self.out_features = w.shape[::-1] if not self.fan_in_fan_out else w.shape
        # Half-precision bases get float32 adapters (as PEFT's autocast_adapter_dtype); others keep theirs.
        dtype = torch.float32 if w.dtype in (torch.float16, torch.bfloat16) else w.dtype
        self.ranks = {"retain": retain_rank, "forget": forget_rank}
        self.scaling = {side: alpha / r if r else 0.0 for side, r in self.ranks.items()}
        for side, r in self.ranks.items():
            if r < 0:
                raise ValueError(f"{side} rank must be >= 0, got {r}")
            A = B = None
            if r:
                A = nn.Parameter(torch.empty(r, self.in_features, device=w.device, dtype=dtype))
                B = nn.Parameter(torch.zeros(self.out_features, r, device=w.device, dtype=dtype))
                nn.init.kaiming_uniform_(A, a=math.sqrt(5))
            self.register_parameter(f"{side}_A", A)
            self.register_parameter(f"{side}_B", B)
        self.retain_scale = 1.0
        self.forget_scale = 1.0
        # Per-sample gradient masks (True = this sample trains the side), set by ``routing.step.routing_mask``.
        self.retain_grad_mask: torch.Tensor | None = None
        self.forget_grad_mask: torch.Tensor | None = None

    def _branches(self) -> Iterator[tuple[nn.Parameter, nn.Parameter, float, torch.Tensor | None]]:
        for side in _SIDES:
            scale = getattr(self, f"{side}_scale")
            if self.ranks[side] and scale != 0.0:
                A, B = getattr(self, f"{side}_A"), getattr(self, f"{side}_B")
                yield A, B, self.scaling[side] * scale, getattr(self, f"{side}_grad_mask")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        branches = list(self._branches())
        if not branches:
            return y
        A0 = branches[0][0]
        dt = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else A0.dtype
        A = _cat([b[0] for b in branches], 0).to(dt)
        B = _cat([b[1] for b in branches], 1)
        scale = torch.cat([torch.full((b[0].shape[0],), b[2], dtype=B.dtype, device=B.device) for b in branches])
        masks = [b[3] for b in branches]
        rank_mask = None
        if any(m is not None for m in masks):
            rank_mask = _rank_mask(x, masks, [b[0].shape[0] for b in branches], dt)
        return y + _LowRankBranch.apply(x.to(dt), A, B, scale, rank_mask).to(y.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """Effective weight ``W + sum_side scale * s * B A`` in the wrapped layer's layout (the delta transposed
        for Conv1D), for code that reads the weight directly."""
        w = self.base_layer.weight
        delta = None
        for A, B, s, mask in self._branches():
            if mask is not None:
                if not (mask.all() or not mask.any()):
                    raise RuntimeError(
                        "a merged weight cannot route per sample: this batch mixes routed and unrouted "
                        "samples (use the two-pass step or an unfused head for lm_head adapters)"
                    )
                c = float(mask.flatten()[0])  # value of A exactly; gradient c * dA (zeros when c = 0)
                A, B = A * c + A.detach() * (1 - c), B * c + B.detach() * (1 - c)
            d = (B @ A) * s
            delta = d if delta is None else delta + d
        if delta is None:
            return w
        return w + (delta.t() if self.fan_in_fan_out else delta).to(w.dtype)

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    def extra_repr(self) -> str:
        r, f = self.ranks["retain"], self.ranks["forget"]
        return f"retain_rank={r}, forget_rank={f}, retain_scale={self.retain_scale}, forget_scale={self.forget_scale}"


def decoder_layers(model: nn.Module, layer_start: int, layer_end: int | None, layer_stride: int):
    """(the model's decoder blocks, wherever its family keeps them (``models.arch.decoder_blocks``), the checked end
    of the adapted range ``layer_start:end:layer_stride``)."""
    _, layers = decoder_blocks(model)
    n = len(layers)
    end = n if layer_end is None else layer_end
    if not (0 <= layer_start < end <= n) or layer_stride < 1:
        raise ValueError(f"bad layer range start={layer_start} end={layer_end} stride={layer_stride} for {n} layers")
    return layers, end


def apply_dual_lora(
    model: nn.Module,
    retain_rank: int,
    forget_rank: int,
    alpha: float,
    layer_start: int = 0,
    layer_end: int | None = None,
    layer_stride: int = 1,
    targets: tuple[str, ...] | None = None,
    include_lm_head: bool = False,
) -> DualLoRALayout:
    """Freeze ``model`` and wrap the linear layers ``targets`` select (PEFT's name rule, ``models.arch.matches``;
    None = every linear of a block, ``Architecture.default_targets``) in the decoder blocks
    ``layer_start:layer_end:layer_stride`` (and, optionally, the LM head: a tied base weight stays shared with the
    embeddings and frozen). Every name must select at least one linear layer of every adapted block."""
    if any(isinstance(m, DualAdapter) for m in model.modules()):
        raise ValueError("the model already has dual adapters")
    layers, end = decoder_layers(model, layer_start, layer_end, layer_stride)
    targets = architecture(model).default_targets if targets is None else tuple(targets)
    if not targets or len(set(targets)) != len(targets):
        raise ValueError(f"targets must be non-empty and distinct, got {targets}")
    sites = []  # (parent, attribute); all found before anything is changed
    for i in range(layer_start, end, layer_stride):
        linears = block_linears(layers[i])
        for target in targets:
            if not any(matches(target, path) for path in linears):
                raise ValueError(f"layer {i}: no linear layer matches {target!r}; linear layers: {', '.join(linears)}")
        for path in linears:
            if any(matches(t, path) for t in targets):
                parent_name, _, child = path.rpartition(".")
                sites.append((layers[i].get_submodule(parent_name), child))
    if include_lm_head and not isinstance(model.get_output_embeddings(), nn.Linear):
        raise ValueError(f"the output layer is {type(model.get_output_embeddings()).__name__}, not nn.Linear")
    model.requires_grad_(False)
    for parent, child in sites:
        setattr(parent, child, DualLoRALinear(getattr(parent, child), retain_rank, forget_rank, alpha))
    if include_lm_head:
        head = model.get_output_embeddings()
        name = next(n for n, m in model.named_modules() if m is head)
        model.set_output_embeddings(DualLoRALinear(head, retain_rank, forget_rank, alpha))
        # Keep transformers' tie bookkeeping true (save_pretrained, tie_weights): the tied parameter moved.
        compat.rename_tied_weights(model, {f"{name}.weight": f"{name}.base_layer.weight"})
    return DualLoRALayout(retain_rank, forget_rank, float(alpha), tuple(targets), layer_start, end, layer_stride,
                          include_lm_head)


def dual_lora_modules(model: nn.Module) -> list[DualAdapter]:
    """Every dual adapter module (DualLoRALinear or DualMLPAdapter) of ``model``."""
    mods = [m for m in model.modules() if isinstance(m, DualAdapter)]
    if not mods:
        raise ValueError(f"{type(model).__name__} has no DualLoRALinear or DualMLPAdapter modules")
    return mods


def retain_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for m in dual_lora_modules(model) for p in m.side_parameters("retain")]


def forget_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for m in dual_lora_modules(model) for p in m.side_parameters("forget")]


def set_scales(model: nn.Module, retain: float, forget: float) -> None:
    if not (math.isfinite(retain) and math.isfinite(forget)):
        raise ValueError(f"adapter scales must be finite, got retain={retain}, forget={forget}")
    for m in dual_lora_modules(model):
        m.retain_scale, m.forget_scale = float(retain), float(forget)


@contextmanager
def scales(model: nn.Module, retain: float, forget: float) -> Iterator[None]:
    """Set the adapter scales for the body; the previous scales come back even if it raises."""
    mods = dual_lora_modules(model)
    previous = [(m.retain_scale, m.forget_scale) for m in mods]
    try:
        set_scales(model, retain, forget)
        yield
    finally:
        for m, (r, f) in zip(mods, previous):
            m.retain_scale, m.forget_scale = r, f


def adapters_disabled(model: nn.Module):
    """The base model (both adapters off): the reference policy when beta > 0."""
    return scales(model, 0.0, 0.0)
