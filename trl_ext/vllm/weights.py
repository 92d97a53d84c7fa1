"""The policy's weights as the checkpoint a vLLM engine loads: the base model's own state-dict names and layouts,
with every adapter merged at its current scale, streamed one module at a time (`merged_weights`).

- PEFT LoRA (``peft.tuners.lora.LoraLayer``): ``W + sum_a s_a B_a A_a`` over the active adapters, transposed for
  fan_in_fan_out (PEFT's ``get_delta_weight``, `lora_delta`), as TRL's colocate sync merges them. DoRA and
  ``lora_bias`` change the merge (a magnitude vector, a bias delta), and an embedding's LoRA keeps its delta in
  ``lora_embedding_A/B``: refused (`unmergeable`).
- The project's dual LoRA (``trl_ext.routing.adapters.DualLoRALinear``): ``W + sum_side scale * s * B A`` at the
  sides' current ``retain_scale`` / ``forget_scale`` (both 1 while training), as its ``weight`` property.
- MLP adapters (``DualMLPAdapter``) add neurons a fixed vLLM model cannot hold: refused.

Under FSDP2 every tensor is gathered from its shards when its module is reached (``trl_ext.offpolicy.sharded``:
an all-gather per parameter, a collective that every process runs in the same order), so a consumer that drops each
tensor before taking the next holds at most one module's whole tensors (its weight, its adapters, the merged
weight) beyond the shards, never the whole model. Tied weights are yielded under both names (a vLLM reload loads
``lm_head.weight`` apart from the embedding).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from trl_ext import compat
from trl_ext.offpolicy.sharded import plain_name, whole


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
        if not hasattr(module, "lora_A"):  # not a PEFT LoRA layer
            continue
        adapters = module.active_adapters
        for flag, what in (("use_dora", "a DoRA adapter (its magnitude vector rescales the merged weight)"),
                           ("lora_bias", "a LoRA bias (lora_bias=True adds a bias delta)")):  # fmt: skip
            if any(getattr(module, flag, {}).get(a, False) for a in adapters):
                return f"{name} is {what}: not merged for vLLM; use plain LoRA"
        if any(a in getattr(module, "lora_embedding_A", {}) for a in adapters):
            return f"{name} is a LoRA on an embedding: not merged for vLLM; target the linear layers"
    return None


def lora_delta(a: Tensor, b: Tensor, scaling: float, fan_in_fan_out: bool) -> Tensor:
    """PEFT LoRA's weight delta ``s B A`` (``LoraLayer.get_delta_weight``), transposed for fan_in_fan_out layers."""
    delta = (b @ a) * scaling
    return delta.t() if fan_in_fan_out else delta


def _merged(module: nn.Module) -> Tensor:
    """The merged weight of a wrapped linear layer from whole tensors (gathered one by one), in the base layout."""
    weight = whole(module.base_layer.weight)
    if hasattr(module, "lora_A"):  # PEFT LoRA
        for adapter in module.active_adapters:
            if adapter in module.lora_A:
                a, b = whole(module.lora_A[adapter].weight), whole(module.lora_B[adapter].weight)
                delta = lora_delta(a, b, module.scaling[adapter], module.fan_in_fan_out)
                weight = weight + delta.to(weight.dtype)
        return weight
    delta = None  # DualLoRALinear (trl_ext.routing.adapters): every side at its current scale
    for side in ("retain", "forget"):
        scale = getattr(module, f"{side}_scale")
        if module.ranks[side] and scale != 0.0:
            a, b = whole(getattr(module, f"{side}_A")), whole(getattr(module, f"{side}_B"))
            d = (b @ a) * (module.scaling[side] * scale)
            delta = d if delta is None else delta + d
    if delta is None:
        return weight
    return weight + (delta.t() if module.fan_in_fan_out else delta).to(weight.dtype)


@torch.no_grad()
def merged_weights(model: nn.Module, adapters: bool = True) -> Iterator[tuple[str, Tensor]]:
    """(base model's state-dict name, whole tensor) with every adapter merged, one module at a time (module
    docstring); ValueError where an adapter cannot be merged. ``adapters`` False: the base weights alone, every
    adapter left out (the base an engine serving the adapters as LoRA holds: ``trl_ext.vllm.lora``). A tensor may be
    the policy's own (unsharded, not wrapped): read it, never write it. A collective under FSDP2: every process must
    iterate to the end."""
    reason = unmergeable(model) if adapters else None
    if reason is not None:
        raise ValueError(reason)
    skip: tuple[str, ...] = ()
    for raw, module in base_of(model).named_modules():
        if skip and raw.startswith(skip):
            continue
        name = plain_name(f"{raw}.") if raw else ""  # "model.layers.0." ...
        if hasattr(module, "base_layer"):  # an adapter-wrapped linear: its merged weight, its base bias
            skip = (f"{raw}.",)
            yield f"{name}weight", _merged(module) if adapters else whole(module.base_layer.weight)
            if module.base_layer.bias is not None:
                yield f"{name}bias", whole(module.base_layer.bias)
            continue
        for pname, param in module.named_parameters(recurse=False):
            yield f"{name}{pname}", whole(param)
        for bname, buf in module.named_buffers(recurse=False):
            if compat.is_persistent_buffer(module, bname):
                yield f"{name}{bname}", whole(buf)

