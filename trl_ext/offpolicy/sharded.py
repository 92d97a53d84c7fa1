"""Whole tensors of an FSDP2-sharded policy, gathered one parameter at a time.

Under FSDP2 each process holds a slice of every parameter (a ``DTensor``); the generator thread samples with a plain
module and a vLLM engine loads whole tensors, so what they receive must be whole. `iter_whole` gathers the parameters
one after another (``DTensor.full_tensor``: an all-gather per parameter, as TRL's FSDP2 sync to vLLM does), so at most
one whole parameter exists beyond the shards at a time, where ``get_model_state_dict(full_state_dict=True)`` would
hold the whole model at once on every process. Gathering is a collective: every process iterates the same
parameters in the same order at the same point (the generator starts at the first training step on every process;
the publishes run in every process's ``on_step_end``). The plain copy itself is made before the Trainer shards the
policy: a sharded model cannot be deep-copied into a plain one.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
"""Module-name parts that activation-checkpoint and FSDP1 wrappers insert into parameter names (TRL strips the same)."""


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor shard (FSDP2)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def plain_name(name: str) -> str:
    """``name`` without the wrapper parts (`WRAPPER_PREFIXES`): the unsharded module's parameter name."""
    for part in WRAPPER_PREFIXES:
        name = name.replace(part, "")
    return name


def whole(param: Tensor) -> Tensor:
    """A whole detached tensor of ``param``: all-gathered when it is a DTensor shard (a collective: a new tensor on
    every process), else ``param`` itself, detached (not a copy)."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        return param.detach().full_tensor()
    return param.detach()


def iter_whole(model: nn.Module, trainable_only: bool = False) -> Iterator[tuple[str, Tensor]]:
    """(plain name, whole tensor) of every parameter of ``model`` (those with ``requires_grad`` when
    ``trainable_only``), gathered one at a time (`whole`): a consumer that drops each before the next holds at most
    one whole parameter. A collective on a sharded model: every process must iterate to the end."""
    for name, param in model.named_parameters():
        if param.requires_grad or not trainable_only:
            yield plain_name(name), whole(param)


def full_parameters(model: nn.Module, trainable_only: bool) -> dict[str, Tensor]:
    """Whole copies of ``model``'s parameters (only those with ``requires_grad`` when ``trainable_only``), by
    parameter name: the policy's own tensors cloned, a sharded model's gathered (a collective: every process calls
    it). Used for the snapshots the generator loads later, which must outlive the next optimizer step."""
    from torch.distributed.tensor import DTensor

    sharded = {plain_name(n) for n, p in model.named_parameters() if isinstance(p, DTensor)}
    return {n: t if n in sharded else t.clone() for n, t in iter_whole(model, trainable_only)}


def load_full(copy: nn.Module, state: dict[str, Tensor]) -> None:
    """Every parameter of the plain ``copy`` set from ``state`` (`full_parameters` of the sharded policy)."""
    params = dict(copy.named_parameters())
    if set(params) != set(state):
        raise RuntimeError(f"the generator copy and the policy differ in parameters: "
                           f"{sorted(set(params) ^ set(state))[:5]}")  # fmt: skip
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor.to(params[name].device))


def load_streamed(copy: nn.Module, model: nn.Module) -> None:
    """Every parameter of the plain ``copy`` set from the (sharded) ``model``, gathered one parameter at a time
    (`iter_whole`; a collective): at most one whole parameter beyond the two models at once."""
    params = dict(copy.named_parameters())
    names = {plain_name(n) for n, _ in model.named_parameters()}
    if set(params) != names:
        raise RuntimeError(f"the generator copy and the policy differ in parameters: {sorted(set(params) ^ names)[:5]}")
    with torch.no_grad():
        for name, tensor in iter_whole(model):
            params[name].copy_(tensor)
            del tensor
