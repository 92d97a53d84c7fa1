"""Which weights a run started from: ``start_weights.json`` in the run directory.

The same ``--model`` can name different weights: a builtin model is built on first use and builds differ across
machines (docs/builtin-model.md), a local directory can be rewritten, a hub id moves with its main branch. So
a run records what it started from, a resume refuses to continue from other weights, and a study can refuse to mix
runs of different starting points (``experiments/offpolicy_study.py``):

- a local directory: the SHA-256 of each weight file (``*.safetensors``, ``*.bin``, ``*.pt``), read in chunks; a
  single-file builtin model's digest equals its ``build_info.json`` ``weights_sha256``;
- a hub id: the commit of the cached snapshot it was loaded from (``hub_commit``);
- a distillation run's ``--teacher_model`` the same way, under ``teacher``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from trl_ext.registry import ConfigError

START_WEIGHTS = "start_weights.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def fingerprint(model: str, source: str) -> dict:
    """The record of the model named ``model`` (``--model``, ``--teacher_model``), loaded from ``source``: a
    directory, or a hub id (``repo`` or ``repo@revision``) that from_pretrained has just loaded into the hub cache."""
    path = Path(source)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
        if not files:
            raise ConfigError(f"model {model}: no weight file ({', '.join(WEIGHT_SUFFIXES)}) in {source}")
        return {"model": model, "path": str(path.resolve()), "files": {p.name: file_sha256(p) for p in files}}
    commit = hub_commit(source)
    if commit is None:
        raise ConfigError(f"model {model}: {source} is neither a directory nor in the local hub cache, so the run "
                          "cannot say which weights it started from")
    return {"model": model, "path": source, "commit": commit}


def hub_commit(model_id: str) -> str | None:
    """The commit of the cached snapshot that ``repo[@revision]`` resolves to (the default branch without a
    revision): huggingface_hub's cache keeps each snapshot under ``snapshots/<commit>/``. transformers 5 no longer
    records it on the config (``_commit_hash`` is dropped)."""
    from huggingface_hub import try_to_load_from_cache

    repo, _, revision = model_id.partition("@")
    found = try_to_load_from_cache(repo, "config.json", revision=revision or None)
    return Path(found).parent.name if isinstance(found, str) else None


def weights_id(record: dict) -> str:
    """One string per starting point: the file's SHA-256 (one file), the SHA-256 of the sorted ``name sha256``
    lines (several), or ``hub_id@commit``. The path is not part of it: a copy elsewhere is the same start."""
    if "commit" in record:
        return f"{record['path']}@{record['commit']}"
    files = record["files"]
    if len(files) == 1:
        return next(iter(files.values()))
    return hashlib.sha256("".join(f"{n} {h}\n" for n, h in sorted(files.items())).encode()).hexdigest()


def start_id(record: dict) -> str:
    """What a resume must match: the policy's weights id, and the distillation teacher's when the run has one."""
    teacher = record.get("teacher")
    return weights_id(record) + (f", teacher {weights_id(teacher)}" if teacher else "")


def read_start_weights(run_dir: Path) -> dict | None:
    path = Path(run_dir) / START_WEIGHTS
    return json.loads(path.read_text()) if path.is_file() else None


def record_start_weights(run_dir: Path, record: dict, resumed: bool) -> str:
    """A fresh run writes ``record`` to its directory; a resumed run compares it with the one written at its start
    and refuses (ConfigError) other weights. A resumed run that predates the record writes none (it cannot know what
    it started from). Returns a line for train.log."""
    old = read_start_weights(run_dir)
    if not resumed:
        if old is not None:
            raise ConfigError(f"{Path(run_dir) / START_WEIGHTS} exists before this fresh run started")
        (Path(run_dir) / START_WEIGHTS).write_text(json.dumps(record, indent=2) + "\n")
        return f"start weights: {start_id(record)} ({record['path']})"
    if old is None:
        return f"start weights: not recorded at this run's start; it resumes with {start_id(record)}"
    if start_id(old) != start_id(record):
        raise ConfigError(f"{run_dir} started from --model {old['model']}, weights {start_id(old)} ({old['path']}); "
                          f"--model {record['model']} now loads {start_id(record)} ({record['path']}): resume from "
                          "the weights it started from (a builtin model differs across machines: pin it as a "
                          "directory, docs/builtin-model.md)")
    return f"start weights: {start_id(record)}, as at this run's start"


def start_weights(plan, model_path: str, teacher=None) -> None:
    """train.py's call (``plan``: its Plan, the policy loaded from ``model_path``, ``teacher`` the distillation
    teacher loaded from ``--teacher_model``): the main process records or checks the start weights, every rank
    receives a refusal (`launch.processes.on_main`), the main process logs the line."""
    from trl_ext.launch.processes import is_main, on_main

    def record() -> dict:
        out = fingerprint(plan.run.model, model_path)
        if teacher is not None:  # loaded from its resolved path, which its config keeps as name_or_path
            out["teacher"] = fingerprint(plan.cfg.teacher_model, teacher.config.name_or_path)
        return out

    def checked() -> str:
        now = record()
        origin = getattr(plan, "origin", None)  # the run whose run_config.yaml is this run's recipe
        if origin is not None:
            check_same_start(origin, now)
        return record_start_weights(plan.run_dir, now, resumed=plan.resume is not None)

    line = on_main(checked)
    if is_main():
        print(line, flush=True)


def check_same_start(origin: Path, record: dict) -> None:
    """A run from another run's run_config.yaml starts from that run's start weights (a builtin model's pinned build,
    the same local files, the same hub commit), its distillation teacher included; ConfigError otherwise."""
    old = read_start_weights(origin)
    if old is None:
        raise ConfigError(f"{origin} has no {START_WEIGHTS}: its start weights cannot be checked, so its "
                          "run_config.yaml cannot reproduce it")
    if start_id(old) != start_id(record):
        raise ConfigError(f"{origin} started from --model {old['model']}, weights {start_id(old)} ({old['path']}); "
                          f"--model {record['model']} now loads {start_id(record)} ({record['path']}): its "
                          "run_config.yaml would not reproduce it")
