"""The policy's adapters as one vLLM LoRA adapter (PEFT's file format), so a vLLM engine keeps its base weights and
takes each policy version as an adapter of a few MB instead of the whole merged model (`write_adapter`).

Every adapted linear layer becomes one LoRA block of the engine's rank ``R`` (`stack_blocks`): its adapters' A
matrices stacked (rows), their B matrices side by side (columns), each B multiplied by its own adapter's scale, and
zero rows / columns up to ``R``; the adapter's config says ``r = lora_alpha = R``, so vLLM's scaling is 1 and each
block keeps its own. This is the forward of both adapter kinds exactly:

- PEFT LoRA (``LoraLayer.forward``): ``y = W x + sum_a s_a B_a A_a x`` over the active adapters, ``s_a`` PEFT's
  ``scaling`` (alpha / r, or alpha / sqrt(r) with rsLoRA), so rank and alpha patterns survive too;
- the project's dual LoRA (``trl_ext.routing.adapters.DualLoRALinear``): ``y = W x + [B_r s_r c_r | B_f s_f c_f]
  [A_r; A_f] x``, ``c`` the sides' current ``retain_scale`` / ``forget_scale``: the routing eval's ``retain_only`` is
  the forget block's columns at 0, ``forget_only`` the retain block's (``trl_ext.routing.adapters.ABLATION_SCALES``).

vLLM's LoRA (``vllm.lora.lora_model.LoRAModel.from_local_checkpoint``, vllm 0.30) takes adapters on the linear
layers of the decoder blocks, packed layers (``qkv_proj``, ``gate_up_proj``) included with any subset of their parts.
What it does not take is said by `unservable` and served merged (``trl_ext.vllm.weights``) or refused
(``--vllm_lora_sync``, ``trl_ext.vllm.args``). Under FSDP2 only the adapter tensors are gathered
(``trl_ext.offpolicy.sharded.whole``), one module at a time; the base weights are never read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from trl_ext.offpolicy.sharded import plain_name, whole
from trl_ext.vllm.weights import base_of, unmergeable

ENGINE_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM takes (``vllm.config.lora.MaxLoRARanks``, vllm 0.30)."""
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def engine_rank(rank: int) -> int | None:
    """The smallest ``max_lora_rank`` vLLM takes that holds an adapter of ``rank``; None above the largest."""
    return next((r for r in ENGINE_RANKS if r >= rank), None)


def stack_blocks(blocks: list[tuple[Tensor, Tensor, float]], rank: int) -> tuple[Tensor, Tensor]:
    """(A, B) of one LoRA layer of ``rank`` whose ``B @ A`` is ``sum_i s_i B_i A_i`` over ``blocks`` = [(A_i: (r_i,
    in), B_i: (out, r_i), s_i)]: A rows stacked, scaled B columns side by side, zero-padded to ``rank`` (module
    docstring). ValueError when the blocks hold more than ``rank`` rows or disagree on shapes."""
    if not blocks:
        raise ValueError("no LoRA block to stack")
    total = sum(a.shape[0] for a, _, _ in blocks)
    if total > rank:
        raise ValueError(f"the blocks hold rank {total}, more than the adapter's {rank}")
    a = torch.cat([a.float() for a, _, _ in blocks], 0)
    b = torch.cat([b.float() * s for _, b, s in blocks], 1)
    if b.shape[1] != total:
        raise ValueError(f"A has {total} rows and B {b.shape[1]} columns")
    pad = rank - total
    return (torch.cat([a, a.new_zeros(pad, a.shape[1])], 0), torch.cat([b, b.new_zeros(b.shape[0], pad)], 1))


def _peft_blocks(module: nn.Module) -> list[tuple[Tensor, Tensor, float]]:
    return [(whole(module.lora_A[a].weight), whole(module.lora_B[a].weight), float(module.scaling[a]))
            for a in module.active_adapters if a in module.lora_A]  # fmt: skip


def _dual_blocks(module: nn.Module) -> list[tuple[Tensor, Tensor, float]]:
    """Both sides, a side at scale 0 included (its B columns 0): the adapter's shape is the same in every mode."""
    return [(whole(getattr(module, f"{side}_A")), whole(getattr(module, f"{side}_B")),
             module.scaling[side] * float(getattr(module, f"{side}_scale")))
            for side in ("retain", "forget") if module.ranks[side]]  # fmt: skip


def _adapted(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(base model's module name, layer) of every adapter-wrapped linear layer (PEFT LoRA, dual LoRA)."""
    for raw, module in base_of(model).named_modules():
        if hasattr(module, "lora_A") or type(module).__name__ == "DualLoRALinear":
            yield plain_name(f"{raw}."), module


def adapter_rank(model: nn.Module) -> int:
    """The largest rank an adapted layer of ``model`` holds (its adapters' ranks summed); 0 without adapters."""
    return max((_rank(m) for _, m in _adapted(model)), default=0)


def _rank(module: nn.Module) -> int:
    if hasattr(module, "lora_A"):  # PEFT: the active adapters' A rows (a DTensor's shape is the whole one)
        return sum(module.lora_A[a].weight.shape[0] for a in module.active_adapters if a in module.lora_A)
    return sum(module.ranks.values())  # dual LoRA: retain + forget


def unservable(model: nn.Module) -> str | None:
    """Why ``model``'s adapters cannot be one vLLM LoRA adapter (module docstring), or None: what cannot be merged
    either (``trl_ext.vllm.weights.unmergeable``: MLP adapters, DoRA, a LoRA bias, an embedding's LoRA, PEFT's
    modules_to_save), no adapter at all (a full fine-tune), the output head's LoRA, a Conv1D (fan_in_fan_out)
    layer."""
    reason = unmergeable(model)
    if reason is not None:
        return reason
    head = base_of(model).get_output_embeddings()
    found = False
    for name, module in _adapted(model):
        found = True
        if module is head:
            return f"{name.rstrip('.')} is the output head: vLLM 0.30's LoRA takes no adapter on it"
        if module.fan_in_fan_out:
            return f"{name.rstrip('.')} is a Conv1D layer (fan_in_fan_out): vLLM's LoRA layers are linear"
    return None if found else "the policy has no adapters (a full fine-tune)"


def adapter_tensors(model: nn.Module, rank: int) -> Iterator[tuple[str, Tensor]]:
    """(PEFT name, tensor) of ``model``'s adapters as one LoRA of ``rank`` (`stack_blocks`), at the adapters'
    current scales, one layer at a time (a collective under FSDP2: every process must iterate to the end)."""
    for name, module in _adapted(model):
        blocks = _peft_blocks(module) if hasattr(module, "lora_A") else _dual_blocks(module)
        if not blocks:
            continue
        a, b = stack_blocks(blocks, rank)
        yield f"base_model.model.{name}lora_A.weight", a
        yield f"base_model.model.{name}lora_B.weight", b


def adapter_config(model: nn.Module, rank: int) -> dict:
    """PEFT's ``adapter_config.json`` of the stacked adapter: rank ``rank``, ``lora_alpha = rank`` (scaling 1: each
    block's own scale is in its B columns), the adapted layers' names as targets."""
    targets = sorted({name.rstrip(".").rsplit(".", 1)[-1] for name, _ in _adapted(model)})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "use_rslora": False,
            "use_dora": False, "bias": "none", "lora_dropout": 0.0, "target_modules": targets,
            "base_model_name_or_path": getattr(base_of(model), "name_or_path", "")}  # fmt: skip


@torch.no_grad()
def write_adapter(model: nn.Module, directory: str, writer: bool, rank: int, dtype: torch.dtype | None = None) -> int:
    """``model``'s adapters as one PEFT LoRA adapter of ``rank`` in ``directory`` (`adapter_config`, `WEIGHTS`), the
    tensors in ``dtype`` (None: float32); returns the bytes written (0 where not ``writer``). Every process must call
    it (a collective under FSDP2); processes that are not the ``writer`` only take part."""
    from safetensors.torch import save_file

    reason = unservable(model)
    if reason is not None:
        raise ValueError(reason)
    tensors = {}
    for name, tensor in adapter_tensors(model, rank):
        if writer:
            tensors[name] = tensor.detach().to("cpu", dtype or torch.float32, copy=True).contiguous()
    if not writer:
        return 0
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, WEIGHTS))
    with open(os.path.join(directory, CONFIG), "w") as f:
        json.dump(adapter_config(model, rank), f)
    return sum(t.numel() * t.element_size() for t in tensors.values())


BASE = "base"
"""The directory, beside a publisher's adapter versions, of the base weights the adapters apply to."""


def base_dir_of(directory: str) -> str | None:
    """The base checkpoint of the adapter version in ``directory`` (its sibling `BASE`), or None where
    ``directory`` is not an adapter (a merged checkpoint)."""
    if not os.path.isfile(os.path.join(directory, CONFIG)):
        return None
    return os.path.join(os.path.dirname(os.path.normpath(directory)), BASE)
