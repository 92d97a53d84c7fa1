"""A config.yaml reward binding as one callable, whatever it binds, and its adapter for GRPOTrainer.

:class:`BoundReward` is called like a TRL reward function: ``r(completions, **context)``, where ``context`` holds the
other keyword arguments TRL gives (``prompts``, ``completion_ids``, ``trainer_state``, ``log_extra``,
``log_metric``, the dataset columns), as many as the caller has. Called with texts alone (``r(texts)``), it is the
``list[str] -> list[float]`` reward the project's code has always called. What the bound function gets:

- texts style (rewards/signature.py): ``fn(texts)``, the completions as plain texts (``completion_texts``); the
  context is not passed.
- trl style: ``fn(completions=..., **selected)``: the completions as given (TRL's: strings, or message lists for
  conversational data) and the context keys it accepts (all of them with ``**kwargs``). A required argument the
  caller does not have (a dataset column, ``prompts``) raises :class:`RewardInputError` naming it.
- ``combined``: its components, each called with the same completions and context.
- a reward model (``model:``): scored on ``prompts[i] + completions[i]`` (rewards/reward_model.py); needs prompts.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

from .signature import TRL_ARGS, RewardSignature

PROMPT_COLUMNS = ("prompt", "completion", "completion_ids")
"""Dataset columns TRL does not pass to reward functions (GRPOTrainer._calculate_rewards)."""


class RewardInputError(TypeError):
    """A reward function needs an argument (a dataset column, ``prompts``) its caller does not have. A TypeError,
    not a ValueError: the trainer reports ValueErrors of the reward stage as numeric faults."""


class BoundReward:
    """One reward binding (see the module docstring); ``kind`` is "texts", "trl", "combined" or "model"; ``fn`` is
    the bound function (``functools.partial`` with its params; ``functions.combined`` for "combined")."""

    def __init__(self, name: str, kind: str, fn: Callable | None = None, signature: RewardSignature | None = None,
                 bound: dict | None = None, components: tuple = (), model=None):  # fmt: skip
        self.name, self.kind, self.fn, self.signature = name, kind, fn, signature
        self.bound = dict(bound or {})
        self.components = components
        """``combined``: its ``functions.Component`` terms, whose ``fn`` are BoundRewards."""
        self.model = model
        """``model:``: its ``reward_model.RewardModelSpec``."""

    def __repr__(self) -> str:
        return f"BoundReward({self.name!r}, {self.kind})"

    def required_columns(self) -> set[str]:
        """Dataset columns this binding needs (through its components too)."""
        if self.kind == "trl":
            return set(self.signature.columns(self.bound)[0])
        return set().union(*(c.fn.required_columns() for c in self.components)) if self.components else set()

    def column_conflicts(self, columns) -> set[str]:
        """Dataset columns that would also fill a param bound from config.yaml (trl style, components too)."""
        if self.kind == "trl":
            return {c for c in columns if c in self.bound}
        return set().union(*(c.fn.column_conflicts(columns) for c in self.components)) if self.components else set()

    def needs_context(self) -> bool:
        """Whether anything but the completion texts can reach the bound function (trl style, a reward model)."""
        if self.kind == "combined":
            return any(c.fn.needs_context() for c in self.components)
        return self.kind != "texts"

    def __call__(self, completions: Sequence, **context) -> list:
        if self.kind == "texts":
            values = self.fn(completion_texts(completions))
        elif self.kind == "combined":  # each term sees the completions and context as given, not the texts
            terms = tuple(dataclasses.replace(c, fn=functools.partial(_term, c.fn, completions, context))
                          for c in self.components)
            values = self.fn(completion_texts(completions), components=terms)
        elif self.kind == "model":
            if context.get("prompts") is None:
                raise RewardInputError(f"reward model binding {self.name!r} scores prompt + completion: its caller "
                                       "passed no prompts")  # fmt: skip
            values = self.model.score(context["prompts"], completions)
        else:
            values = self.fn(**self._trl_kwargs(completions, context))
        if len(values) != len(completions):
            raise ValueError(f"reward {self.name!r} returned {len(values)} values for {len(completions)} completions")
        return values

    def _trl_kwargs(self, completions: Sequence, context: dict) -> dict:
        sig = self.signature
        clash = sorted(k for k in context if k in self.bound)
        if clash:
            raise RewardInputError(f"reward {self.name!r}: dataset column(s) {', '.join(clash)} would override the "
                                   "params bound in config.yaml; rename the column or the param")  # fmt: skip
        kwargs = {k: v for k, v in context.items() if sig.accepts(k)}
        kwargs["completions"] = completions
        missing = [a for a in sig.required_trl_args if a not in kwargs]
        if missing:
            raise RewardInputError(f"reward {self.name!r} needs {', '.join(missing)}, which its caller does not pass "
                                   f"(it passes: {', '.join(sorted(kwargs))})")  # fmt: skip
        cols = [c for c in sig.columns(self.bound)[0] if c not in kwargs]
        if cols:
            have = sorted(k for k in context if k not in TRL_ARGS)
            raise RewardInputError(f"reward {self.name!r} needs the dataset column(s) {', '.join(cols)}, which the "
                                   f"data does not have (columns: {', '.join(have) or '(none but prompt)'})")
        return kwargs


def _term(fn: Callable, completions: Sequence, context: dict, texts: list[str]) -> list:
    """One ``combined`` term: its BoundReward on the completions and context of the call (``texts`` are theirs)."""
    return fn(completions, **context)


class TrlReward:
    """A bound reward in the form GRPOTrainer's ``reward_funcs`` expects.

    Called as ``f(prompts=..., completions=..., completion_ids=..., **kwargs)``; a :class:`BoundReward` gets all of
    it (and passes a texts-style function the texts alone), any other callable gets the completion texts.
    ``__name__`` is the binding name, which TRL logs as ``rewards/<name>/mean``. None (TRL's "not applicable")
    becomes NaN, as in TRL.
    """

    def __init__(self, name: str, fn: Callable):
        if not callable(fn):
            raise TypeError(f"reward {name!r} must be callable, got {type(fn).__name__}")
        self.__name__ = name
        self.fn = fn

    def __call__(self, *, completions: Sequence, **kwargs) -> list[float]:
        if isinstance(self.fn, BoundReward):
            values = self.fn(completions, **kwargs)
        else:
            values = self.fn(completion_texts(completions))
        if len(values) != len(completions):
            raise ValueError(f"reward {self.__name__!r} returned {len(values)} values for {len(completions)} "
                             "completions")  # fmt: skip
        return [None if v is None else float(v) for v in values]  # None: TRL's "not applicable" (runs.faults)

    def __repr__(self) -> str:
        return f"TrlReward({self.__name__!r})"


def score(fn: Callable, texts: list[str], context: dict | None = None) -> list:
    """``fn`` on a batch whose completion texts are ``texts``: a BoundReward that reads more than texts gets the
    batch's TRL keyword arguments ``context`` (``completions`` as TRL gave them included), else ``fn(texts)``."""
    if isinstance(fn, BoundReward) and fn.needs_context():
        if not context:
            raise RewardInputError(f"reward {fn.name!r} reads more than the completion texts, but this batch has no "
                                   "reward context (prompts, columns)")  # fmt: skip
        ctx = dict(context)
        completions = ctx.pop("completions", texts)
        if len(completions) != len(texts):
            raise RuntimeError(f"the reward context has {len(completions)} completions for {len(texts)} texts")
        return fn(completions, **ctx)
    return fn(texts)


def on_prompts(fn: Callable, prompts: list) -> Callable[[list[str]], list]:
    """``fn`` as a ``texts -> values`` scorer of completions sampled one per prompt, in order: ``texts[i]`` answers
    ``prompts[i]`` (the first ``len(texts)`` prompts). A BoundReward that reads more than texts gets ``prompts=``
    (a reward model, a TRL-style function; a dataset column it needs is still missing); anything else is ``fn``."""
    if not (isinstance(fn, BoundReward) and fn.needs_context()):
        return fn

    def scorer(texts: list[str]) -> list:
        if len(texts) > len(prompts):
            raise ValueError(f"{len(texts)} completions for {len(prompts)} prompts")
        return fn(texts, prompts=list(prompts[: len(texts)]))

    return scorer


def trl_context(inputs: list[dict], prompts: list, completions: list, completion_ids: list, trainer_state) -> dict:
    """The keyword arguments GRPOTrainer._calculate_rewards passes its reward functions (TRL 1.16): every input
    column but prompt / completion / completion_ids, ``trainer_state``, and prompts, completions, completion_ids."""
    keys = [k for k in inputs[0] if k not in PROMPT_COLUMNS] if inputs else []
    return {**{k: [row[k] for row in inputs] for k in keys}, "trainer_state": trainer_state, "prompts": prompts,
            "completions": completions, "completion_ids": completion_ids}  # fmt: skip


def completion_texts(completions: Sequence) -> list[str]:
    """Plain texts of TRL completions: strings as they are; a conversational completion (a list of
    ``{"role", "content"}`` messages) gives its last message's content."""
    if isinstance(completions, str) or not isinstance(completions, Sequence):
        raise TypeError(f"completions must be a list, got {type(completions).__name__}")
    texts = []
    for i, c in enumerate(completions):
        if isinstance(c, list):
            if not c or not isinstance(c[-1], dict) or not isinstance(c[-1].get("content"), str):
                raise TypeError(f"completions[{i}] is a message list whose last message has no string 'content'")
            c = c[-1]["content"]
        elif not isinstance(c, str):
            raise TypeError(f"completions[{i}] must be a string or a list of messages, got {type(c).__name__}")
        texts.append(c)
    return texts
