"""The off-policy generator's copy of an FSDP2-sharded policy: whole tensors gathered from the shards.

Under FSDP2 each process holds a slice of every parameter (a ``DTensor``); the generator thread samples with a plain
module, so what it loads must be whole. Gathering is a collective: every process calls `full_parameters` at the same
point (the generator starts at the first training step on every process; the publishes run in every process's
``on_step_end``). ``get_model_state_dict`` with ``full_state_dict=True`` gathers the whole tensors; ``cpu_offload``
stays False because with it only process 0 receives them (torch's ``ranks_only=(0,)``), and every process runs its
own generator. The copy itself is made before the Trainer shards the policy (`template`): a sharded model cannot be
deep-copied into a plain one.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor shard (FSDP2)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def full_parameters(model: nn.Module, trainable_only: bool) -> dict[str, Tensor]:
    """Whole copies of ``model``'s parameters (only those with ``requires_grad`` when ``trainable_only``), by
    parameter name, gathered from the shards of an FSDP2 model (a collective: every process calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    names = [n for n, p in model.named_parameters() if p.requires_grad or not trainable_only]
    options = StateDictOptions(full_state_dict=True, cpu_offload=False, ignore_frozen_params=trainable_only)
    state = get_model_state_dict(model, options=options)
    if missing := [n for n in names if n not in state]:
        raise RuntimeError(f"the gathered state dict lacks parameters {missing[:3]}")
    return {n: state[n].detach().clone() for n in names}


def load_full(copy: nn.Module, state: dict[str, Tensor]) -> None:
    """Every parameter of the plain ``copy`` set from ``state`` (`full_parameters` of the sharded policy)."""
    params = dict(copy.named_parameters())
    if set(params) != set(state):
        raise RuntimeError(f"the generator copy and the policy differ in parameters: "
                           f"{sorted(set(params) ^ set(state))[:5]}")  # fmt: skip
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor.to(params[name].device))
