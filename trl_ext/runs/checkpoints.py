"""Atomic checkpoints and resume resolution.

HF's Trainer writes ``checkpoint-N/`` file by file; a process killed mid-write leaves a directory that looks like a
checkpoint but is not one (HF's ``get_last_checkpoint`` would take it). Here a checkpoint counts only once its marker
``checkpoint_complete.json`` exists: it is written last, through a temporary file and an atomic ``os.replace``, after
every other file of the checkpoint (weights, optimizer, scheduler, RNG, trainer state, project state) is on disk.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import yaml

from trl_ext.registry import ConfigError

MARKER = "checkpoint_complete.json"
RUN_CONFIG = "run_config.yaml"
LATEST = "latest"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees either nothing or the whole file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def mark_complete(ckpt_dir: str | Path, step: int, **info) -> None:
    """Declare ``ckpt_dir`` complete (call after everything else in it is written)."""
    payload = {"step": step, "time": time.strftime("%Y-%m-%d %H:%M:%S"), **info}
    write_atomic(Path(ckpt_dir) / MARKER, json.dumps(payload, indent=2))


def is_complete(ckpt_dir: str | Path) -> bool:
    return (Path(ckpt_dir) / MARKER).is_file()


def checkpoint_step(path: str | Path) -> int | None:
    m = _CHECKPOINT.match(Path(path).name)
    return int(m.group(1)) if m else None


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path, bool]]:
    """(step, path, complete) of every ``checkpoint-N`` directory of ``run_dir``, by step."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(checkpoint_step(p), p) for p in run_dir.iterdir() if p.is_dir()]
    return sorted((step, p, is_complete(p)) for step, p in found if step is not None)


def latest_complete(run_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    done = [p for _, p, complete in list_checkpoints(run_dir) if complete]
    return done[-1] if done else None


def resolve_resume(value: str, run_dir: Path) -> Path:
    """``--resume_from_checkpoint`` (a path or ``latest``) as a complete checkpoint directory; ConfigError otherwise."""
    if value == LATEST:
        path = latest_complete(run_dir)
        if path is None:
            partial = [p.name for _, p, complete in list_checkpoints(run_dir) if not complete]
            extra = f" (incomplete, never resumed from: {', '.join(partial)})" if partial else ""
            raise ConfigError(f"--resume_from_checkpoint latest: no complete checkpoint in {run_dir}{extra}")
        return path
    path = Path(value)
    if not path.is_dir():
        raise ConfigError(f"--resume_from_checkpoint: {path} does not exist (or is not a directory)")
    if not is_complete(path):
        raise ConfigError(f"--resume_from_checkpoint: {path} is not a complete checkpoint (no {MARKER}: its write "
                          "was interrupted, or it was not written by train.py)")
    return path


def saved_run_config(ckpt_dir: Path) -> dict:
    """The run_config.yaml saved with a checkpoint (in it, else in its run directory)."""
    for candidate in (ckpt_dir / RUN_CONFIG, ckpt_dir.parent / RUN_CONFIG):
        if candidate.is_file():
            return yaml.safe_load(candidate.read_text())
    raise ConfigError(f"--resume_from_checkpoint: no {RUN_CONFIG} in {ckpt_dir} or its parent: cannot check that the "
                      "checkpoint belongs to this command")


def config_differences(saved: dict, current: dict, is_defining, labels=("checkpoint", "command")) -> list[str]:
    """``field: checkpoint X, command Y`` (``labels``) for every run-defining field whose value differs.

    ``saved`` / ``current`` are run_config.yaml dicts ({section: {field: value}}; the record of the flags given,
    `runs.recipe.FLAGS_SECTION`, is not compared: flags typed differently can resolve alike); ``is_defining(field)``
    decides which fields define the run (naming.is_defining: logging and output fields do not)."""
    from trl_ext.runs.recipe import FLAGS_SECTION

    was, now = labels
    diffs = []
    for section in sorted((set(saved) | set(current)) - {FLAGS_SECTION}):
        old, new = saved.get(section) or {}, current.get(section) or {}
        if not isinstance(old, dict) or not isinstance(new, dict):
            continue
        for name in sorted(set(old) | set(new)):
            if is_defining(name) and old.get(name, "<absent>") != new.get(name, "<absent>"):
                diffs.append(f"{name}: {was} {old.get(name, '<absent>')!r}, {now} {new.get(name, '<absent>')!r}")
    return diffs
