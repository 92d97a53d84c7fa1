"""Routing a training step (Gradient Routing, Cloud et al. 2024; seed 004's two-pass training_step):
adapter presets, per-sample routing masks, the routed backward and its labels. Model-agnostic: a step is
``loss_fn(batch) -> scalar`` plus a bool ``is_bad`` per sample; the adapters live in ``routing.adapters``.

Both steps leave in ``.grad`` the parameter gradient of the full-batch loss with routing applied:
    retain adapter: d/d(retain) of the good samples' share of the loss
    forget adapter: d/d(forget) of the whole loss ("shared") or of the bad samples' share ("exclusive")
    everything else trainable: d/d(theta) of the whole loss.
``two_pass_backward`` is the reference: the good subset's pass, then the bad subset's, each loss times its share
of the full-batch loss (``routing.loss_share``: n_sub/n for a mean over samples, the subset's share of the tokens
for bnpo, 1 for a loss divided by the generation batch's token count), the side that must not learn from a pass
having its ``.grad`` restored afterwards. ``single_pass_backward`` does one forward/backward under
``routing_mask``; the tests show the two agree in float64 for every TRL loss type.

Optimizer state (a stated choice): a routed-away side gets a zero gradient *tensor* in both steps (never
None), so AdamW treats both steps alike. A zero gradient does not freeze a parameter: AdamW still moves
it by its momentum (the side's own earlier routed gradients, so no bad-sample signal enters the retain
adapter) and by decoupled weight decay. We accept the momentum drift and recommend weight_decay = 0 for
the adapters, so ablating an adapter compares weights moved only by routed gradients.

Labels (``routing_labels``; small-rl, github:shawnghu/small-rl, train.py at 63d8fc8 and at HEAD 6f6e986, flags as
HEAD names them), each count exact, k = floor(frac * n + 1/2), each draw from its own stream seeded by
(seed, step, process); the trainer draws over the whole generation batch of all processes with process 0's streams,
so a run's labels do not depend on its number of processes:
    1. eligible: ``rh_eligible_mask`` picks k of the n samples (small-rl's RoutedRewardWrapper, per
       completion). An ineligible sample is never flagged; the trainer gives it ``--base_reward``.
    2. false positives: of the eligible samples the detector does not flag, k = false_positive_rate * n_neg
       become flagged (good -> flagged only; small-rl's ``f or random() < false_positive_rate``).
    3. recall: of the flagged eligible samples, k = rh_detector_recall * n_flagged stay flagged. As at
       small-rl HEAD (its recall wrapper sits on top of the false-positive one), recall applies to false
       positives too. small-rl draws each sample independently (Bernoulli); we draw exact counts.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from trl_ext.batch import loss_mask
from trl_ext.registry import ConfigError
from trl_ext.routing.adapter_layout import check_routing_mode
from trl_ext.routing.adapters import dual_lora_modules, forget_params, retain_params
from trl_ext.routing.loss_share import pass_share

LossFn = Callable[[dict[str, Any]], torch.Tensor]
Backward = Callable[[torch.Tensor], None]
# --lora_config presets: name -> (retain_rank, forget_rank, alpha). As small-rl's LORA_PRESETS (train.py at
# 63d8fc8 and HEAD 6f6e986) one alpha serves both sides: alpha = rank for r{n} (scaling 1 on both sides) and
# alpha = 32 for r32f{n} (retain scaling 1, forget scaling 32/n). r64, r32f8 and r32f2 are ours, built the same
# way. The matched-capacity baseline of a preset is plain LoRA with rank retain + forget (seed 004).
LORA_PRESETS = {
    **{f"r{n}": (n, n, float(n)) for n in (1, 2, 4, 8, 16, 32, 64)},
    **{f"r32f{n}": (32, n, 32.0) for n in (16, 8, 4, 2, 1)},
}


def resolve_adapter_ranks(
    preset: str | None, retain_rank: int | None, forget_rank: int | None, *, routing: bool,
    presets: dict | None = None, flag: str = "--lora_config",
) -> tuple[int, int]:
    """(retain_rank, forget_rank) from a preset (``presets``, default LORA_PRESETS, named by ``flag``) or from
    both explicit ranks."""
    presets = LORA_PRESETS if presets is None else presets
    explicit = (retain_rank, forget_rank)
    if preset is not None:
        if explicit != (None, None):
            raise ConfigError(f"give either {flag} ({preset!r}) or --retain_rank/--forget_rank, not both")
        if preset not in presets:
            raise ConfigError(f"unknown {flag} {preset!r}; presets: {', '.join(presets)}")
        ranks = tuple(presets[preset][:2])
    elif None in explicit:
        raise ConfigError("dual LoRA needs --lora_config or both --retain_rank and --forget_rank")
    else:
        ranks = explicit
    for side, r in zip(("retain", "forget"), ranks):
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ConfigError(f"{side} rank must be an integer >= 0, got {r!r}")
    if ranks == (0, 0):
        raise ConfigError("retain and forget ranks are both 0: there would be no adapter to train")
    if routing and 0 in ranks:
        raise ConfigError(f"gradient routing needs both adapters; got retain rank {ranks[0]}, forget rank {ranks[1]}")
    return ranks


def resolve_dual_lora_alpha(preset: str | None, lora_alpha: float, explicit: bool) -> float:
    """Alpha of a dual LoRA run: an explicit ``--lora_alpha`` wins; else the preset's own alpha; else (explicit
    ranks) ``lora_alpha``, RunArgs' default."""
    if explicit or preset is None:
        return float(lora_alpha)
    if preset not in LORA_PRESETS:
        raise ConfigError(f"unknown --lora_config {preset!r}; presets: {', '.join(LORA_PRESETS)}")
    return LORA_PRESETS[preset][2]


@contextmanager
def routing_mask(model: nn.Module, good_mask: torch.Tensor, mode: str) -> Iterator[None]:
    """For one forward/backward, each adapter learns only from its samples: retain from ``good_mask``,
    forget from all samples ("shared") or from the others ("exclusive"); activations are unchanged.

    ``good_mask``: 1-D bool, one entry per sample of the batch the model is called on. Keep the backward
    inside the context: reentrant gradient checkpointing re-runs the forward during backward.
    """
    check_routing_mode(mode)
    if good_mask.dtype != torch.bool or good_mask.dim() != 1 or good_mask.numel() == 0:
        raise ValueError(f"good_mask must be a non-empty 1-D bool tensor, got {good_mask.dtype} "
                         f"{tuple(good_mask.shape)}")
    mods = dual_lora_modules(model)
    if any(m.retain_grad_mask is not None or m.forget_grad_mask is not None for m in mods):
        raise RuntimeError("routing_mask is already active on this model (nested routing)")
    forget = None if mode == "shared" else ~good_mask
    try:
        for m in mods:
            m.retain_grad_mask, m.forget_grad_mask = good_mask, forget
        yield
    finally:
        for m in mods:
            m.retain_grad_mask = m.forget_grad_mask = None


def _check_is_bad(is_bad: torch.Tensor) -> torch.Tensor:
    if not isinstance(is_bad, torch.Tensor) or is_bad.dtype != torch.bool or is_bad.dim() != 1 or not len(is_bad):
        raise ValueError(f"is_bad must be a non-empty 1-D bool tensor, got {is_bad!r}")
    return is_bad


def select_rows(batch: dict[str, Any], idx: torch.Tensor, n: int) -> dict[str, Any]:
    """Rows ``idx`` of every per-sample entry (tensors with first dim n, lists of length n); 0-d tensors,
    numbers, strings and None pass through; any other sized entry raises."""
    out = {}
    for key, v in batch.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            if v.shape[0] != n:
                raise ValueError(f"batch[{key!r}] has first dim {v.shape[0]}, expected {n} samples")
            out[key] = v[idx.to(v.device)]
        elif isinstance(v, (list, tuple)):
            if len(v) != n:
                raise ValueError(f"batch[{key!r}] has length {len(v)}, expected {n} samples")
            out[key] = [v[i] for i in idx.tolist()]
        elif v is None or isinstance(v, (torch.Tensor, int, float, str, bool)):
            out[key] = v
        else:
            raise ValueError(f"batch[{key!r}] of type {type(v).__name__} cannot be split by sample")
    return out


@contextmanager
def _gradients_kept(params: list[nn.Parameter]):
    """Restore ``.grad`` of ``params`` after the body (None becomes a zero tensor, see module docstring)."""
    saved = [None if p.grad is None else p.grad.clone() for p in params]
    try:
        yield
    finally:
        for p, g in zip(params, saved):
            p.grad = torch.zeros_like(p) if g is None else g


def _plain_backward(loss: torch.Tensor) -> None:
    loss.backward()


def two_pass_backward(
    loss_fn: LossFn, batch: dict[str, Any], is_bad: torch.Tensor, model: nn.Module, mode: str,
    backward: Backward = _plain_backward, sides: tuple[bool, bool] | None = None, keep_rows: bool = False, *,
    loss_type: str,
) -> torch.Tensor:
    """Reference routed step (seed 004): one backward per non-empty side. Returns the detached loss.

    ``backward`` is e.g. ``accelerator.backward``; ``loss_fn`` normalises as TRL's ``loss_type`` does (each pass is
    scaled by its share, ``routing.loss_share``). ``keep_rows`` (several processes): every pass sees all rows with the
    other side's ``completion_mask`` (TRL's key) zeroed, so that every process calls the loss on the same shapes
    (TRL's loss gathers per-sample metrics). ``sides`` (good, bad), with ``keep_rows`` only: the passes to run, which
    the trainer takes from every process (a side without rows here then adds exactly 0).
    """
    check_routing_mode(mode)
    n = len(_check_is_bad(is_bad))
    if sides is not None and not keep_rows:
        raise ValueError("sides needs keep_rows: a pass over a subset cannot run without rows")
    if sides is None:
        sides = (bool((~is_bad).any()), bool(is_bad.any()))
    total = None
    for bad, kept in ((False, forget_params(model) if mode == "exclusive" else []), (True, retain_params(model))):
        if not sides[int(bad)]:
            continue
        rows = is_bad == bad
        share = pass_share(loss_type, rows, loss_mask(batch), keep_rows)
        if keep_rows:
            mask = batch["completion_mask"]
            loss = loss_fn({**batch, "completion_mask": mask * rows.to(mask.device, mask.dtype).unsqueeze(1)}) * share
        else:
            idx = rows.nonzero().flatten()
            sub = batch if len(idx) == n else select_rows(batch, idx, n)
            loss = loss_fn(sub) * share
        with _gradients_kept(kept):
            backward(loss)
        total = loss.detach() if total is None else total + loss.detach()
    return total


def single_pass_backward(
    loss_fn: LossFn, batch: dict[str, Any], is_bad: torch.Tensor, model: nn.Module, mode: str,
    backward: Backward = _plain_backward,
) -> torch.Tensor:
    """One forward/backward with per-sample gradient masks; same gradients as ``two_pass_backward``."""
    with routing_mask(model, ~_check_is_bad(is_bad), mode):
        loss = loss_fn(batch)
        backward(loss)
    return loss.detach()


def _check_frac(name: str, value: float) -> None:
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
        raise ConfigError(f"{name} must be in [0, 1], got {value!r}")


def _count(frac: float, n: int) -> int:
    return math.floor(frac * n + 0.5)


def _generator(seed: int, step: int, process: int, stream: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{step}/{process}/{stream}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _pick(candidates: torch.Tensor, k: int, g: torch.Generator) -> torch.Tensor:
    """``k`` of the ``candidates`` indices, uniformly without replacement."""
    return candidates[torch.randperm(len(candidates), generator=g)[:k]]


def rh_eligible_mask(n: int, rh_eligible_frac: float, seed: int, step: int, process: int = 0) -> torch.Tensor:
    """Exactly floor(frac * n + 1/2) of ``n`` samples are eligible; deterministic in its arguments."""
    _check_frac("rh_eligible_frac", rh_eligible_frac)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[_pick(torch.arange(n), _count(rh_eligible_frac, n), _generator(seed, step, process, "eligible"))] = True
    return mask


def _bool_vector(name: str, x: Sequence[bool] | torch.Tensor) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        if x.dtype != torch.bool or x.dim() != 1:
            raise ValueError(f"{name} must be a 1-D bool tensor, got {x.dtype} {tuple(x.shape)}")
        return x.cpu()
    if not all(isinstance(v, bool) for v in x):
        raise ValueError(f"{name} must hold Python bools (one per completion)")
    return torch.tensor(list(x), dtype=torch.bool)


def routing_labels(
    is_rh: Sequence[bool] | torch.Tensor, eligible: torch.Tensor, rh_detector_recall: float,
    false_positive_rate: float, seed: int, step: int, process: int = 0,
) -> tuple[torch.Tensor, dict[str, int]]:
    """``is_bad`` per sample from the detector's ``is_rh`` and the ``eligible`` mask (see the module
    docstring) and logging counts."""
    for name, value in (("rh_detector_recall", rh_detector_recall), ("false_positive_rate", false_positive_rate)):
        _check_frac(name, value)
    detected, eligible = _bool_vector("is_rh", is_rh), _bool_vector("eligible", eligible)
    n = len(detected)
    if n == 0:
        raise ValueError("routing_labels got no samples")
    if len(eligible) != n:
        raise ValueError(f"eligible has {len(eligible)} entries for {n} samples")
    flagged = detected & eligible
    negatives = (eligible & ~detected).nonzero().flatten()
    fp = _pick(negatives, _count(false_positive_rate, len(negatives)), _generator(seed, step, process, "fp"))
    flagged[fp] = True
    candidates = flagged.nonzero().flatten()
    is_bad = torch.zeros(n, dtype=torch.bool)
    kept = _pick(candidates, _count(rh_detector_recall, len(candidates)), _generator(seed, step, process, "recall"))
    is_bad[kept] = True
    stats = {
        "n_samples": n, "n_eligible": int(eligible.sum()), "n_detected": int(detected.sum()),
        "n_detected_eligible": int((detected & eligible).sum()), "n_false_positive": len(fp),
        "n_flagged": len(candidates), "n_bad": int(is_bad.sum()),
    }
    return is_bad, stats
