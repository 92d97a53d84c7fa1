"""The batch schema (trl_ext/batch.py) on hand-made batches: required and forbidden keys per feature, shapes, label
dtypes, and the loss mask."""

from __future__ import annotations

import pytest
import torch

from trl_ext.batch import BatchContext, BatchFeatures, check_batch, check_context, loss_mask


def batch(B=2, P=3, C=4, **extra):
    out = {"prompt_ids": torch.zeros(B, P, dtype=torch.long), "prompt_mask": torch.ones(B, P, dtype=torch.long),
           "completion_ids": torch.zeros(B, C, dtype=torch.long), "completion_mask": torch.ones(B, C, dtype=torch.long),
           "advantages": torch.zeros(B)}  # fmt: skip
    out.update(extra)
    return out


def test_plain_batch_passes():
    check_batch(batch(), BatchFeatures())


def test_full_feature_batch_passes():
    b = batch(tool_mask=torch.ones(2, 4), sampling_per_token_logps=torch.zeros(2, 4),
              behaviour_versions=torch.zeros(2, 4, dtype=torch.long), is_rh=torch.zeros(2, dtype=torch.bool),
              is_bad=torch.zeros(2, dtype=torch.bool), distill_lp_teacher=torch.zeros(2, 4), distill_gate=torch.ones(2))
    check_batch(b, BatchFeatures(env=True, offpolicy=True, detector=True, labelled=True, distill_teacher_tokens=True,
                                 distill_gate=True))  # fmt: skip


@pytest.mark.parametrize("features,missing", [
    (BatchFeatures(env=True), "tool_mask"),
    (BatchFeatures(offpolicy=True), "sampling_per_token_logps"),
    (BatchFeatures(detector=True), "is_rh"),
    (BatchFeatures(labelled=True), "is_bad"),
    (BatchFeatures(distill_teacher_tokens=True), "distill_lp_teacher"),
])
def test_a_feature_without_its_key_fails(features, missing):
    with pytest.raises(ValueError, match=f"'{missing}' is missing"):
        check_batch(batch(), features)


def test_a_project_key_of_a_feature_that_is_off_fails():
    with pytest.raises(ValueError, match="'is_bad' is present, but the run has it off"):
        check_batch(batch(is_bad=torch.zeros(2, dtype=torch.bool)), BatchFeatures())
    # TRL may carry sampling log-probs on its own (vLLM importance correction): allowed either way when on-policy
    check_batch(batch(sampling_per_token_logps=torch.zeros(2, 4)), BatchFeatures())


@pytest.mark.parametrize("extra,message", [
    (dict(tool_mask=torch.ones(2, 5)), "'tool_mask' has shape"),
    (dict(advantages=torch.zeros(3)), "'advantages' has shape"),
    (dict(prompt_mask=torch.ones(2, 2)), "prompt ids"),
])
def test_misaligned_shapes_fail(extra, message):
    with pytest.raises(ValueError, match=message):
        check_batch(batch(**extra), BatchFeatures(env="tool_mask" in extra))


def test_labels_must_be_bool():
    with pytest.raises(ValueError, match="'is_rh' must be bool"):
        check_batch(batch(is_rh=torch.zeros(2)), BatchFeatures(detector=True))


def test_loss_mask_is_real_agent_tokens():
    b = batch(completion_mask=torch.tensor([[1, 1, 1, 0]]), tool_mask=torch.tensor([[1, 0, 1, 1]]), B=1)
    assert loss_mask(b).tolist() == [[1, 0, 1, 0]]
    assert loss_mask(batch(B=1, completion_mask=torch.tensor([[1, 1, 0, 0]]))).tolist() == [[1, 1, 0, 0]]


def test_batch_context_lines_up_with_the_batch():
    """The batch context of 2 completions (4 tokens each) in a generation batch of 6 with 1 reward function."""
    rows = [{"prompt": "a"}, {"prompt": "b"}]
    good = BatchContext(rows, "train", trajectories=["t0", "t1"], rewards=torch.zeros(6, 1),
                        local_rewards=torch.zeros(2, 1), teacher_logprobs=torch.zeros(2, 4), columns={"env": [1, 2]})
    check_context(good, batch())
    for bad, message in [
        (BatchContext(rows[:1], "train"), "1 rows for 2 completions"),
        (BatchContext(rows, "train", trajectories=["t0"]), "1 episodes for 2 completions"),
        (BatchContext(rows, "train", rewards=torch.zeros(6, 1), local_rewards=torch.zeros(3, 1)), "rewards"),
        (BatchContext(rows, "train", rewards=torch.zeros(6, 1)), "rewards"),  # the local rows are missing
        (BatchContext(rows, "train", teacher_logprobs=torch.zeros(2, 3)), r"teacher log-probs \(2, 3\)"),
        (BatchContext(rows, "train", columns={"env": [1]}), "'env' has 1 values for 2 samples"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_context(bad, batch())
