"""What a reward function accepts, read from its signature (``inspect.signature``).

Two styles, told apart by the signature alone:

- **texts** (the project's): ``f(completions, *, <params>)``: the first parameter is named ``completions``, every
  other one is keyword-only, there is no ``**kwargs`` and no parameter is named like one of TRL's reward
  arguments. It is called with the completions as plain texts, ``f(texts)``.
- **trl** (TRL's ``reward_funcs`` convention, GRPOTrainer._calculate_rewards): anything else that can be called
  with keywords. It is called with keywords only: the TRL arguments it names (``TRL_ARGS``), every dataset column
  it names, and, when it has ``**kwargs``, all of them (TRL's own call passes everything).

Named parameters of a trl-style function that are not TRL arguments are either bound from config.yaml
(``params:``) or read from the dataset columns of the same name; a required one left unbound is a required column.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

TRL_ARGS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments")
"""The keyword arguments TRL 1.16's GRPOTrainer._calculate_rewards gives every reward function besides the dataset
columns (``environments`` only with an ``environment_factory``)."""


@dataclass(frozen=True)
class RewardSignature:
    """What ``fn`` accepts (see the module docstring)."""

    style: str  # "texts" or "trl"
    params: tuple[str, ...]
    """Bindable names (texts: the keyword-only params; trl: named parameters other than TRL arguments)."""
    required: tuple[str, ...]
    """Names among ``params`` without a default (texts: params to bind; trl: to bind or to read as columns)."""
    trl_args: tuple[str, ...]
    """TRL arguments the function names."""
    required_trl_args: tuple[str, ...]
    var_kwargs: bool

    def accepts(self, key: str) -> bool:
        return self.var_kwargs or key in self.params or key in self.trl_args

    def columns(self, bound: dict) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(required, optional) dataset columns once ``bound`` params are bound (trl style only)."""
        free = [p for p in self.params if p not in bound]
        return tuple(p for p in free if p in self.required), tuple(p for p in free if p not in self.required)


def reward_signature(fn: Callable) -> RewardSignature:
    """The :class:`RewardSignature` of ``fn``; TypeError (with the reason) when it cannot be called as a reward."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise TypeError(f"its signature cannot be read ({e})") from None
    ps = list(sig.parameters.values())
    named = [p for p in ps if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    var_kwargs = any(p.kind is p.VAR_KEYWORD for p in ps)
    if ps and ps[0].name == "completions" and ps[0].kind is not ps[0].VAR_KEYWORD and not var_kwargs and all(
        p.kind is p.KEYWORD_ONLY and p.name not in TRL_ARGS for p in ps[1:]
    ):
        kw = ps[1:]
        return RewardSignature("texts", tuple(p.name for p in kw), tuple(p.name for p in kw if p.default is p.empty),
                               (), (), False)  # fmt: skip
    positional_only = [p.name for p in ps if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if positional_only:
        raise TypeError(f"it has positional-only parameters ({', '.join(positional_only)}); TRL calls reward "
                        "functions with keyword arguments")  # fmt: skip
    if not var_kwargs and "completions" not in [p.name for p in named]:
        raise TypeError("it takes no 'completions' (neither named nor through **kwargs)")
    trl = [p for p in named if p.name in TRL_ARGS]
    other = [p for p in named if p.name not in TRL_ARGS]
    return RewardSignature(
        "trl", tuple(p.name for p in other), tuple(p.name for p in other if p.default is p.empty),
        tuple(p.name for p in trl), tuple(p.name for p in trl if p.default is p.empty), var_kwargs,
    )  # fmt: skip


def texts_signature(fn: Callable) -> tuple[list[str], list[str]]:
    """(all, required) keyword-only params of a texts-style ``fn(completions, *, ...)`` (detectors, whose extra
    ``trajectories=`` is a keyword-only param too); TypeError when ``fn`` is not of that form."""
    ps = list(inspect.signature(fn).parameters.values())
    if not ps or ps[0].name != "completions" or any(p.kind is not p.KEYWORD_ONLY for p in ps[1:]):
        raise TypeError(f"{getattr(fn, '__name__', fn)} must have the signature (completions, *, "
                        "<keyword-only params>)")  # fmt: skip
    return [p.name for p in ps[1:]], [p.name for p in ps[1:] if p.default is p.empty]
