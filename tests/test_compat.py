"""trl_ext.compat: every reach into a dependency's internals still resolves in the installed (pinned) versions, every
TRL hook still has the parameters the project relies on, and the routed reaches live in compat.py only."""

from __future__ import annotations

import ast
import fnmatch
import importlib
import importlib.util
import inspect
import io
import re
import tokenize
from pathlib import Path

import pytest

from trl_ext import compat

ROOT = Path(__file__).resolve().parents[1]


def _import_longest(parts: list[str]):
    """(module, the number of parts it took): the longest importable module prefix of ``parts``."""
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            return importlib.import_module(name), i
        except ModuleNotFoundError as e:
            if e.name is None or not name.startswith(e.name):  # a missing module inside the dependency: an error
                raise
    raise AssertionError(f"no importable module in {'.'.join(parts)}")


def _assigned_on_instances(cls: type, name: str) -> bool:
    """Whether a class of ``cls``'s MRO assigns ``self.<name>`` in its source (or declares it as a field)."""
    assignment = re.compile(rf"\bself\.{re.escape(name)}\s*(:[^=\n]*)?=(?!=)")
    field = re.compile(rf"^\s+{re.escape(name)}\s*:", re.M)
    for c in cls.__mro__:
        if c is object:
            continue
        try:
            src = inspect.getsource(c)
        except (OSError, TypeError):
            continue
        if assignment.search(src) or field.search(src):
            return True
    return False


def resolve(target: str) -> str:
    """How ``target`` (``module.attr...``) resolves: "attribute", or "instance attribute" for a last name that only
    instances of the class have (found in the class's source); AssertionError when it does not resolve."""
    parts = target.split(".")
    obj, i = _import_longest(parts)
    rest = parts[i:]
    for n, name in enumerate(rest):
        if hasattr(obj, name):
            obj = getattr(obj, name)
        elif n == len(rest) - 1 and isinstance(obj, type) and _assigned_on_instances(obj, name):
            return "instance attribute"
        else:
            raise AssertionError(f"{target}: {'.'.join(parts[:i + n])} has no {name!r}")
    return "attribute"


def _cases():
    for reach in compat.REACHES:
        marks = [pytest.mark.vllm] if reach.needs == "vllm" else []  # the vLLM tier, where vLLM is installed
        assert reach.needs in (None, "vllm"), reach
        for target in reach.targets:
            yield pytest.param(reach, target, id=f"{reach.function}:{target}", marks=marks)


@pytest.mark.parametrize(("reach", "target"), list(_cases()))
def test_reach_target_resolves(reach, target):
    assert resolve(target) in ("attribute", "instance attribute"), reach


@pytest.mark.parametrize("target", ["trl.GRPOTrainer._metricz", "argparse.ArgumentParser._actionz",
                                    "accelerate.state.PartialState._shared_statez", "trl.GRPOTrainer.nonexistent.x",
                                    "transformers.core_model_loading.rename_source_keyz"])  # fmt: skip
def test_a_misspelled_target_does_not_resolve(target):
    with pytest.raises(AssertionError):
        resolve(target)


def test_every_reach_is_a_documented_compat_function():
    assert compat.REACHES
    names = [r.function for r in compat.REACHES]
    assert len(names) == len(set(names)), "one entry per function"
    for reach in compat.REACHES:
        assert callable(getattr(compat, reach.function)), reach.function
        assert reach.reason and reach.targets, reach.function
        assert any(f"{dep} {v}" in reach.versions for dep, v in compat.VERSIONS.items()) or "argparse" in reach.versions


def _effective_params(cls: type, name: str) -> list[str]:
    """The parameters (after ``self``) of ``cls.name``, through overrides that only pass ``*args, **kwargs`` on to
    the next class of the MRO (SFTTrainer.training_step)."""
    params = []
    for c in cls.__mro__:
        if name in c.__dict__:
            params = list(inspect.signature(getattr(c, name)).parameters.values())[1:]
            if not all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
                break
    return [p.name for p in params]


def _hook_problems(name: str, hook: compat.Hook) -> list[str]:
    problems = []
    for owner in hook.owners:
        module, cls_name = owner.rsplit(".", 1)
        cls = getattr(importlib.import_module(module), cls_name)
        if getattr(cls, name, None) is None:
            problems.append(f"{owner} has no {name}")
            continue
        params = _effective_params(cls, name)
        if params[: len(hook.params)] != list(hook.params) or set(hook.keywords) - set(params):
            problems.append(f"{owner}.{name}({', '.join(params)}): the project relies on {hook}")
    return problems


@pytest.mark.parametrize("name", sorted(compat.TRL_HOOKS))
def test_trl_hook_has_the_parameters_the_project_relies_on(name):
    assert not _hook_problems(name, compat.TRL_HOOKS[name])


@pytest.mark.vllm
@pytest.mark.parametrize("name", sorted(compat.VLLM_HOOKS))
def test_vllm_hook_has_the_parameters_the_project_relies_on(name):
    assert not _hook_problems(name, compat.VLLM_HOOKS[name])


def test_a_changed_hook_is_caught():
    owners = compat.TRL_HOOKS["_compute_loss"].owners
    assert not _hook_problems("_compute_loss", compat.Hook(owners, ("model", "inputs")))
    assert _hook_problems("_compute_loss", compat.Hook(owners, ("inputs", "model")))
    assert _hook_problems("_compute_loss", compat.Hook(owners, ("model", "inputs"), ("not_a_parameter",)))
    assert _hook_problems("_compute_lozz", compat.Hook(owners))


def test_every_overridden_trl_method_is_a_hook():
    """A project method named like a private (or listed) method of TRL's GRPOTrainer / SFTTrainer overrides it:
    TRL_HOOKS lists it, so that a TRL release that renames it or its parameters fails here."""
    from trl import GRPOTrainer, SFTTrainer

    missing = []
    for path in sorted((ROOT / "trl_ext").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for f in node.body:
                    if (isinstance(f, ast.FunctionDef) and f.name.startswith("_") and not f.name.endswith("__")
                            and (hasattr(GRPOTrainer, f.name) or hasattr(SFTTrainer, f.name))
                            and f.name not in compat.TRL_HOOKS):
                        missing.append(f"{path.relative_to(ROOT)}:{f.lineno} {node.name}.{f.name}")
    assert not missing, missing


# ------------------------------------------------------------------------- the routed reaches live in compat.py
PENDING = ()
"""Files whose reaches are still to be routed through trl_ext.compat (none: keep it empty)."""

ROUTED = {  # code (not comments or docstrings) -> the compat function that does it
    r"\b_shared_state\b": "record_distributed_type",
    r"\._actions\b": "parser_actions",
    r"\._option_string_actions\b": "option_actions",
    r"\b_StoreFalseAction\b": "is_store_false",
    r"\b_no_split_modules\b": "no_split_modules",
    r"\b_tied_weights_keys\b": "tied_weights_keys / rename_tied_weights",
    r"\btransformers\.(core_model_loading|conversion_mapping)\b": "saved_key_renamer",
    r"\._get_output_dir\b": "output_dir_of",
    r"\._metrics\b": "trl_metrics / finish_training_step",
    r"\._logs\b": "trl_logs",
    r"\._step\b": "at_generation_boundary / new_generation_batch_due / finish_training_step",
    r"\._buffered_inputs\b": "new_generation_batch_due / reset_buffered_inputs",
    r"\._current_train_step_time\b": "finish_training_step",
    r"\._tokenizer\b": "trl_tokenizer",
    # TRL's private methods called on another object than self / super() (an override's own call is a hook)
    r"(?<!\bself)(?<!super\(\))(?<!\bGRPOTrainer)\._tokenize_prompts\b": "tokenize_prompts",
    r"(?<!\bself)(?<!super\(\))(?<!\bGRPOTrainer)\._generate_single_turn\b": "generate_single_turn",
    r"(?<!\bself)(?<!super\(\))(?<!\bGRPOTrainer)\._get_per_token_logps_and_entropies\b": "per_token_logps",
    r"\bself\._get_per_token_logps_and_entropies\s*=": "(no instance patch: the components' loss_logps stage)",
    r"__wrapped__": "is_trl_fused_head_forward",
    r"\bvllm_generation\.LLM\b|\bvllm_generation import\b[^\n]*\bLLM\b": "swap_trl_vllm_llm",
    r"\bdriver_worker\b": "colocate_model_runner",
    r"\b_llm_weights_sleeping\b|\bvllm_generation import\b[^\n]*\bempty_cache\b": "wake_colocate_weights",
    r"\._broadcast\(|\._post_send_sync\b": "send_weights",
    r"\._checked_iter\b": "checked_weights",
    r"\._action_groups\b|\._group_actions\b|\._optionals\b": "action_groups / drop_empty_groups",
    r"\b_non_persistent_buffers_set\b": "is_persistent_buffer",
    r"\._get_fsdp_state\b|\._lazy_init\b": "fsdp2_lazy_init",
    r"\._name_or_path\b": "(transformers' public config.name_or_path)",
}


def _code(path: Path) -> str:
    """``path``'s source with comments and docstrings (string statements) blanked, line numbers kept."""
    src = path.read_text()
    lines = src.splitlines()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for i in range(node.lineno - 1, node.end_lineno):
                lines[i] = ""
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            lines[row - 1] = lines[row - 1][:col]
    return "\n".join(lines)


def _project_files():
    for top in ("trl_ext", "rewards", "environments"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel != "trl_ext/compat.py" and not any(fnmatch.fnmatch(rel, p) for p in PENDING):
                yield rel, path


def test_routed_reaches_are_only_in_compat():
    found = []
    for rel, path in _project_files():
        code = _code(path)
        for pattern, function in ROUTED.items():
            for m in re.finditer(pattern, code):
                line = code.count("\n", 0, m.start()) + 1
                found.append(f"{rel}:{line}: {m.group().strip()} (use trl_ext.compat.{function})")
    assert not found, "\n".join(found)


def test_the_reach_scan_sees_code_not_comments(tmp_path):
    path = tmp_path / "m.py"
    path.write_text('"""parser._actions in a docstring."""\nx = 1  # parser._actions in a comment\n'
                    "y = parser._actions\n")  # fmt: skip
    code = _code(path)
    assert [code.count("\n", 0, m.start()) + 1 for m in re.finditer(r"\._actions\b", code)] == [3]
    calls = "trainer._tokenize_prompts(p)\nself._tokenize_prompts(p)\nsuper()._tokenize_prompts(p)\n"
    pattern = next(p for p in ROUTED if "_tokenize_prompts" in p)
    assert [m.start() for m in re.finditer(pattern, calls)] == [len("trainer")]


def test_importing_compat_is_light():
    import subprocess
    import sys

    code = ("import sys, trl_ext.compat; heavy = [m for m in ('trl', 'vllm', 'transformers', 'accelerate', 'torch') "
            "if m in sys.modules]; print(heavy)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ------------------------------------------------------------------------- what the functions do
def test_argparse_reaches():
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--lr", "--learning_rate", dest="learning_rate", type=float)
    p.add_argument("--no_bf16", dest="bf16", action="store_false")
    assert [a.dest for a in compat.parser_actions(p)] == ["help", "learning_rate", "bf16"]
    actions = compat.option_actions(p)
    assert actions["--lr"] is actions["--learning_rate"] and actions["--lr"].dest == "learning_rate"
    assert compat.is_store_false(actions["--no_bf16"]) and not compat.is_store_false(actions["--lr"])


def test_trl_step_bookkeeping():
    from collections import defaultdict
    from types import SimpleNamespace

    trainer = SimpleNamespace(_step=0, _buffered_inputs=None, _current_train_step_time=0.0, num_iterations=1,
                              current_gradient_accumulation_steps=2, args=SimpleNamespace(steps_per_generation=2),
                              _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
                              model=SimpleNamespace(training=True))  # fmt: skip
    assert compat.new_generation_batch_due(trainer)  # no buffer yet
    trainer._buffered_inputs = ["batch"]
    due = []
    for _ in range(4):
        due.append(compat.new_generation_batch_due(trainer))
        compat.finish_training_step(trainer, started_at=0.0)
    assert due == [True, False, True, False] and trainer._step == 4
    assert len(compat.trl_metrics(trainer)["step_time"]) == 2 and trainer._current_train_step_time == 0.0
    compat.reset_buffered_inputs(trainer)
    assert trainer._buffered_inputs is None and compat.trl_metrics(trainer, "eval") == {}


def test_trl_fused_head_forward_is_recognised():
    import functools
    import types

    from torch import nn

    module = nn.Linear(2, 2)

    @functools.wraps(type(module).forward)  # as trl.trainer.utils.add_fused_lm_head wraps it
    def fused(self, *args, **kwargs):
        return type(module).forward(self, *args, **kwargs)

    assert compat.is_trl_fused_head_forward(module, types.MethodType(fused, module))
    assert not compat.is_trl_fused_head_forward(module, types.MethodType(lambda self, x: x, module))


@pytest.mark.vllm
def test_swap_trl_vllm_llm_restores_the_class():
    from trl.generation import vllm_generation

    original = vllm_generation.LLM
    with compat.swap_trl_vllm_llm(lambda llm: ("built by", llm)) as llm:
        assert llm is original and vllm_generation.LLM == ("built by", original)
    assert vllm_generation.LLM is original


def test_record_distributed_type_is_seen_by_new_partial_states():
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    shared, missing = PartialState._shared_state, object()
    before = shared.get("distributed_type", missing)
    try:
        compat.record_distributed_type(DistributedType.FSDP)
        assert PartialState._shared_state["distributed_type"] == DistributedType.FSDP
    finally:
        if before is missing:
            shared.pop("distributed_type", None)
        else:
            shared["distributed_type"] = before
