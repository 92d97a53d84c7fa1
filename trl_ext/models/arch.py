"""A causal LM's structure, read from the model itself or from its config alone: its decoder blocks, the linear
layers of a block, and the LoRA targets (PEFT LoRA and dual LoRA) that follow from them.

``architecture_of(config)`` instantiates the model on the meta device (``with torch.device("meta"):
AutoModelForCausalLM.from_config(config)``: no weights, well under a second), so train.py checks ``--model``'s
targets at parse time, before any weight is loaded.

- Decoder blocks: the ``nn.ModuleList`` of ``config.num_hidden_layers`` identical modules, wherever the family keeps
  it (Llama ``model.layers``, GPT-2 ``transformer.h``, GPT-NeoX ``gpt_neox.layers``); a list whose class is one of
  the model's ``_no_split_modules`` (transformers' name for its decoder block) wins.
- Linear layers: ``nn.Linear`` and transformers' ``pytorch_utils.Conv1D`` (GPT-2's; weight stored [in, out]).
  Fused projections (Phi-3 ``qkv_proj``/``gate_up_proj``, GPT-2 ``c_attn``, GPT-NeoX ``query_key_value``) are one
  linear each and are adapted as such.
- Target names follow PEFT's matching rule (``peft.tuners.tuners_utils.check_target_module_exists``): a name matches a
  module path equal to it or ending in ``"." + name``. Each linear of a block is named by the shortest such suffix of
  its path inside the block that matches it alone (Llama: ``q_proj`` ... ``down_proj``; GPT-2: ``c_attn``,
  ``attn.c_proj``, ``c_fc``, ``mlp.c_proj``). The default targets are every linear of the blocks (for Llama the 7
  projections, as before).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from trl_ext.compat import no_split_modules
from trl_ext.registry import ConfigError

LINEAR_TYPES = (nn.Linear, Conv1D)


def matches(name: str, path: str) -> bool:
    """PEFT's target rule: ``name`` selects the module at ``path`` (equal, or a dotted suffix of it)."""
    return path == name or path.endswith("." + name)


def decoder_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(path, the ModuleList of decoder blocks) of a causal LM; ValueError when there is not exactly one."""
    n = getattr(model.config, "num_hidden_layers", None)
    found = [(path, m) for path, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n
             and len({type(b) for b in m}) == 1]
    named = [(p, m) for p, m in found if type(m[0]).__name__ in no_split_modules(model)]
    found = named or found
    if len(found) != 1:
        raise ValueError(f"{type(model).__name__} ({model.config.model_type}): expected one ModuleList of "
                         f"{n} decoder blocks, found {[p for p, _ in found]}")
    return found[0]


def block_linears(block: nn.Module) -> dict[str, nn.Module]:
    """Every linear layer of a block by its path inside the block, in module order."""
    return {path: m for path, m in block.named_modules() if isinstance(m, LINEAR_TYPES)}


def unique_names(paths: Sequence[str]) -> tuple[str, ...]:
    """Per path, its shortest dotted suffix that matches it and no other path."""
    names = []
    for path in paths:
        parts = path.split(".")
        for k in range(1, len(parts) + 1):
            name = ".".join(parts[-k:])
            if [p for p in paths if matches(name, p)] == [path]:
                names.append(name)
                break
    return tuple(names)


@dataclass(frozen=True)
class LoraTargets:
    """Resolved LoRA targets of a run: module names (PEFT's ``target_modules``) and whether they are Conv1D layers
    (PEFT's ``fan_in_fan_out``: Conv1D stores its weight [in, out])."""

    names: tuple[str, ...]
    fan_in_fan_out: bool

    def peft_kwargs(self) -> dict:
        return {"target_modules": list(self.names), "fan_in_fan_out": self.fan_in_fan_out}


@dataclass(frozen=True)
class Architecture:
    """What the adapters need to know of a causal LM (see the module docstring)."""

    model_type: str
    blocks: str  # path of the decoder blocks' ModuleList
    num_blocks: int
    linears: tuple[tuple[str, str], ...]  # (path inside a block, "Linear" | "Conv1D"), in module order
    outside: tuple[str, ...]  # paths of the linear layers outside the blocks (LM head, ...)
    has_mlp: bool  # every block has an ``.mlp`` submodule (MLP adapters wrap it)
    dropouts: tuple[str, ...] = ()  # paths of the nn.Dropout modules with p > 0 (active in training mode)

    @property
    def default_targets(self) -> tuple[str, ...]:
        """One name per linear layer of a block: every linear is adapted."""
        return unique_names([p for p, _ in self.linears])

    def matched(self, names: Sequence[str]) -> list[str]:
        """Block paths of the linears ``names`` select, in module order."""
        return [p for p, _ in self.linears if any(matches(n, p) for n in names)]

    def resolve(self, names: Sequence[str] | None) -> LoraTargets:
        """The LoRA targets for ``names`` (None = the defaults); ConfigError naming the available names when one
        selects no linear layer of the blocks, or one outside them."""
        names = self.default_targets if names is None else tuple(names)
        available = f"linear layers of a {self.model_type} block: {', '.join(self.default_targets)}"
        if not names or len(set(names)) != len(names):
            raise ConfigError(f"LoRA target modules must be non-empty and distinct, got {list(names)}; {available}")
        for name in names:
            if not any(matches(name, p) for p, _ in self.linears):
                raise ConfigError(f"LoRA target {name!r} names no linear layer of the model; {available}")
            elsewhere = [p for p in self.outside if matches(name, p)]
            if elsewhere:
                raise ConfigError(f"LoRA target {name!r} also selects {', '.join(elsewhere)} outside the decoder "
                                  f"blocks (use a longer name); {available}")
        kinds = {k for p, k in self.linears if p in self.matched(names)}
        if len(kinds) > 1:
            raise ConfigError(f"LoRA targets {list(names)} mix nn.Linear and Conv1D layers: PEFT's fan_in_fan_out is "
                              "one flag for all targets; target one kind")
        return LoraTargets(names, kinds == {"Conv1D"})


def architecture(model: nn.Module) -> Architecture:
    """The structure of ``model`` (real or on the meta device)."""
    path, blocks = decoder_blocks(model)
    inside = {id(m) for m in blocks.modules()}
    linears = tuple((p, "Conv1D" if isinstance(m, Conv1D) else "Linear")
                    for p, m in block_linears(blocks[0]).items())
    outside = tuple(p for p, m in model.named_modules() if isinstance(m, LINEAR_TYPES) and id(m) not in inside)
    has_mlp = all(isinstance(getattr(b, "mlp", None), nn.Module) for b in blocks)
    dropouts = tuple(p for p, m in model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0)
    return Architecture(model.config.model_type, path, len(blocks), linears, outside, has_mlp, dropouts)


def architecture_of(config) -> Architecture:
    """The structure of the model ``config`` describes, built on the meta device (no weights)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return architecture(model)


def model_config(model: str, trust_remote_code: bool = False):
    """The transformers config of ``--model`` without loading (or building) weights: a builtin model's recipe config,
    else ``config.json`` of the path or hub id. ConfigError when it cannot be read."""
    from transformers import AutoConfig

    from trl_ext.models import BUILTIN_MODELS, resolve_model_arg
    from trl_ext.models.builtin import model_config as builtin_config

    model = resolve_model_arg(model)
    if model in BUILTIN_MODELS:
        return builtin_config(vocab_size=64)  # every builtin model is this recipe; the vocabulary size is irrelevant
    try:
        return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the config of --model {model}: {e}") from e
