"""``routing_trace.jsonl``: what routing saw on a training batch (small-rl train.py ``_log_training_trace``,
HEAD 6f6e986). Each fire appends one ``{"trace": "rollout"}`` summary of the process's batch and
``{"trace": "sample"}`` records for a random subset of it (prompt and completion text inline, cut at 400
characters). The subset is drawn from (seed, step), not from the training RNG (small-rl uses ``random.sample``).

Per sample: the detector flag ``is_rh``, the routing label ``is_bad``, ``eligible`` and ``hackable``, the reward
trained on, TRL's group advantage (``advantage_pre_renorm``) and the advantage used (``advantage``), and
``retain_advantage_clean``: the advantage among the unflagged of its group (small-rl's counterfactual).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from trl_ext.routing.advantages import group_advantages

TRACE_FILENAME = "routing_trace.jsonl"
TRACE_INTERVALS = ("every_iter", "when_eval", "off")


def trace_fires(interval: str, step: int, logging_steps: float, eval_steps: int) -> bool:
    """small-rl ``_diag_interval_fires``: every logging step, every eval step (step > 0), or never."""
    if interval == "off":
        return False
    if interval == "every_iter":
        return step % max(1, int(logging_steps)) == 0
    if interval == "when_eval":
        return eval_steps > 0 and step > 0 and step % eval_steps == 0
    raise ValueError(f"unknown trace interval {interval!r}; choose one of {', '.join(TRACE_INTERVALS)}")


def trace_records(
    step: int, G: int, prompts: list[str], completions: list[str], tensors: dict[str, torch.Tensor], k: int,
    seed: int,
) -> list[dict]:
    """The rollout record and ``k`` sample records of one batch. ``tensors``: per-sample ``is_rh``, ``is_bad``,
    ``eligible``, ``hackable`` (bool), ``reward``, ``advantage_pre_renorm``, ``advantage`` (float); groups of
    ``G`` consecutive samples."""
    n = len(completions)
    t = {key: v.detach().cpu() for key, v in tensors.items()}
    clean = group_advantages(t["reward"].double(), G, ~t["is_bad"]).tolist() if "is_bad" in t else [None] * n
    summary = {"trace": "rollout", "step": step, "n": n}
    for key in ("is_rh", "is_bad", "eligible", "hackable"):
        if key in t:
            summary[f"frac_{key}"] = t[key].float().mean().item()
    summary["reward_mean"] = t["reward"].float().mean().item()
    digest = hashlib.sha256(f"{seed}/{step}/trace".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    idx = sorted(torch.randperm(n, generator=g)[: min(k, n)].tolist())
    samples = []
    for i in idx:
        rec = {"trace": "sample", "step": step, "idx": i, "group_idx": i // G}
        for key, v in t.items():
            rec[key] = bool(v[i]) if v.dtype == torch.bool else float(v[i])
        rec["retain_advantage_clean"] = clean[i]
        rec["prompt"], rec["completion"] = prompts[i][:400], completions[i][:400]
        samples.append(rec)
    return [summary, *samples]


def append_trace(run_dir: str | Path, records: list[dict]) -> Path:
    path = Path(run_dir) / TRACE_FILENAME
    with path.open("a") as f:
        for r in records:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    return path
