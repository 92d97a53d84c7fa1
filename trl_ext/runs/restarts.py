"""The restarts of a run's parts (a vLLM server, the trainer) by its launcher (layout.py: ``trl_ext.serve.watch``):
one JSON line each in the run directory's ``restarts.jsonl``, and a line in its ``train.log``; run_summary.json
lists them (`read_restarts`). Appended (``O_APPEND``: one short write per line, whole among the trainer's own
train.log writes)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

RESTARTS_FILE = "restarts.jsonl"
TRAIN_LOG = "train.log"
SUMMARY_FILE = "run_summary.json"


def _append(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def record_restart(run_dir: Path, part: str, number: int, limit: int, why: str, **fields) -> dict:
    """Record a restart of ``part`` (e.g. ``policy server http://...``, ``trainer``), the ``number``-th of at most
    ``limit``, because ``why``; returns the record."""
    event = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "part": part, "restart": number, "of": limit, "why": why,
             **fields}  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    _append(run_dir / RESTARTS_FILE, json.dumps(event) + "\n")
    _append(run_dir / TRAIN_LOG, f"layout.py: restarted the {part} ({number} of {limit}): {why}\n")
    return event


def read_restarts(run_dir: Path) -> list[dict]:
    """Every restart recorded in ``run_dir`` (oldest first); [] when none."""
    path = Path(run_dir) / RESTARTS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summary_status(run_dir: Path, since: float) -> str | None:
    """run_summary.json's ``status`` when the file was written at or after ``since`` (``time.time()``); else None."""
    path = Path(run_dir) / SUMMARY_FILE
    try:
        if path.stat().st_mtime < since:
            return None
        return json.loads(path.read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return None
