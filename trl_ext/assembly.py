"""Run assembly: `resolve` selects a run's parts once (`Assembly`), which check the run and build the trainer's
arguments (`Build`) in order.

Registries, the `Part` protocol and the registering modules (`trl_ext.parts.MODULES`, loaded here): `trl_ext.parts`.
A new prompt source, generation source or feature is a module that registers its part, named in ``MODULES``;
`trl_ext.cli_train` builds by lookup and `trl_ext.launch` asks ``supports``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl_ext.parts import FEATURES, GENERATION_SOURCES, PROMPT_SOURCES, Feature, GenerationSource, Part, PromptSource
from trl_ext.parts import in_order, load
from trl_ext.registry import ConfigError

load()  # every part registered (`trl_ext.parts.MODULES`)


@dataclass
class Build:
    """What the selected parts build the trainer from: the plan, ``--model``'s path and tokenizer, the model the
    trainer gets (the path until a part wraps it) and the trainer's keyword arguments."""

    plan: object  # trl_ext.cli_train.Plan
    model_path: str
    tokenizer: object
    main_process: bool = True
    model: object = None
    kwargs: dict = field(default_factory=dict)

    def __post_init__(self):
        self.model = self.model_path if self.model is None else self.model


@dataclass(frozen=True)
class Assembly:
    """A run's selected parts: one prompt source, its generation sources and its features."""

    prompts: PromptSource
    generation: tuple[GenerationSource, ...]
    features: tuple[Feature, ...]

    @property
    def parts(self) -> list[Part]:
        """The prompt source, then the other selected parts in registration order."""
        return [self.prompts, *in_order((*self.generation, *self.features))]

    def names(self) -> dict[str, list[str]]:
        return {"prompts": [self.prompts.name], "generation": [p.name for p in self.generation],
                "features": [p.name for p in self.features]}  # fmt: skip

    def check_args(self, run, cfg) -> None:
        for part in self.parts:
            part.check_args(run, cfg)

    def check(self, plan) -> None:
        for part in sorted(self.parts, key=lambda p: p.check_stage):  # stable: in order within a stage
            part.check(plan)

    def run_alone(self, plan) -> int | None:
        """The exit code of a selected part that trains by itself (`Part.run`), else None."""
        for part in self.parts:
            code = part.run(plan)
            if code is not None:
                return code
        return None

    def build_prompts(self, build: Build) -> None:
        """The prompt source's train dataset and reward keyword arguments into ``build.kwargs``."""
        build.kwargs["train_dataset"], rewards = self.prompts.build(build)
        build.kwargs.update(rewards)

    def contribute(self, build: Build) -> None:
        for part in self.parts[1:]:
            part.contribute(build)

    def before_train(self, build: Build, trainer) -> None:
        for part in self.parts:
            part.before_train(build, trainer)


def resolve(run, cfg) -> Assembly:
    """The parts a parsed run selects: the one prompt source that claims it (else the fallback, the story prompts),
    every generation source and feature whose `Part.selected` holds."""
    claimed = [s for s in PROMPT_SOURCES.values() if not s.fallback and s.selected(run, cfg)]
    if len(claimed) > 1:
        raise ConfigError(f"prompt sources {' and '.join(s.name for s in claimed)} both claim this run's prompts")
    prompts = claimed[0] if claimed else next(s for s in PROMPT_SOURCES.values() if s.fallback)
    return Assembly(prompts=prompts,
                    generation=tuple(g for g in GENERATION_SOURCES.values() if g.selected(run, cfg)),
                    features=tuple(f for f in FEATURES.values() if f.selected(run, cfg)))  # fmt: skip
