"""Features as components (trl_ext/components.py, docs/architecture.md): the trainer keeps the only override of each
TRL hook, features hand each other data in the batch and its context (no private trainer attributes, no component
naming another), and a new feature is one module (docs/architecture.md's walk-through, written to a file and imported
as a plugin)."""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
import textwrap
from pathlib import Path

import pytest
from datasets import Dataset

from trl_ext import compat
from trl_ext import components as comp
from trl_ext.trainer import ExtGRPOTrainer

ROOT = Path(__file__).resolve().parents[1]


def test_each_trl_hook_is_overridden_once():
    """In ExtGRPOTrainer's class hierarchy, no two project classes define the same TRL hook (the order of a mixin
    stack would carry meaning); every hook the project overrides is listed in compat.TRL_HOOKS."""
    ours = [c for c in ExtGRPOTrainer.__mro__ if c.__module__.startswith("trl_ext")]
    assert len(ours) == 2  # the trainer and the run lifecycle (shared with SFT mode): no feature mixins
    for name in compat.TRL_HOOKS:
        defining = [c.__qualname__ for c in ours if name in vars(c)]
        assert len(defining) <= 1, f"{name} is overridden by {defining}"
    from trl import GRPOTrainer

    overridden = {n for c in ours for n, v in vars(c).items() if callable(v) and hasattr(GRPOTrainer, n)}
    assert overridden - {"__init__"} <= set(compat.TRL_HOOKS), overridden - set(compat.TRL_HOOKS)


def _code_files():
    for path in sorted((ROOT / "trl_ext").rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), path.read_text()


def test_no_cross_feature_private_attributes():
    """Features talk through the batch dict and its BatchContext: no ``_env_*`` / ``_distill_*`` attributes on the
    trainer, and no component module reaches another component by name (`Components.first` asks them all)."""
    found = []
    for rel, code in _code_files():
        for m in re.finditer(r"\b(self|trainer|t)\._(env|distill|routing|offpolicy|pending|rollout)_\w+", code):
            found.append(f"{rel}: {m.group()}")
        if rel.endswith("component.py") or rel == "trl_ext/trainer.py":
            for m in re.finditer(r"\bcomponents\.(?!first\b|names\b|COMPONENTS\b|Component\b|BatchContext\b|"
                                 r"LossTokens\b|register\b|build\b|load\b|Components\b|py\b)(\w+)", code):
                found.append(f"{rel}: components.{m.group(1)}")
    assert not found, "\n".join(found)


def test_every_component_module_registers_one_component_in_its_stage_order():
    comp.load()
    modules = {cls.__module__ for cls in comp.COMPONENTS.values()}
    assert set(comp.MODULES) <= modules
    orders = [cls.order for cls in comp.COMPONENTS.values()]
    assert len(set(orders)) == len(orders)  # every stage's order is stated, not left to registration order
    stages = {n for n, v in vars(comp.Component).items() if callable(v) and not n.startswith("_")}
    for cls in comp.COMPONENTS.values():  # a stage method keeps the base signature (the trainer calls it so)
        for name in stages & set(vars(cls)):
            base = inspect.signature(getattr(comp.Component, name))
            mine = inspect.signature(getattr(cls, name))
            assert list(mine.parameters) == list(base.parameters), f"{cls.__name__}.{name}{mine} vs {base}"


def _walkthrough_module() -> str:
    """The toy feature of docs/architecture.md's walk-through ("Adding a feature"), as written there."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc[doc.index("## Adding a feature"):]
    return section[section.index("```python\n") + len("```python\n"):section.index("```\n", section.index("```python"))]


TOY = _walkthrough_module()


@pytest.fixture
def toy(tmp_path, monkeypatch):
    path = tmp_path / "toy_feature.py"
    path.write_text(textwrap.dedent(TOY))
    spec = importlib.util.spec_from_file_location("toy_feature", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "toy_feature", module)
    monkeypatch.setattr(comp, "COMPONENTS", dict(comp.COMPONENTS))  # the registration is undone after the test
    spec.loader.exec_module(module)
    return module


def _trainer(builtin_path, tmp_path, **kwargs):
    from trl_ext.config import train_config
    from trl_ext.models import load_tokenizer, prepare_tokenizer

    cfg = train_config(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
                       max_completion_length=8, max_steps=2, learning_rate=1e-3, logging_steps=1, save_strategy="no",
                       report_to=[], bf16=False, use_cpu=True, disable_tqdm=True, seed=0, beta=0.0,
                       gradient_checkpointing=False)  # fmt: skip
    data = Dataset.from_list([{"prompt": p} for p in ["Ben was a quiet owl", "Lily felt"] * 2])
    return ExtGRPOTrainer(model=str(builtin_path), reward_funcs=[lambda completions, **kw: [float(len(c))
                                                                                           for c in completions]],
                          args=cfg, train_dataset=data,
                          processing_class=prepare_tokenizer(load_tokenizer(str(builtin_path))), **kwargs)


def test_a_feature_is_one_module(toy, builtin_path, tmp_path):
    """The walk-through's one module, imported, takes part in the run: its option reaches it, its reward stage
    clips (the logged rewards are at most the clip, and the length reward exceeds it unclipped), its record stage
    logs; nothing else was edited."""
    trainer = _trainer(builtin_path, tmp_path, toy_clip=3.0)
    assert trainer.components.names() == ["routing", "toy_clip"]
    trainer.train()
    logs = [h for h in trainer.state.log_history if "toy/clipped" in h]
    assert len(logs) == 2 and sum(h["toy/clipped"] for h in logs) > 0
    assert all(h["reward"] <= 3.0 + 1e-6 for h in logs)


def test_an_option_of_an_absent_component_is_refused(monkeypatch):
    """A component's option given to a run without that component would be ignored: refused before anything is
    built (here before the routing component would even look at the config)."""

    class Never(comp.Component):
        name, order, options = "never", 98, ("never_opt",)

    from trl_ext.config import train_config

    monkeypatch.setattr(comp, "COMPONENTS", {**comp.COMPONENTS, "never": Never})
    with pytest.raises(ValueError, match="never_opt: never is off in this run"):
        comp.build(None, train_config(output_dir="unused", report_to=[]), {"never_opt": 1})


def test_batch_context_is_fresh_for_every_generation_batch(builtin_path, tmp_path):
    """Stages see a new BatchContext per generation batch (nothing of an earlier batch), and none between them."""
    seen = []

    class Probe(comp.Component):
        name, order = "probe", 99

        def score(self, batch, ctx):
            seen.append(ctx)
            assert "probe" not in ctx.columns and ctx.rewards is not None and len(ctx.rows) == 8

        def record(self, batch, ctx):
            ctx.columns["probe"] = [True] * len(ctx.rows)

    trainer = _trainer(builtin_path, tmp_path)
    trainer.components = comp.Components([*trainer.components, Probe(trainer, {}, {})])
    trainer.train()
    assert len(seen) == 2 and seen[0] is not seen[1] and all("probe" in c.columns for c in seen)
    assert trainer.batch_context is None
