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
"""

from __future__ import annotations

from dataclasses import dataclass

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
