"""The batch schema: the one dict every stage of ExtGRPOTrainer's batch flow reads and extends (``trl_ext/trainer.py``).

TRL 1.16's GRPOTrainer builds the dict; the project's stages add keys; TRL's shuffle and split then keep every
per-sample tensor aligned (the reason the project's values ride in the dict, not on the trainer). ``B`` samples,
``P`` prompt tokens (left-padded), ``C`` completion tokens (right-padded). Every key, who writes it, and when:

=========================  ==========  ===========  ========================================================
key                        shape       written by   present
=========================  ==========  ===========  ========================================================
prompt_ids, prompt_mask    [B, P]      source       always
completion_ids             [B, C]      source       always
completion_mask            [B, C]      source       always (1 = a real token, 0 = padding)
tool_mask                  [B, C]      source       ``--env`` or TRL tools: 1 = agent token, 0 = environment token
sampling_per_token_logps   [B, C]      source       ``--max_async_level >= 1``: behaviour log-probs (0 off mask)
behaviour_versions         [B, C]      scorer       ``--max_async_level >= 1``: policy version of every token
old_per_token_logps        [B, C]      TRL          when TRL needs them (num_iterations > 1, IS correction)
ref_per_token_logps        [B, C]      TRL          ``--beta > 0``
advantages                 [B]         estimator    always
num_items_in_batch         scalar      TRL          always
is_rh                      [B] bool    scorer       an RH detector is configured
is_bad                     [B] bool    scorer       routing labels (routing or a baseline arm), training
distill_lp_teacher         [B, C]      scorer       distillation's token path with ``--teacher_tau > 0``
distill_gate               [B]         scorer       distillation's token path with ``--kl_only_incorrect``
record_index               [B] long    records      ``--token_records_every``, a due step: the sample's row in the
                                                    generation batch (the token records' join key)
=========================  ==========  ===========  ========================================================

The loss mask of every loss, ratio, importance mask and KL is ``completion_mask * tool_mask`` (`loss_mask`):
environment tokens are read (they condition later turns) but never trained on, scored by a teacher, or weighed.
`check_batch` verifies a batch against the schema for the features a run has on (every generation batch).

Beside the dict, the stages hand each other batch-wide values in a `BatchContext` (a new one for every generation
batch: the rows, the gathered rewards, environment episodes, routing's and distillation's estimator inputs, the
teacher's log-probs, saved-rollout columns), checked by `check_context`. Nothing of a batch lives on the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

ALWAYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")
TOKEN_KEYS = ("completion_mask", "tool_mask", "sampling_per_token_logps", "behaviour_versions", "old_per_token_logps",
              "ref_per_token_logps", "distill_lp_teacher")
SAMPLE_KEYS = ("advantages", "is_rh", "is_bad", "distill_gate", "record_index")


@dataclass(frozen=True)
class BatchFeatures:
    """Which optional keys a batch must carry (and, for the project's own keys, must not carry otherwise)."""

    env: bool = False
    offpolicy: bool = False
    detector: bool = False
    labelled: bool = False
    distill_teacher_tokens: bool = False
    distill_gate: bool = False

    def required(self) -> dict[str, bool]:
        """Optional key -> True: it must be present; False: it must be absent; None: either (TRL may add it)."""
        return {"tool_mask": self.env, "sampling_per_token_logps": self.offpolicy or None,
                "behaviour_versions": self.offpolicy, "is_rh": self.detector, "is_bad": self.labelled,
                "distill_lp_teacher": self.distill_teacher_tokens, "distill_gate": self.distill_gate}


def loss_mask(batch: dict) -> torch.Tensor:
    """The tokens every loss term trains on: real completion tokens that the agent wrote."""
    mask = batch["completion_mask"]
    return mask if "tool_mask" not in batch else mask * batch["tool_mask"]


def check_batch(batch: dict, features: BatchFeatures) -> None:
    """Raise ValueError when ``batch`` breaks the schema for ``features``: a key missing or unexpected, a shape
    that does not line up with the completions, a label that is not bool."""
    for key in ALWAYS:
        if key not in batch:
            raise ValueError(f"batch schema: {key!r} is missing")
    for key, needed in features.required().items():
        if needed and key not in batch:
            raise ValueError(f"batch schema: {key!r} is missing ({features})")
        if needed is False and key in batch:
            raise ValueError(f"batch schema: {key!r} is present, but the run has it off ({features})")
    B, C = batch["completion_ids"].shape
    if batch["prompt_ids"].shape != batch["prompt_mask"].shape or batch["prompt_ids"].size(0) != B:
        raise ValueError(f"batch schema: prompt ids {tuple(batch['prompt_ids'].shape)} / mask "
                         f"{tuple(batch['prompt_mask'].shape)} do not line up with {B} completions")
    for key in TOKEN_KEYS:
        if batch.get(key) is not None and tuple(batch[key].shape) != (B, C):
            raise ValueError(f"batch schema: {key!r} has shape {tuple(batch[key].shape)}, expected {(B, C)}")
    for key in SAMPLE_KEYS:
        if key in batch and tuple(batch[key].shape) != (B,):
            raise ValueError(f"batch schema: {key!r} has shape {tuple(batch[key].shape)}, expected {(B,)}")
    for key in ("is_rh", "is_bad"):
        if key in batch and batch[key].dtype != torch.bool:
            raise ValueError(f"batch schema: {key!r} must be bool, got {batch[key].dtype}")


@dataclass
class BatchContext:
    """What the stages of one generation batch hand each other beside the batch dict (made fresh for every
    generation batch, in ``_generate_and_score_completions``). Per-sample tensors that must follow TRL's shuffle and
    split ride in the batch dict instead; this holds the batch-wide values."""

    rows: list[dict]
    """TRL's rows of the generation batch (this process's), in the order of its prompts."""
    mode: str
    """``"train"`` or ``"eval"``."""
    trajectories: list | None = None
    """Source: the environment episodes of this process's completions (``--env``), same order."""
    episode_prompts: list | None = None
    """Source: a tool environment's prompts as rendered, per row (messages, ``apply_chat_template`` keyword arguments:
    tools and template), for the teacher's prompt; None for other sources."""
    environments: list | None = None
    """Source: a tool environment's instances per row, which TRL's reward functions get as ``environments=``."""
    rewards: torch.Tensor | None = None
    """Rewards: every process's rewards per function ``[N, F]`` (gathered, TRL's order)."""
    local_rewards: torch.Tensor | None = None
    """Rewards: this process's rows of `rewards`."""
    reward_context: dict = field(default_factory=dict)
    """Rewards: TRL's reward keyword arguments of the batch (`rewards.bound.trl_context`)."""
    routing: dict | None = None
    """Rewards -> scorers: what gradient routing found (labels, gathered flags, base rewards)."""
    routing_arm: Any = None
    """Scorers -> estimator: routing's `trl_ext.estimator.RoutingArm`, or None."""
    distill: Any = None
    """Scorers -> estimator: distillation's `trl_ext.distill.advantages.DistillAdvantages`, or None."""
    teacher_logprobs: torch.Tensor | None = None
    """Scorers: the teacher's log-probs ``[B, C]`` of this process's completions (distillation), or None."""
    pre_advantages: torch.Tensor | None = None
    """Estimator: this process's advantages before the routing arm."""
    advantages: torch.Tensor | None = None
    """Estimator: the whole generation batch's advantages when the estimator replaced TRL's, else None."""
    rollout: Any = None
    """Source: the generator thread's `trl_ext.offpolicy.worker.Rollout` of this batch (off-policy), or None."""
    columns: dict[str, list] = field(default_factory=dict)
    """Any stage -> records: per-sample columns of the saved rollouts (``--save_rollouts``)."""
    eval_rewards: dict[str, list] = field(default_factory=dict)
    """Records: this process's ``--eval_rewards`` values by name."""
    first_row: int = 0
    """This process's first row in the generation batch."""


def check_context(ctx: BatchContext, batch: dict) -> None:
    """Raise ValueError when the batch context does not line up with ``batch`` (this process's ``B`` rows of a
    generation batch of ``N``): rows, episodes, rewards, teacher log-probs, saved-rollout columns."""
    B, C = batch["completion_ids"].shape
    if len(ctx.rows) != B:
        raise ValueError(f"batch context: {len(ctx.rows)} rows for {B} completions")
    if ctx.trajectories is not None and len(ctx.trajectories) != B:
        raise ValueError(f"batch context: {len(ctx.trajectories)} episodes for {B} completions")
    if ctx.rewards is not None and (ctx.rewards.dim() != 2 or ctx.local_rewards is None
                                    or tuple(ctx.local_rewards.shape) != (B, ctx.rewards.size(1))):
        raise ValueError(f"batch context: rewards {tuple(ctx.rewards.shape)} / local rewards do not line up with {B} "
                         "completions")  # fmt: skip
    if ctx.teacher_logprobs is not None and tuple(ctx.teacher_logprobs.shape) != (B, C):
        raise ValueError(f"batch context: teacher log-probs {tuple(ctx.teacher_logprobs.shape)}, expected {(B, C)}")
    for key, values in ctx.columns.items():
        if len(values) != B:
            raise ValueError(f"batch context: saved-rollout column {key!r} has {len(values)} values for {B} samples")
