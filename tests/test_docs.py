"""The documentation: the MkDocs site builds with --strict, every command it shows parses, the README stays short.

Fast: nothing trains and no model loads. The command test reads every ``train.py`` / ``sweep.py`` / ``eval_run.py``
command of README.md and docs/**/*.md (fenced code blocks, and inline code spans that start with a command) and
parses its flags with the CLI's own parser, so a renamed or removed flag, or a value the flags' validation refuses,
fails here, naming the file and line of the command.

A command shown as deliberately failing is marked in the docs, by ``<!-- fails -->`` on the line before its fence
(every command of that block) or by a ``# exits 2`` comment on the command; it must raise a ConfigError or exit.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 300

SCRIPTS = ("train.py", "sweep.py", "eval_run.py")
LAUNCHERS = ("torchrun", "torch.distributed.run")
CUT = {"|", "||", "&&", "&", ";", ">", ">>", "<", "2>", "2>&1", "&>"}  # a shell tail: not the command's flags
SLURM_ARRAY_TASK = {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_MAX": "3",
                    "SLURM_ARRAY_TASK_COUNT": "4"}  # fmt: skip


def doc_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


# ------------------------------------------------------------------------------------------ the site
def nav_pages(nav) -> list[str]:
    """Every page path of mkdocs.yml's nav (nested sections, titled or bare entries)."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for item in nav for p in nav_pages(item)]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in nav_pages(value)]
    return []


class _ConfigLoader(yaml.SafeLoader):
    """mkdocs.yml as data: tags such as ``!!python/name:...`` or ``!ENV`` (none today) load as None."""


_ConfigLoader.add_multi_constructor("", lambda loader, suffix, node: None)


def mkdocs_config() -> dict:
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_ConfigLoader)


def test_mkdocs_build_strict(tmp_path):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    took = time.monotonic() - start
    assert proc.returncode == 0, f"mkdocs build --strict failed (exit {proc.returncode}):\n{proc.stderr}\n{proc.stdout}"
    assert (tmp_path / "site" / "index.html").is_file()
    print(f"mkdocs build --strict: {took:.1f} s")


def test_every_page_is_in_the_nav():
    nav = set(nav_pages(mkdocs_config()["nav"]))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert pages - nav == set(), f"pages missing from mkdocs.yml's nav: {sorted(pages - nav)}"
    assert nav - pages == set(), f"nav entries without a page: {sorted(nav - pages)}"


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move detail to docs/ (at most {README_MAX_LINES})"


# ------------------------------------------------------------------------------------------ the commands
@dataclass
class Command:
    where: str  # "file:line"
    text: str  # the shell command, continuation lines joined
    fails: bool  # marked in the docs as deliberately failing

    def __str__(self) -> str:
        return self.where


def _joined(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """(first line number, logical line): backslash-continued lines joined."""
    out, buf, first = [], "", None
    for no, line in lines:
        first = no if first is None else first
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        out.append((first, buf + line))
        buf, first = "", None
    if buf:
        out.append((first, buf))
    return out


def _argv(text: str) -> list[str]:
    """The shell words of a command: placeholders such as ``<sft run>`` become one word, comments, redirections,
    pipes, ``&&`` tails and a trailing ``&`` are cut, elisions (``...``) dropped."""
    text = re.sub(r"<([^<>\n]*)>", lambda m: "PLACEHOLDER_" + re.sub(r"\W+", "_", m.group(1)), text)
    words = shlex.split(text, comments=True)
    cut = next((i for i, w in enumerate(words) if w in CUT or re.match(r"^\d?>", w)), len(words))
    return [w for w in words[:cut] if w != "..."]


def _is_command(text: str) -> bool:
    """A shell command that runs one of SCRIPTS (a script named in a comment does not count)."""
    try:
        words = _argv(text)
    except ValueError:  # not shell (unbalanced quotes)
        return False
    if words[:1] == ["sbatch"]:
        return "--wrap" in text and any(s in text for s in SCRIPTS)
    return bool(words) and words[0] in ("uv", "python", "python3", "torchrun", "accelerate") and any(
        w.endswith(SCRIPTS) for w in words)


def commands_in(path: Path) -> list[Command]:
    rel = path.relative_to(ROOT).as_posix()
    lines = path.read_text().splitlines()
    found, prose, i = [], list(lines), 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(```+|~~~+)\s*([\w-]*)", lines[i])
        if fence:
            marker, lang = fence.group(2), fence.group(3)
            before = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
            fails = "<!-- fails -->" in before
            body, start, i = [], i, i + 1
            while i < len(lines) and not lines[i].strip().startswith(marker[:3]):
                body.append((i + 1, lines[i].strip()))
                i += 1
            i += 1
            prose[start:i] = [""] * (i - start)  # a fenced block is not prose
            if lang in ("python", "yaml", "json", "toml"):
                continue
            for no, text in _joined(body):
                text = text.strip()
                if text.startswith("$ "):
                    text = text[2:]
                if _is_command(text):
                    found.append(Command(f"{rel}:{no}", text, fails or "# exits 2" in text))
            continue
        i += 1
    # inline code spans that are whole commands (they may wrap onto the next line)
    prose = "\n".join(prose)
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", prose):
        span = " ".join(m.group(1).split())
        if re.match(r"(uv run (python )?(train|sweep|eval_run)\.py|(uv run )?torchrun|(uv run )?accelerate launch"
                    r"|(uv run )?python -m torch\.distributed\.run)\b", span) and _is_command(span):
            found.append(Command(f"{rel}:{prose.count(chr(10), 0, m.start()) + 1}", span, "# exits 2" in span))
    return found


ALL_COMMANDS = [c for p in doc_files() for c in commands_in(p)]


def _launch(words: list[str]) -> tuple[str, list[str], int]:
    """(script, its argv, processes) of a shell command; ``sbatch --wrap "..."`` is read from its wrapped command."""
    if words[0] == "sbatch":
        wrapped = next(w for i, w in enumerate(words) if words[i - 1] == "--wrap" or w.startswith("--wrap="))
        return _launch(_argv(wrapped.removeprefix("--wrap=")))
    i = next(i for i, w in enumerate(words) if w.endswith(SCRIPTS))
    before, procs = words[:i], 1
    if any(w.endswith(LAUNCHERS) for w in before) or "launch" in before:
        procs = 2  # a multi-process launch; its count (2 unless written as a number) only decides "several"
        for flag in ("--nproc_per_node", "--num_processes"):
            if flag in before and before[before.index(flag) + 1].isdigit():
                procs = int(before[before.index(flag) + 1])
        procs = 1 if "--cpu" in before else procs  # accelerate launch --cpu starts one process (docs/processes.md)
    return Path(words[i]).name, words[i + 1 :], procs


@functools.cache
def _train_parser():
    from trl_ext.cli_train import parser

    return parser()  # built once: parsing reuses it


def _parse_train(argv: list[str], procs: int, launched: bool = True) -> None:
    """train.py's parse of ``argv`` as a launch of ``procs`` processes sees it, without a process group: the
    project's checks see ``procs`` processes (`sweep_plan.planned_processes`), and with ``launched`` TRL's batch
    arithmetic does too (TrainingArguments.world_size, which a real launch reads from the process group)."""
    from transformers import TrainingArguments

    from trl_ext.sweep_plan import planned_processes

    from trl_ext.runs.recipe import expand, split_recipes

    if argv == ["--help"]:
        return
    paths, rest = split_recipes(argv)
    if any("PLACEHOLDER" in str(p) for p in paths):  # output/<run>/run_config.yaml: the flags after it
        argv = rest
    else:
        argv, _ = expand([a.replace("recipes/", f"{ROOT}/recipes/", 1) if a.startswith("recipes/") else a
                          for a in argv], _train_parser())  # fmt: skip
    with contextlib.ExitStack() as stack:
        stack.enter_context(planned_processes(procs))
        if launched and procs > 1:
            stack.enter_context(mock.patch.object(TrainingArguments, "world_size", property(lambda self: procs)))
        _run, _cfg, unknown = _train_parser().parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    assert unknown == [], f"train.py does not know {unknown}"


def _parse_sweep(argv: list[str], monkeypatch) -> None:
    from transformers import HfArgumentParser

    import trl_ext.cli_train
    from trl_ext.sweep import SweepArgs
    from trl_ext.sweep_plan import build_spec, parse_shard

    (args, unknown) = HfArgumentParser(SweepArgs).parse_args_into_dataclasses(args=argv,
                                                                                return_remaining_strings=True)
    assert unknown == [], f"sweep.py does not know {unknown}"
    monkeypatch.chdir(ROOT)  # sweep files are named relative to the repository
    built = _train_parser()
    monkeypatch.setattr(trl_ext.cli_train, "parser", lambda: built)  # flag names resolve through one parser, fast
    spec = build_spec(args)  # the sweep file, every key a train.py flag, no key twice
    if args.shard is not None:
        parse_shard(args.shard, SLURM_ARRAY_TASK)
    combos = [dict(zip(g, c)) for g in spec.grids for c in itertools.product(*g.values())]
    # every run's train.py flags parse (the sweep itself validates them further); runs that differ in their seed
    # alone parse alike, so each setting is parsed once
    combos = list({tuple(sorted((k, v) for k, v in c.items() if k != "seed")): c for c in combos}.values())
    fixed = sorted(spec.fixed.items(), key=lambda kv: kv[0] != "reward")
    for values in combos:
        run = [a for k, v in [*fixed, *values.items()] for a in (f"--{k}", v)] + [f"--{f}" for f in spec.train_flags]
        _parse_train(run, args.procs_per_run, launched=False)  # as sweep.py plans it, in its own one process


def _parse_eval(argv: list[str]) -> None:
    from transformers import HfArgumentParser

    from trl_ext.evaluate import EvalArgs

    (_args, unknown) = HfArgumentParser(EvalArgs).parse_args_into_dataclasses(args=argv,
                                                                                 return_remaining_strings=True)
    assert unknown == [], f"eval_run.py does not know {unknown}"


def _parse(command: Command, monkeypatch) -> None:
    for var in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)  # the launch is the command's, not this test process's
    monkeypatch.setattr("trl_ext.vllm.args.vllm_installed", lambda: True)  # docs/vllm.md's commands need the extra
    script, argv, procs = _launch(_argv(command.text))
    if script == "train.py":
        _parse_train(argv, procs)
    elif script == "sweep.py":
        _parse_sweep(argv, monkeypatch)
    else:
        _parse_eval(argv)


# Documented commands that a bug in trl_ext refuses: (a substring of the command, the bug). strict xfail, so that a
# fix shows up here and the entry goes.
KNOWN_BUGS: list[tuple[str, str]] = []


def _known_bug(command: Command) -> str | None:
    return next((why for text, why in KNOWN_BUGS if text in command.text), None)


def test_commands_are_found():
    scripts = {_launch(_argv(c.text))[0] for c in ALL_COMMANDS}
    assert scripts == set(SCRIPTS), scripts
    assert len(ALL_COMMANDS) >= 40, len(ALL_COMMANDS)


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=str)
def test_documented_command_parses(command: Command, monkeypatch, request):
    from trl_ext.registry import ConfigError

    if bug := _known_bug(command):
        request.applymarker(pytest.mark.xfail(reason=bug, strict=True, raises=pytest.fail.Exception))

    if command.fails:
        with pytest.raises((ConfigError, SystemExit)):
            _parse(command, monkeypatch)
        return
    try:
        _parse(command, monkeypatch)
    except SystemExit as e:  # argparse: an unknown choice or a malformed value (its message is on stderr)
        pytest.fail(f"{command.where}: `{command.text}` exits {e.code}")
    except ConfigError as e:
        pytest.fail(f"{command.where}: `{command.text}` is refused: {e}")
