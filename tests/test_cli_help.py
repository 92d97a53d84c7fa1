"""Every CLI's --help: exits 0, lists every project flag with its default, train.py's grouped by feature."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trl_ext.cli_help import TRL_GROUP, declaring_class, group_title

ROOT = Path(__file__).resolve().parents[1]


def run_help(script: str) -> str:
    env = {**os.environ, "COLUMNS": "10000"}  # no wrapping: one flag's help stays on its lines
    proc = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"usage: {script}"), proc.stdout[:200]
    return proc.stdout


def sections(help_text: str) -> dict[str, dict[str, str]]:
    """{group title: {flag: the help text of that flag}} parsed from argparse's output."""
    out: dict[str, dict[str, str]] = {}
    group, flag = None, None
    for line in help_text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            group, flag = line[:-1], None
            out[group] = {}
        elif group is not None and re.match(r"^  --?\w", line):
            flag = re.match(r"^  (--?[\w-]+)", line).group(1)
            out[group][flag] = line
        elif group is not None and flag is not None:
            out[group][flag] += " " + line.strip()
    return out


def project_fields(cls) -> list[dataclasses.Field]:
    """The init fields of ``cls`` that the project declares (not TRL's or transformers')."""
    return [f for f in dataclasses.fields(cls) if f.init and "_argument_group_name" in
            declaring_class(cls, f.name).__dict__]  # fmt: skip


def shown_default(default) -> str:
    return str(default.value if hasattr(default, "value") else default)


TRAIN_HELP = pytest.mark.xdist_group("train_help")  # the tests reading `train_help` share one worker and its run


@pytest.fixture(scope="module")
def train_help() -> dict[str, dict[str, str]]:
    return sections(run_help("train.py"))


@TRAIN_HELP
def test_train_help_lists_every_project_flag_with_its_default_in_its_feature_group(train_help):
    from trl_ext.config import ExtGRPOConfig, RunArgs

    checked = 0
    for cls in (RunArgs, ExtGRPOConfig):
        for f in project_fields(cls):
            title = group_title(declaring_class(cls, f.name))
            assert title in train_help, f"no --help group {title!r}"
            text = train_help[title].get(f"--{f.name}")
            assert text is not None, f"--{f.name} is not in the --help group {title!r}"
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            assert f"(default: {shown_default(default)})" in text, (f.name, text)
            checked += 1
    assert checked > 80  # every feature's flags, not a handful


@TRAIN_HELP
def test_train_help_groups_trl_fields_apart_and_shows_project_defaults(train_help):
    from trl_ext.config import ExtGRPOConfig

    trl = train_help[TRL_GROUP]
    assert "--per_device_train_batch_size" in trl and "--gradient_accumulation_steps" in trl
    assert "(default: 0.02)" in trl["--beta"]  # the project's default of a TRL field, stated
    assert "--gradient_routing" not in trl and "--max_async_level" not in trl
    feature_groups = [t for t in train_help if t not in (TRL_GROUP, "options")]
    assert len(feature_groups) == 10, feature_groups  # run, 8 feature subpackages, monitoring
    assert list(train_help)[-1] == TRL_GROUP
    assert f"--{dataclasses.fields(ExtGRPOConfig)[0].name}" in "".join(" ".join(g) for g in train_help.values())


@TRAIN_HELP
def test_train_help_keeps_a_percent_sign_of_a_help_string(train_help):
    """A bare % in a help string (datasets' split syntax) used to crash argparse's formatting."""
    text = next(g["--dataset_split"] for g in train_help.values() if "--dataset_split" in g)
    assert "train[:90%]" in text


@pytest.mark.parametrize(("script", "module", "cls"), [("sweep.py", "trl_ext.sweep", "SweepArgs"),
                                                        ("eval_run.py", "trl_ext.evaluate", "EvalArgs")])
def test_other_clis_help_lists_every_flag_with_its_default(script, module, cls):
    import importlib

    args_cls = getattr(importlib.import_module(module), cls)
    flags = {flag: text for group in sections(run_help(script)).values() for flag, text in group.items()}
    for f in dataclasses.fields(args_cls):
        if not f.init:
            continue
        assert f"--{f.name}" in flags, f"{script} --help lacks --{f.name}"
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if default is not dataclasses.MISSING:
            assert f"(default: {shown_default(default)})" in flags[f"--{f.name}"], (f.name, flags[f"--{f.name}"])


@TRAIN_HELP
def test_train_help_keeps_transformers_own_escaped_percent(train_help):
    """transformers writes '~20%%' (escaped already): shown as '~20%', not as argparse's parameter dict."""
    text = next(g["--activation_checkpointing"] for g in train_help.values() if "--activation_checkpointing" in g)
    assert "~20% slower" in text and "option_strings" not in text
