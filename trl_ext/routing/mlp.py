"""MLP adapters for gradient routing (small-rl ``DualMLPAdapter``, gradient_routing.py at HEAD 6f6e986): each
decoder layer's MLP gets two parallel mini-SwiGLU networks of n neurons,

    y = mlp(x) + retain_scale * down_r(SiLU(gate_r x) * up_r x) + forget_scale * down_f(SiLU(gate_f x) * up_f x)

gate/up Kaiming-uniform (a = sqrt(5)), down zero (the adapter output starts at 0, as LoRA's B), the base MLP
frozen. Routing gates each side's *parameter* gradient per sample and leaves the input gradient whole, with
small-rl's stop-gradient decomposition ``_fused_decouple``: for a side's output g and its 0/1 sample mask m,

    out = g(x) - (1 - m) g(x.detach()) + (1 - m) g(x).detach()

has the value g(x), the parameter gradient m dg/dtheta and the input gradient dg/dx. It costs one more forward of
the (small) adapter on masked calls.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from trl_ext.routing.adapter_layout import DualLoRALayout
from trl_ext.routing.adapters import _SIDES, DualAdapter, decoder_layers

# --mlp_config presets (small-rl vllm_utils.MLP_PRESETS, HEAD 6f6e986): name -> (retain, forget) neurons.
MLP_PRESETS = {**{f"m{n}": (n, n) for n in (5, 10, 16, 30, 32, 64, 128)}, "m29f3": (29, 3), "m24f8": (24, 8)}
MLP_WEIGHTS = ("gate", "up", "down")


class DualMLPAdapter(DualAdapter):
    """A frozen MLP plus a retain and a forget mini-SwiGLU adapter (see the module docstring)."""

    def __init__(self, base_mlp: nn.Module, hidden_size: int, retain_neurons: int, forget_neurons: int):
        super().__init__()
        self.base_mlp = base_mlp
        base_mlp.requires_grad_(False)
        w = next(base_mlp.parameters())
        dtype = torch.float32 if w.dtype in (torch.float16, torch.bfloat16) else w.dtype
        self.ranks = {"retain": retain_neurons, "forget": forget_neurons}
        for side, n in self.ranks.items():
            if n < 0:
                raise ValueError(f"{side} neurons must be >= 0, got {n}")
            for name, shape in (("gate", (n, hidden_size)), ("up", (n, hidden_size)), ("down", (hidden_size, n))):
                p = None
                if n:
                    p = nn.Parameter(torch.empty(shape, device=w.device, dtype=dtype))
                    if name == "down":
                        nn.init.zeros_(p)
                    else:
                        nn.init.kaiming_uniform_(p, a=math.sqrt(5))
                self.register_parameter(f"{side}_{name}", p)
        self.retain_scale = 1.0
        self.forget_scale = 1.0
        self.retain_grad_mask: torch.Tensor | None = None
        self.forget_grad_mask: torch.Tensor | None = None

    def adapter_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(f"{side}_{m}", getattr(self, f"{side}_{m}")) for side in _SIDES for m in MLP_WEIGHTS
                if self.ranks[side]]

    def _core(self, side: str, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, f"{side}_{m}") for m in MLP_WEIGHTS)
        x = x.to(gate.dtype)
        return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_mlp(x)
        for side in _SIDES:
            scale = getattr(self, f"{side}_scale")
            if not self.ranks[side] or scale == 0.0:
                continue
            g = self._core(side, x)
            mask = getattr(self, f"{side}_grad_mask")
            if mask is not None:
                if x.dim() < 2 or x.shape[0] != mask.shape[0]:
                    raise RuntimeError(f"routing mask covers {mask.shape[0]} samples but this MLP's input has shape "
                                       f"{tuple(x.shape)}: the routed batch must go through the model in one call")
                off = 1.0 - mask.to(x.device, g.dtype).reshape(-1, *([1] * (g.dim() - 1)))
                g = g - off * self._core(side, x.detach()) + off * g.detach()
            y = y + (scale * g).to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return (f"retain_neurons={self.ranks['retain']}, forget_neurons={self.ranks['forget']}, "
                f"retain_scale={self.retain_scale}, forget_scale={self.forget_scale}")


def apply_dual_mlp(
    model: nn.Module, retain_neurons: int, forget_neurons: int, layer_start: int = 0, layer_end: int | None = None,
    layer_stride: int = 1,
) -> DualLoRALayout:
    """Freeze ``model`` and wrap the ``.mlp`` of decoder block i (any family, ``models.arch.decoder_blocks``) for i in
    range(layer_start, layer_end, stride). The adapter reads the MLP's input, of width ``config.hidden_size``."""
    layers, end = decoder_layers(model, layer_start, layer_end, layer_stride)
    if any(isinstance(m, DualAdapter) for m in model.modules()):
        raise ValueError("the model already has dual adapters")
    if any(not isinstance(getattr(layers[i], "mlp", None), nn.Module) for i in range(layer_start, end, layer_stride)):
        raise ValueError(f"MLP adapters need an .mlp module in every adapted decoder block; "
                         f"{model.config.model_type} blocks have none")
    model.requires_grad_(False)
    hidden = model.config.hidden_size
    for i in range(layer_start, end, layer_stride):
        layers[i].mlp = DualMLPAdapter(layers[i].mlp, hidden, retain_neurons, forget_neurons)
    return DualLoRALayout(retain_neurons, forget_neurons, 1.0, ("mlp",), layer_start, end, layer_stride, False, "mlp")
