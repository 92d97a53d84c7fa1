"""Features as components of `ExtGRPOTrainer` (``trl_ext/trainer.py``): the one interface every feature implements.

A component is one feature's part of the trainer (environments, the fast sampler, vLLM, off-policy rollouts,
gradient routing, distillation, saved rollouts, token records). It is an object with named stage methods; the
trainer keeps the only override of each TRL hook and calls, in each hook, that stage of every component of the run,
in `COMPONENTS`' order (the ``order`` of each class). Every stage defaults to "nothing to do", so a component
implements only the stages it takes part in. Components never call each other: what one stage hands a later one
travels in the batch dict or in the generation batch's `trl_ext.batch.BatchContext` (made fresh for every generation
batch); ``trl_ext/batch.py`` is the schema of both and checks them every batch.

Lifecycle: built before TRL's ``__init__`` (``__init__`` may check and edit TRL's keyword arguments; its own keyword
arguments, `Component.options`, are taken out of them), `building` wraps TRL's ``__init__``, `setup` runs on the
built trainer, `callbacks` are added to it (start, per-step work and evals run as HF ``TrainerCallback``s), `close`
runs when ``train`` returns or raises; `state` / `load_state` ride in every checkpoint.

Adding a feature is one module: a `Component` subclass registered with `register` (its module imported before the
trainer is built: a plugin, a test, or `MODULES` for the project's own), see ``docs/architecture.md``.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import ClassVar

import torch

from trl_ext.batch import BatchContext

MODULES = (
    "trl_ext.env.component",
    "trl_ext.generation.component",
    "trl_ext.offpolicy.component",
    "trl_ext.vllm.component",
    "trl_ext.routing.component",
    "trl_ext.distill.component",
    "trl_ext.runs.component",
)
"""The project's component modules (each registers its class with `register`)."""

COMPONENTS: dict[str, type[Component]] = {}
"""Registered component classes by name; the trainer asks them in ``order``."""


@dataclass
class LossTokens:
    """The per-token facts of one loss call, for the stages that record them."""

    logps: torch.Tensor
    """The trainer's log-probs ``[B, C]`` of the loss's forward (detached)."""
    masks: dict | None = None
    """The importance-sampling loss's masks (`trl_ext.offpolicy.importance.importance_loss`); None: TRL's loss."""
    ratio_type: str | None = None
    """The importance-sampling ratio type of `masks`."""


class Component:
    """One feature's part of the trainer; every stage defaults to "nothing to do" (module docstring)."""

    name: ClassVar[str] = ""
    order: ClassVar[int] = 0
    """Position among the components in every stage (smaller first)."""
    options: ClassVar[tuple[str, ...]] = ()
    """ExtGRPOTrainer keyword arguments this component takes (taken out of TRL's)."""

    @classmethod
    def wanted(cls, cfg, kwargs: dict) -> bool:
        """Whether a run with config ``cfg`` and trainer keyword arguments ``kwargs`` has this component."""
        return False

    def __init__(self, trainer, kwargs: dict, options: dict) -> None:
        """Before TRL's ``__init__``: check and edit TRL's keyword arguments ``kwargs``; ``options`` are this
        component's own. ``trainer`` is not built yet: keep it for later stages."""
        self.trainer = trainer

    # ------------------------------------------------------------------ lifecycle
    def building(self, kwargs: dict) -> AbstractContextManager:
        """A context around TRL's ``__init__`` (``kwargs``: its keyword arguments, final)."""
        return nullcontext()

    def setup(self) -> None:
        """On the built trainer (every process)."""

    def callbacks(self) -> list:
        """HF ``TrainerCallback``s the trainer adds."""
        return []

    def close(self) -> None:
        """When ``train`` returns or raises."""

    def state(self) -> dict:
        """JSON state saved with every checkpoint (under the component's name)."""
        return {}

    def load_state(self, state: dict) -> None:
        """Restore what `state` saved (resume)."""

    # ------------------------------------------------------------------ 1. rollout source
    def generation_rows(self, rows: list[dict]) -> list[dict] | None:
        """``_prepare_inputs`` of a new generation batch: the rows to build it from instead of TRL's (off-policy:
        the generator's batch), or None."""
        return None

    def generate(self, prompts: list, ctx: BatchContext) -> dict | None:
        """``_generate``: completions made elsewhere, as TRL's ``rollout_func`` output, or None (TRL generates)."""
        return None

    def generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images):
        """``_generate_single_turn``: ``(completion_ids, logprobs)`` from this component's sampler, or None."""
        return None

    def generator_transport(self, policy):
        """The off-policy generator's sampler and how each version reaches it (`trl_ext.transport.Transport`), when
        this component provides one (vLLM), else None (the generator samples with its own copy)."""
        return None

    def adapter_eval_sampler(self):
        """A sampler of the routing eval's modes as LoRA adapters on the run's vLLM engine
        (``trl_ext.vllm.eval_sampler.AdapterEvalSampler``) when this component provides one, else None (the eval
        samples with transformers)."""
        return None

    # ------------------------------------------------------------------ 2. rewards
    def skips_rewards(self) -> bool:
        """Whether no reward function is called (pure distillation)."""
        return False

    def rewards(self, ctx: BatchContext, rewards: torch.Tensor, prompts: list, completions: list) -> torch.Tensor:
        """The gathered rewards ``[N, F]``, possibly replaced (routing's base reward)."""
        return rewards

    def rewards_done(self, ctx: BatchContext) -> None:
        """After the rewards are checked finite (``ctx.rewards`` set)."""

    def needs_every_reward(self) -> str | None:
        """Why this component needs a reward for every completion (a None reward is then an error), or None."""
        return None

    # ------------------------------------------------------------------ 3. scorers, 4. estimator, 5. records
    def score(self, batch: dict, ctx: BatchContext) -> None:
        """Add this component's keys to the batch dict and its batch-wide values to ``ctx``."""

    def estimated(self, batch: dict, ctx: BatchContext) -> None:
        """After the estimator wrote the advantages."""

    def record(self, batch: dict, ctx: BatchContext) -> None:
        """Records: logs, saved rollouts, token records."""

    def batch_keys(self, ctx: BatchContext) -> dict[str, bool]:
        """`trl_ext.batch.BatchFeatures` fields this component decides for the batch of ``ctx``."""
        return {}

    # ------------------------------------------------------------------ loss and backward (per micro-batch)
    def loss(self, model, inputs: dict) -> tuple[torch.Tensor, LossTokens] | None:
        """The loss instead of TRL's, with its per-token facts, or None."""
        return None

    def around_loss(self, inputs: dict) -> AbstractContextManager:
        """A context around the micro-batch's loss (TRL's or a component's)."""
        return nullcontext()

    def loss_logps(self, inputs: dict, logps: torch.Tensor) -> None:
        """Right after the loss's own log-prob forward (``logps`` [B, C]); may edit ``inputs``."""

    def loss_tokens(self, inputs: dict, tokens: LossTokens) -> None:
        """After the micro-batch's loss: its per-token facts (token records)."""

    def backward(self, model, inputs: dict, num_items_in_batch) -> torch.Tensor | None:
        """The whole ``training_step`` (forward and backward) instead of TRL's, or None."""
        return None

    def step_done(self) -> None:
        """After every ``training_step``."""

    # ------------------------------------------------------------------ saving
    def create_optimizer(self, model):
        """The optimizer instead of TRL's, or None."""
        return None

    def save(self, output_dir: str, state_dict) -> bool:
        """Save the model instead of TRL's ``_save`` (True), or False."""
        return False

    def saved(self, output_dir: str) -> None:
        """After the model was saved to ``output_dir``."""


def register(cls: type[Component]) -> type[Component]:
    """Class decorator: register a component (its ``name`` unique)."""
    if not cls.name or cls.name in COMPONENTS:
        raise ValueError(f"component {cls.name!r}: a name is required and must be unique")
    COMPONENTS[cls.name] = cls
    return cls


def load() -> None:
    """Import the project's component modules (`MODULES`)."""
    for module in MODULES:
        importlib.import_module(module)


class Components:
    """The components of one trainer, in order; each also by name (``trainer.components.routing``: None when the
    run does not have it)."""

    def __init__(self, items: list[Component]) -> None:
        self._items = items
        self._by_name = {c.name: c for c in items}

    def __iter__(self) -> Iterator[Component]:
        return iter(self._items)

    def __getattr__(self, name: str) -> Component | None:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in COMPONENTS:
            raise AttributeError(f"no component named {name!r}; registered: {', '.join(sorted(COMPONENTS))}")
        return self._by_name.get(name)

    def names(self) -> list[str]:
        return [c.name for c in self._items]

    def first(self, stage: str, *args, **kwargs):
        """The first non-None answer of ``stage`` over the components, or None."""
        for c in self._items:
            out = getattr(c, stage)(*args, **kwargs)
            if out is not None:
                return out
        return None


def build(trainer, cfg, kwargs: dict) -> Components:
    """The run's components (`load`ed, ``wanted``), each built with its options taken out of ``kwargs``; an option
    given for a component the run does not have is an error (it would be ignored)."""
    load()
    classes = sorted(COMPONENTS.values(), key=lambda c: c.order)
    chosen = [c for c in classes if c.wanted(cfg, kwargs)]
    options = {c.name: {k: kwargs.pop(k) for k in c.options if k in kwargs} for c in classes}
    for c in classes:
        if c not in chosen and (given := [k for k, v in options[c.name].items() if v is not None]):
            raise ValueError(f"{', '.join(given)}: {c.name} is off in this run (the argument would be ignored)")
    return Components([c(trainer, kwargs, options[c.name]) for c in chosen])
