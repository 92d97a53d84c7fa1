"""The registries a train.py run is assembled from, one per kind (verl's style): where the prompts come from
(`PROMPT_SOURCES`), what samples the completions (`GENERATION_SOURCES`) and the features (`FEATURES`).

A part is how train.py assembles a feature (its flags, checks and refusals, and the trainer keyword arguments it
builds); what the feature then does inside the trainer is its component (`trl_ext.components`). Part classes are
named ``<Feature>Part``. Each entry is a `Part`, registered by its own subpackage's module
(``trl_ext/routing/register.py``, ``trl_ext/env/register.py`` ...; `MODULES` lists them, in the order their parts are
asked in). A part declares

- when it is selected (`Part.selected`: a predicate on the parsed RunArgs / ExtGRPOConfig) and the flags that
  engage it (`Part.flags`, read by `Part.flag`);
- what it refuses (`Part.supports(launch) -> None | reason`; `trl_ext.launch.refusals.Launch`: processes and
  sharding), asked while the flags parse, of every part that one of the run's flags engages (the refusal names
  that flag; `trl_ext.launch.refusals.check_launch`);
- its parse-time checks (`Part.check_args` on the flags alone, `Part.check` with the reward config, the data and
  ``--model``'s config), raising `ConfigError`;
- how it builds its part of the trainer (a prompt source's `PromptSource.build`; `Part.contribute`,
  `Part.before_train`; `Part.run` for a part that trains by itself).

Adding a prompt source, a generation source or a feature is one module that registers it, named in `MODULES` (or
imported by a plugin before train.py parses); train.py (`trl_ext.cli_train`, `trl_ext.assembly`) and
`trl_ext.launch` are not edited. The modules are loaded by name (`load`): this module, which `trl_ext.launch` reads,
imports no feature.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools

from trl_ext.registry import Registry

_ORDER = itertools.count()


def _plain(value) -> object:
    return value.value if hasattr(value, "value") else value  # TrainingArguments' str enums (eval_strategy)


class Part:
    """One registered piece of a run; every hook defaults to "nothing to do", every launch is supported."""

    name: str = ""  # its registered name (set by `Parts.add`)
    what: str = ""  # how its refusals name it, e.g. "gradient routing / dual LoRA"
    flags: tuple[str, ...] | type = ()  # fields that engage it (launch checks): names, or a flag dataclass (all)
    order: int = -1  # registration order across the registries (set by `Parts.add`; see `in_order`)
    check_stage: int = 0  # `check`s run by stage, each stage in order (1: after the generation sources' checks)

    def flag(self, args) -> tuple[str, object] | None:
        """(field, value) of the first of `flags` that ``args`` (a RunArgs or an ExtGRPOConfig) sets away from its
        default, else None; fields ``args`` lacks (the other dataclass's) are skipped."""
        if not dataclasses.is_dataclass(args):
            return None
        fields = {f.name: f for f in dataclasses.fields(args)}
        for name in self.flag_names():
            f = fields.get(name)
            if f is None or not f.init or f.default is dataclasses.MISSING:
                continue
            value = _plain(getattr(args, name))
            if value != _plain(f.default):
                return name, value
        return None

    def flag_names(self) -> list[str]:
        """The names of `flags`."""
        return [f.name for f in dataclasses.fields(self.flags)] if isinstance(self.flags, type) else list(self.flags)

    def selected(self, run, cfg) -> bool:
        """Whether the run uses it (default: one of its flags is set)."""
        return self.flag(run) is not None or self.flag(cfg) is not None

    def supports(self, launch) -> str | None:
        """Why it cannot run under ``launch`` (`trl_ext.launch.refusals.Launch`), or None."""
        return None

    def check_args(self, run, cfg) -> None:
        """Parse-time checks on the flags alone (ConfigError)."""

    def check(self, plan) -> None:
        """Parse-time checks with ``plan``'s reward config and data, and ``--model``'s config (ConfigError)."""

    def contribute(self, build) -> None:
        """Its trainer keyword arguments into ``build.kwargs`` (or a wrapped ``build.model``)."""

    def before_train(self, build, trainer) -> None:
        """Work on the built trainer before training (called on every process)."""

    def run(self, plan) -> int | None:
        """The exit code of a part that trains by itself instead of GRPO (SFT mode); None: GRPO trains."""
        return None


class PromptSource(Part):
    """Where the training prompts come from and which reward functions score them."""

    fallback = False  # the source of a run that no other source selects (the story prompts)

    def build(self, build) -> tuple[object, dict]:
        """(train dataset, GRPOTrainer's reward keyword arguments: ``reward_funcs`` ...)."""
        raise NotImplementedError

    def naming(self, run, cfg) -> tuple[list[str], object]:
        """(argv of the default run the run name is compared with, the RunArgs the name reads)."""
        return ["--reward", run.reward], run


class GenerationSource(Part):
    """What samples the completions: TRL's generation, the fast sampler, a vLLM engine, the off-policy generator."""


class Feature(Part):
    """A trainer extension or a run option."""


class Parts(Registry):
    """A registry of `Part` instances; `add` names the part and records its registration order."""

    def add(self, name: str, obj: Part) -> Part:
        super().add(name, obj)
        obj.name, obj.order = name, next(_ORDER)
        return obj


PROMPT_SOURCES = Parts("prompt source")
GENERATION_SOURCES = Parts("generation source")
FEATURES = Parts("feature")
REGISTRIES = (PROMPT_SOURCES, GENERATION_SOURCES, FEATURES)


MODULES = (
    "trl_ext.routing.register",  # routing (the RH detector, in every run)
    "trl_ext.models.register",  # lora, rebuild_builtin
    "trl_ext.distill.register",  # distill
    "trl_ext.offpolicy.register",  # offpolicy; generation: offpolicy (the generator thread)
    "trl_ext.env.register",  # prompts: env; env, sft
    "trl_ext.runs.register",  # saved_rollouts
    "trl_ext.data.register",  # prompts: stories (the default), dataset; eval_loop
    "trl_ext.generation.register",  # generation: fast, trl, continuous_batching
    "trl_ext.vllm.register",  # generation: vllm
    "trl_ext.serve.register",  # serve (policy and teacher servers)
)
"""The registering modules, in the order their parts are asked in (launch refusals, checks, building)."""


def load() -> None:
    """Register every part: import `MODULES` (cached after the first call)."""
    for module in MODULES:
        importlib.import_module(module)


def in_order(parts) -> list[Part]:
    """``parts`` in the order they are asked in: their modules' order in `MODULES` (whatever imported a module
    first), then registration order; parts registered elsewhere (a plugin, a test) after those."""
    rank = {module: i for i, module in enumerate(MODULES)}
    return sorted(parts, key=lambda p: (rank.get(type(p).__module__, len(rank)), p.order))


def registered() -> list[Part]:
    """Every registered part, in order (`in_order`)."""
    load()
    return in_order(part for registry in REGISTRIES for part in registry.values())
