"""Saved rollouts (``--save_rollouts``): every trained sample of every step, as parquet shards that `datasets` loads.

``{run_dir}/rollouts/step-{step:06d}-rank0.parquet``, one shard per training step, written through a temporary
file and an atomic rename; on several processes the main process gathers every process's rows and writes it alone.
Schema (`features`; one row per completion):

- ``step`` (the optimizer step that trained on it, 1-based), ``sample`` (row in the whole generation batch, all
  processes, TRL's order), ``group``
- ``prompt``, ``completion`` (decoded; for environment runs the whole transcript after the prompt)
- ``segments``: list of {``source``: "agent" | "env", ``text``}: the completion split at its turn boundaries (agent
  tokens are trained on, environment tokens are not); one agent segment for plain completions
- ``reward`` (the weighted sum TRL optimises), ``reward/<name>`` per reward function, ``eval_reward/<name>`` per
  ``--eval_rewards`` binding, ``advantage`` (per sequence; the masked token mean when advantages are per token)
- ``is_rh`` (detector label), ``is_bad`` (routing label), ``teacher_logprob_sum``, ``student_logprob_sum``,
  ``policy_version_min`` / ``policy_version_max`` (off-policy), ``env`` / ``env_seed`` (``--env`` runs: the
  episode's environment and level; a mixture's groups each hold one environment): null where the run has no such value
- ``completion_tokens`` (tokens in the loss mask)

Read them with ``load_rollouts(run_dir, step)`` or ``uv run python -m trl_ext.runs.rollouts RUN_DIR --step N``; the
token records (``--token_records_every``, `runs.token_records`) with ``token_table(run_dir)`` or ``... RUN_DIR --tokens
[--step N] [--where QUERY]``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import torch

ROLLOUT_DIR = "rollouts"
_SHARD = re.compile(r"^step-(\d+)-rank(\d+)\.parquet$")
OPTIONAL_COLUMNS = {"is_rh": "bool", "is_bad": "bool", "teacher_logprob_sum": "float64",
                    "student_logprob_sum": "float64", "policy_version_min": "int64", "policy_version_max": "int64",
                    "env": "string", "env_seed": "int64"}


def features(reward_names: list[str], eval_names: list[str]):
    """The `datasets.Features` of a run's shards (fixed per run, so shards of every step load together)."""
    from datasets import Features, List, Value

    cols = {"step": Value("int64"), "sample": Value("int64"), "group": Value("int64"), "prompt": Value("string"),
            "completion": Value("string"),
            "segments": List({"source": Value("string"), "text": Value("string")}),
            "reward": Value("float64")}  # fmt: skip
    cols.update({f"reward/{n}": Value("float64") for n in reward_names})
    cols.update({f"eval_reward/{n}": Value("float64") for n in eval_names})
    cols["advantage"] = Value("float64")
    cols.update({name: Value(dtype) for name, dtype in OPTIONAL_COLUMNS.items()})
    cols["completion_tokens"] = Value("int64")
    return Features(cols)


def split_segments(ids: list[int], trained: list[int], decode) -> list[dict]:
    """Split completion tokens at changes of the trained mask: [{source: agent|env, text}] in order."""
    segments, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or trained[i] != trained[start]:
            text = decode(ids[start:i])
            if text:  # a closing EOS (not trained on) decodes to nothing
                segments.append({"source": "agent" if trained[start] else "env", "text": text})
            start = i
    return segments


def weighted_reward(rewards: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The saved ``reward`` of each sample ([N, F] rewards, [F] weights), as TRL 1.16 sums it: the weighted sum over
    the reward functions with a None (NaN) counting 0, and NaN where every function returned None (TRL's
    unscorable completion, which it keeps out of the group baseline)."""
    total = (rewards * weights.to(rewards.device).unsqueeze(0)).nansum(1).double()
    return torch.where(torch.isnan(rewards).all(1), torch.nan, total)


def sequence_values(values: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """Per-sequence values of a [B] tensor, or the masked mean of a [B, T] one."""
    if values.dim() == 1:
        return values.double().tolist()
    m = mask.double()
    return ((values.double() * m).sum(1) / m.sum(1).clamp(min=1)).tolist()


def masked_sums(values: torch.Tensor, mask: torch.Tensor) -> list[float]:
    return (values.double() * mask.double()).sum(1).tolist()


def shard_path(run_dir: str | Path, step: int) -> Path:
    """A step's shard (written by the main process; ``rank0`` in the name keeps the format readers match)."""
    return Path(run_dir) / ROLLOUT_DIR / f"step-{step:06d}-rank0.parquet"


def write_shard(path: Path, columns: dict[str, list], feats) -> None:
    from datasets import Dataset

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    Dataset.from_dict(columns, features=feats).to_parquet(str(tmp))
    os.replace(tmp, path)


def shard_steps(run_dir: str | Path, folder_name: str = ROLLOUT_DIR) -> dict[int, list[Path]]:
    out: dict[int, list[Path]] = {}
    folder = Path(run_dir) / folder_name
    for p in sorted(folder.iterdir()) if folder.is_dir() else []:
        m = _SHARD.match(p.name)
        if m:
            out.setdefault(int(m.group(1)), []).append(p)
    return out


def discard_after(run_dir: str | Path, step: int) -> Path | None:
    """Move the shards of steps after ``step`` (written by an interrupted run, never committed to a checkpoint) to
    ``rollouts/discarded-{timestamp}/`` before a resume regenerates them; returns that folder (None if none)."""
    from trl_ext.runs.token_records import TOKEN_DIR

    late = [p for s, paths in shard_steps(run_dir).items() if s > step for p in paths]
    late += [p for s, paths in shard_steps(Path(run_dir) / ROLLOUT_DIR, TOKEN_DIR).items() if s > step for p in paths]
    if not late:
        return None
    target = Path(run_dir) / ROLLOUT_DIR / f"discarded-{time.strftime('%Y%m%d-%H%M%S')}"
    target.mkdir(parents=True, exist_ok=True)
    for p in late:
        p.rename(target / (p.name if p.parent.name == ROLLOUT_DIR else f"{p.parent.name}-{p.name}"))
    return target


def load_rollouts(run_dir: str | Path, step: int | None = None):
    """The saved rollouts of a run (all steps, or one) as a `datasets.Dataset`."""
    from datasets import load_dataset

    shards = shard_steps(run_dir)
    files = [str(p) for s, paths in sorted(shards.items()) if step is None or s == step for p in paths]
    if not files:
        have = f"steps {min(shards)}..{max(shards)}" if shards else "none"
        raise FileNotFoundError(f"no saved rollouts for step {step} in {Path(run_dir) / ROLLOUT_DIR} (saved: {have})")
    return load_dataset("parquet", data_files=files, split="train")


def token_shard_path(run_dir: str | Path, step: int) -> Path:
    from trl_ext.runs.token_records import TOKEN_DIR

    return Path(run_dir) / ROLLOUT_DIR / TOKEN_DIR / f"step-{step:06d}-rank0.parquet"


def load_token_records(run_dir: str | Path, step: int | None = None):
    """A run's token records (all steps, or one) as a `datasets.Dataset`."""
    from datasets import load_dataset

    from trl_ext.runs.token_records import TOKEN_DIR

    folder = Path(run_dir) / ROLLOUT_DIR / TOKEN_DIR
    files = sorted(str(p) for p in folder.glob("step-*-rank0.parquet")
                   if step is None or p.name == f"step-{step:06d}-rank0.parquet")  # fmt: skip
    if not files:
        raise FileNotFoundError(f"no token records{'' if step is None else f' for step {step}'} in {folder} "
                                "(train.py --save_rollouts --token_records_every N writes them)")
    return load_dataset("parquet", data_files=files, split="train")


def token_table(run_dir: str | Path, step: int | None = None, where: str | None = None):
    """The token records of a run (one step, or all) joined with their completions' rows (the reward components and
    eval rewards), as a pandas DataFrame; ``where``: a `DataFrame.query` over its columns."""
    tokens = load_token_records(run_dir, step).to_pandas()
    rows = load_rollouts(run_dir, step).to_pandas()
    extra = [c for c in rows.columns if c.startswith(("reward/", "eval_reward/"))]
    table = tokens.merge(rows[["step", "sample", *extra]], on=["step", "sample"], how="left", validate="many_to_one")
    return table.query(where) if where else table


def print_tokens(args) -> int:
    try:
        table = token_table(args.run_dir, args.step, args.where)
    except FileNotFoundError as e:
        print(f"rollouts: error: {e}", file=sys.stderr)
        return 2
    trained = table[table["trained"]]
    masked = trained["masked_by"].value_counts().to_dict()
    print(f"{args.run_dir}: {len(table)} token rows{'' if args.where is None else f' where {args.where}'}; "
          f"{len(trained)} trained, masked {sum(masked.values())} {masked}, clipped "
          f"{int(trained['clipped'].notna().sum())}")
    shown = table if args.n == 0 else table.head(args.n)
    print(shown.to_string(index=False, max_colwidth=24))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Print the saved rollouts of a run's step, or its token records.")
    ap.add_argument("run_dir")
    ap.add_argument("--step", type=int, default=None, help="the step (required without --tokens)")
    ap.add_argument("--n", type=int, default=8, help="rows to print (0 = all)")
    ap.add_argument("--tokens", action="store_true", help="the token records (--token_records_every), joined with "
                    "their completions' reward components")
    ap.add_argument("--where", default=None, help="with --tokens: a pandas query over the columns, e.g. "
                    "\"trained and masked_by == 'token_high' and is_rh\"")
    args = ap.parse_args(argv)
    if args.tokens:
        return print_tokens(args)
    if args.where is not None:
        ap.error("--where filters the token records: add --tokens")
    if args.step is None:
        ap.error("--step is required (or --tokens)")
    try:
        ds = load_rollouts(args.run_dir, args.step)
    except FileNotFoundError as e:
        print(f"rollouts: error: {e}", file=sys.stderr)
        return 2
    rows = ds if args.n == 0 else ds.select(range(min(args.n, len(ds))))
    print(f"{args.run_dir}: step {args.step}, {len(ds)} rollouts; columns: {', '.join(ds.column_names)}")
    for row in rows:
        scores = {k: v for k, v in row.items() if (k.startswith(("reward", "eval_reward")) or k in
                  ("advantage", *OPTIONAL_COLUMNS)) and v is not None}  # fmt: skip
        print(f"[step {row['step']} sample {row['sample']} group {row['group']}] "
              + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in scores.items()))
        print(f"  prompt: {row['prompt']}")
        for seg in row["segments"]:
            print(f"  {seg['source']}: {seg['text']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
