"""The policy's weights as the checkpoint a vLLM engine loads: the base model's own state-dict names and layouts,
with every adapter merged at its current scale.

- PEFT LoRA (``peft.tuners.lora.LoraLayer``): ``W + sum_a s_a B_a A_a`` over the active adapters (PEFT's
  ``get_delta_weight``, which transposes for fan_in_fan_out), as TRL's colocate sync merges them.
- The project's dual LoRA (``trl_ext.routing.adapters.DualLoRALinear``): its ``weight`` property, ``W + sum_side
  scale * s * B A`` at the sides' current ``retain_scale`` / ``forget_scale`` (both 1 while training).
- MLP adapters (``DualMLPAdapter``) add neurons a fixed vLLM model cannot hold: refused (`unmergeable`).

Every tensor is a detached contiguous copy (tied weights included: a vLLM reload loads ``lm_head.weight`` apart
from the embedding; skipping it leaves vLLM's head unloaded).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

_PEFT_PREFIXES = ("base_model.model.",)


def base_of(model: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def unmergeable(model: nn.Module) -> str | None:
    """Why ``model``'s adapters cannot be merged into the base model's weights, or None."""
    for name, module in base_of(model).named_modules():
        if type(module).__name__ == "DualMLPAdapter":
            return f"{name} is an MLP adapter (--mlp_config): its neurons cannot merge into the base model's MLP"
        if "modules_to_save" in name:
            return f"{name}: PEFT modules_to_save are not merged for vLLM"
    return None


def _merged(module: nn.Module) -> tuple[Tensor, Tensor | None]:
    """(weight, bias) of a wrapped linear layer with its adapters merged, in the base layer's layout."""
    base = module.base_layer
    if hasattr(module, "get_delta_weight"):  # PEFT LoRA
        weight = base.weight.detach()
        for adapter in module.active_adapters:
            if adapter in module.lora_A:
                weight = weight + module.get_delta_weight(adapter).to(weight.dtype)
        return weight, base.bias
    return module.weight.detach(), module.bias  # DualLoRALinear: the merged weight property


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The base model's state dict (its names) with every adapter merged; ValueError where one cannot be."""
    reason = unmergeable(model)
    if reason is not None:
        raise ValueError(reason)
    base = base_of(model)
    wrapped = {name: m for name, m in base.named_modules() if name and hasattr(m, "base_layer")}
    out: dict[str, Tensor] = {}
    for name, module in wrapped.items():
        weight, bias = _merged(module)
        out[f"{name}.weight"] = weight
        if bias is not None:
            out[f"{name}.bias"] = bias.detach()
    prefixes = tuple(f"{name}." for name in wrapped)
    for key, tensor in base.state_dict().items():
        if not key.startswith(prefixes):
            out[key] = tensor
    return {key: tensor.detach().clone().contiguous() for key, tensor in out.items()}
