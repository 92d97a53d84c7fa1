"""Saving and loading dual adapter checkpoints: full or adapter-only (small-rl's --save_adapter_only), the frozen
base model's fingerprint, and rebuilding a layout's adapters on a model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from trl_ext.routing.adapter_layout import ADAPTER_FILENAME, LAYOUT_FILENAME, DualLoRALayout, _read_layout, load_layout
from trl_ext.routing.adapters import DualAdapter, apply_dual_lora
from trl_ext.routing.mlp import apply_dual_mlp


def apply_layout(model: nn.Module, layout: DualLoRALayout) -> DualLoRALayout:
    """Put the layout's dual adapters (LoRA or MLP) into ``model``; returns the layout as applied."""
    if layout.adapter_type == "mlp":
        return apply_dual_mlp(model, layout.retain_rank, layout.forget_rank, layout.layer_start, layout.layer_end,
                              layout.layer_stride)
    if layout.adapter_type != "lora":
        raise ValueError(f"unknown adapter_type {layout.adapter_type!r} in a dual adapter layout")
    return apply_dual_lora(model, layout.retain_rank, layout.forget_rank, layout.alpha, layout.layer_start,
                           layout.layer_end, layout.layer_stride, layout.targets, layout.include_lm_head)


def saved_to_model_keys(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` as ``save_pretrained`` wrote it, keyed by ``model``'s parameter names: transformers 5 saves some
    families under their hub names (GPT-NeoX's ``lm_head`` as ``embed_out``: the reverse of its checkpoint conversion
    mapping) and renames them back in ``from_pretrained`` (`trl_ext.compat.saved_key_renamer`), as here. A key
    that needs a tensor conversion (not a renaming) raises."""
    from trl_ext.compat import saved_key_renamer

    rename = saved_key_renamer(model)
    out = {}
    for key, tensor in state.items():
        renamed, converter = rename(key)
        if converter is not None:
            raise ValueError(f"checkpoint key {key!r} needs transformers' weight conversion {converter!r}: dual "
                             "adapter checkpoints of this family cannot be reloaded")
        out[renamed] = tensor
    return out


def base_fingerprint(model: nn.Module) -> list[float]:
    """(sum, sum of squares) over the frozen base weights in float64: tells a changed base model apart."""
    adapters = {id(p) for m in model.modules() if isinstance(m, DualAdapter) for _, p in m.adapter_named_parameters()}
    s = q = 0.0
    for _, p in sorted(model.named_parameters(remove_duplicate=True)):
        if id(p) not in adapters:
            s, q = s + p.detach().double().sum().item(), q + p.detach().double().square().sum().item()
    return [s, q]


def adapter_state(model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The adapter weights of a dual adapter model, by state-dict key (what an adapter-only checkpoint holds): read
    from ``model``, or taken from ``state_dict``, a full state dict of it (under FSDP2 the Trainer gathers one from
    the shards; the model's own parameters are shards then)."""
    keys = [f"{name}.{local}" for name, m in model.named_modules() if isinstance(m, DualAdapter)
            for local, _ in m.adapter_named_parameters()]  # fmt: skip
    if state_dict is None:
        state_dict = {k: p for k, p in model.named_parameters(remove_duplicate=False)}
    if missing := [k for k in keys if k not in state_dict]:
        raise KeyError(f"the state dict has no adapter weights {missing[:3]}")
    return {k: state_dict[k].detach().cpu().contiguous() for k in keys}


def load_dual_lora_checkpoint(ckpt_dir: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A checkpoint saved with ``dual_lora_layout.json``, full or adapter-only. Full: the base model built from
    its config.json, the saved layout applied, then its weights (every key must load; a tied head's shared base
    weight is the one allowed alias). Adapter-only (``dual_lora_adapter.safetensors``): the base model from the
    path the layout names (its weights must match the saved fingerprint), the layout applied, then exactly the
    adapter weights. ``load_layout(ckpt_dir)[1]`` gives the routing mode it was trained with."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    ckpt = Path(ckpt_dir)
    layout, _ = load_layout(ckpt)
    base = _read_layout(ckpt).get("base_model")
    if (ckpt / ADAPTER_FILENAME).is_file() != (base is not None):
        raise ValueError(f"{ckpt}: {ADAPTER_FILENAME} and the layout's base_model must come together")
    if base is not None:
        model = AutoModelForCausalLM.from_pretrained(base["path"], dtype=dtype)
        got = base_fingerprint(model)
        if not all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9) for a, b in zip(got, base["fingerprint"])):
            raise ValueError(f"{ckpt}: the base model at {base['path']} is not the one the adapters were trained "
                             f"on (weight fingerprint {got} != {base['fingerprint']})")
        apply_layout(model, layout)
        state = load_file(ckpt / ADAPTER_FILENAME)
        expected = adapter_state(model)
        if set(state) != set(expected):
            raise ValueError(f"{ckpt}: adapter weights do not match the layout: missing "
                             f"{sorted(set(expected) - set(state))}, unexpected {sorted(set(state) - set(expected))}")
        model.load_state_dict(state, strict=False)
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt), dtype=dtype)
        apply_layout(model, layout)
        index = ckpt / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [
            "model.safetensors"]
        state = {}
        for name in files:
            state.update(load_file(ckpt / name))
        state = saved_to_model_keys(model, state)
        missing, unexpected = model.load_state_dict(state, strict=False)
        params = dict(model.named_parameters(remove_duplicate=False))
        aliases = {k for k in missing if any(params.get(k) is params.get(j) for j in state if j in params)}
        if unexpected or set(missing) - aliases:
            raise ValueError(f"{ckpt} does not match its {LAYOUT_FILENAME}: missing {sorted(set(missing) - aliases)}, "
                             f"unexpected {sorted(unexpected)}")
    if (ckpt / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(ckpt)
    return model.eval()
