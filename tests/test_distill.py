"""Context distillation: reward composition on hand-made tensors, teacher inputs and teacher log-probs.

Expected values are derived by hand in the comments. ``X`` marks a masked position: it holds NaN, so any
leak of a masked value into a result would show.
"""

import math

import pytest
import torch

from trl_ext.distill.advantages import (
    DistillConfig, distill_advantages, distill_metrics, full_reward_advantages, kl_gate, sequence_rewards, token_kl_bonus,
)
from trl_ext.distill.teacher import build_teacher_inputs, teacher_logprobs
from trl_ext.registry import ConfigError

X = float("nan")


def cfg(**overrides) -> DistillConfig:
    fields = dict(
        adv_tau=1.0,
        teacher_tau=0.5,
        student_tau=0.25,
        use_full_reward_baseline=True,
        kl_only_incorrect=False,
        skip_verification=False,
        teacher_context="",
    )
    return DistillConfig(**{**fields, **overrides})


# Two groups of 2 sequences, 3 completion tokens each.
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
LP_TEACHER = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, X], [-4.0, X, X], [-1.0, -1.0, -1.0]])
# masked sums t = [-6, -1, -4, -3]
LP_STUDENT = torch.tensor([[-2.0, -2.0, -2.0], [-1.0, -1.0, X], [-1.0, X, X], [-0.5, -0.5, -1.0]])
# masked sums s = [-6, -2, -1, -2]
LP_TRAINER = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, X], [-3.0, X, X], [-4.0, -4.0, -4.0]])


def test_sequence_rewards_and_advantages_two_groups():
    task = torch.tensor([1.0, 0.0, 0.0, 0.0])
    # R = task + 0.5*t - 0.25*s
    # r0 = 1 - 3 + 1.5 = -0.5; r1 = 0 - 0.5 + 0.5 = 0; r2 = 0 - 2 + 0.25 = -1.75; r3 = 0 - 1.5 + 0.5 = -1
    rewards = sequence_rewards(task, LP_TEACHER, LP_STUDENT, MASK, cfg())
    assert rewards.tolist() == [-0.5, 0.0, -1.75, -1.0]
    # group means -0.25 and -1.375
    expected = [-0.25, 0.25, -0.375, 0.375]
    assert full_reward_advantages(rewards, 2).tolist() == expected
    result = distill_advantages(task, LP_TEACHER, LP_STUDENT, MASK, cfg(), group_size=2)
    assert result.advantages.tolist() == expected
    assert result.gate is None and not result.token_level and result.token_bonus is None


def test_full_reward_advantages_group_of_three():
    rewards = torch.tensor([1.0, 2.0, 6.0, 0.0, 0.0, 3.0])  # group means 3 and 1
    assert full_reward_advantages(rewards, 3).tolist() == [-2.0, -1.0, 3.0, -1.0, -1.0, 2.0]


@pytest.mark.parametrize("kl_only_incorrect", [False, True])
def test_full_reward_advantages_sum_to_zero_per_group(kl_only_incorrect):
    gen = torch.Generator().manual_seed(0)
    mask = (torch.rand(12, 5, generator=gen) > 0.3).long()
    lp_t, lp_s = -torch.rand(12, 5, generator=gen) * 3, -torch.rand(12, 5, generator=gen) * 3
    task = (torch.rand(12, generator=gen) > 0.5).float()
    result = distill_advantages(task, lp_t, lp_s, mask, cfg(kl_only_incorrect=kl_only_incorrect), group_size=4)
    torch.testing.assert_close(result.advantages.view(3, 4).sum(1), torch.zeros(3), atol=1e-6, rtol=0)
    assert result.advantages.abs().sum() > 0.1


def test_gate_table():
    # all incorrect -> 1.0, all correct -> 0.0, 1/4 correct -> 0.75 (group size 4)
    task = torch.tensor([0.0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 0])
    assert kl_gate(task, 4).tolist() == [1.0] * 4 + [0.0] * 4 + [0.75] * 4


def test_gate_rejects_rewards_outside_unit_interval():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        kl_gate(torch.tensor([0.0, 2.0]), 2)


def test_gated_sequence_advantages():
    task = torch.tensor([1.0, 0.0, 1.0, 1.0])  # gates 1 - 0.5 = 0.5 and 1 - 1 = 0
    # KL part k = 0.5*t - 0.25*s = [-1.5, 0, -1.75, -1]; R = task + g*k = [0.25, 0, 1, 1]
    # group means 0.125 and 1
    result = distill_advantages(task, LP_TEACHER, LP_STUDENT, MASK, cfg(kl_only_incorrect=True), group_size=2)
    assert result.gate.tolist() == [0.5, 0.5, 0.0, 0.0]
    assert result.parts.total.tolist() == [0.25, 0.0, 1.0, 1.0]
    assert result.advantages.tolist() == [0.125, -0.125, 0.0, 0.0]


def test_per_token_path():
    task = torch.tensor([1.0, 0.0, 0.0, 0.0])
    lp_trainer = LP_TRAINER.clone().requires_grad_(True)
    c = cfg(use_full_reward_baseline=False)
    result = distill_advantages(task, LP_TEACHER, LP_STUDENT, MASK, c, group_size=2, lp_trainer=lp_trainer)
    assert result.token_level
    assert result.advantages.tolist() == [0.5, -0.5, 0.0, 0.0]  # adv_tau*(task - group mean) only
    # bonus = 0.5*lp_teacher - 0.25*lp_trainer, 0 where masked
    expected = [[-0.25, -0.75, -1.25], [0.25, 0.25, 0.0], [-1.25, 0.0, 0.0], [0.5, 0.5, 0.5]]
    assert result.token_bonus.tolist() == expected
    assert not result.token_bonus.requires_grad
    assert token_kl_bonus(LP_TEACHER, lp_trainer, MASK, c).tolist() == expected


def test_per_token_path_gated():
    task = torch.tensor([1.0, 0.0, 1.0, 1.0])  # gates [0.5, 0.5, 0, 0]
    c = cfg(use_full_reward_baseline=False, kl_only_incorrect=True)
    result = distill_advantages(task, LP_TEACHER, LP_STUDENT, MASK, c, group_size=2)
    assert result.token_bonus is None  # no lp_trainer at scoring time: the loss adds it
    assert result.advantages.tolist() == [0.5, -0.5, 0.0, 0.0]
    bonus = token_kl_bonus(LP_TEACHER, LP_TRAINER, MASK, c, result.gate)
    assert bonus.tolist() == [[-0.125, -0.375, -0.625], [0.125, 0.125, 0.0], [0.0] * 3, [0.0] * 3]


def test_token_bonus_gate_must_match_config():
    with pytest.raises(ValueError, match="kl_only_incorrect is set"):
        token_kl_bonus(LP_TEACHER, LP_TRAINER, MASK, cfg(use_full_reward_baseline=False, kl_only_incorrect=True))
    with pytest.raises(ValueError, match="kl_only_incorrect is off"):
        token_kl_bonus(LP_TEACHER, LP_TRAINER, MASK, cfg(use_full_reward_baseline=False), torch.ones(4))
    with pytest.raises(ValueError, match="already in the sequence advantages"):
        token_kl_bonus(LP_TEACHER, LP_TRAINER, MASK, cfg())


def test_pure_distillation_needs_no_task_reward():
    c = cfg(adv_tau=0.0, teacher_tau=1.0, student_tau=1.0, skip_verification=True)
    # R = t - s = [0, 1, -3, -1]; group means 0.5 and -2
    result = distill_advantages(None, LP_TEACHER, LP_STUDENT, MASK, c, group_size=2)
    assert result.advantages.tolist() == [-0.5, 0.5, -1.0, 1.0]
    with pytest.raises(ValueError, match="skip_verification is set"):
        distill_advantages(torch.zeros(4), LP_TEACHER, LP_STUDENT, MASK, c, group_size=2)
    with pytest.raises(ValueError, match="task rewards"):
        distill_advantages(None, LP_TEACHER, LP_STUDENT, MASK, cfg(), group_size=2)


def test_zero_tau_terms_need_no_logprobs_but_positive_ones_do():
    task = torch.tensor([1.0, 0.0, 0.0, 0.0])
    # pure task RL: R = task, no teacher and no student log-probs
    assert sequence_rewards(task, None, None, MASK, cfg(teacher_tau=0.0, student_tau=0.0)).tolist() == task.tolist()
    with pytest.raises(ValueError, match="lp_teacher"):
        sequence_rewards(task, None, LP_STUDENT, MASK, cfg())


def test_metrics():
    task = torch.tensor([1.0, 0.0, 0.0, 0.0])
    result = distill_advantages(task, LP_TEACHER, LP_STUDENT, MASK, cfg(), group_size=2)
    metrics = distill_metrics(result, LP_TEACHER, LP_STUDENT, MASK)
    # token diffs s - t: row0 -1,0,1; row1 -0.5,-0.5; row2 3; row3 0.5,0.5,0 -> 3 over 9 tokens
    assert metrics == pytest.approx(
        {
            "distill/teacher_logp_sum": (-6 - 1 - 4 - 3) / 4,
            "distill/student_logp_sum": (-6 - 2 - 1 - 2) / 4,
            "distill/kl": 3 / 9,
            "distill/reward_task": 0.25,
            "distill/reward_teacher": 0.5 * -3.5,
            "distill/reward_student": -0.25 * -2.75,
            "distill/reward": (-0.5 + 0.0 - 1.75 - 1.0) / 4,
        },
        abs=1e-7,
    )
    task = torch.tensor([1.0, 0, 1, 1])  # gates [0.5, 0.5, 0, 0]
    gated = distill_advantages(task, LP_TEACHER, LP_STUDENT, MASK, cfg(kl_only_incorrect=True), group_size=2)
    assert distill_metrics(gated, LP_TEACHER, LP_STUDENT, MASK)["distill/gate_mean"] == 0.25


# ------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize(
    "overrides, group_size, batch_size, teacher, message",
    [
        (dict(teacher_tau=1.0), 2, 4, False, "needs a teacher"),
        (dict(adv_tau=1.0, skip_verification=True), 2, 4, True, "adv_tau must be 0"),
        (dict(adv_tau=-1.0), 2, 4, True, "adv_tau must be a finite number >= 0"),
        (dict(teacher_tau=-0.1), 2, 4, True, "teacher_tau must be"),
        (dict(student_tau=-0.1), 2, 4, True, "student_tau must be"),
        (dict(student_tau=math.nan), 2, 4, True, "student_tau must be"),
        (dict(teacher_tau=0.0, student_tau=0.0, kl_only_incorrect=True), 2, 4, True, "no KL term to gate"),
        (dict(), 3, 8, True, "batch size 8 is not divisible by the group size 3"),
        (dict(adv_tau=0.0, skip_verification=True, kl_only_incorrect=True), 2, 4, True, "skip_verification"),
        (dict(adv_tau=0.0, teacher_tau=0.0, student_tau=0.0), 2, 4, True, "all 0"),
    ],
)
def test_validation_errors(overrides, group_size, batch_size, teacher, message):
    with pytest.raises(ConfigError, match=message):
        cfg(**overrides).validate(group_size=group_size, batch_size=batch_size, teacher_available=teacher)


@pytest.mark.parametrize(
    "overrides, teacher",
    [  # the seed's common configurations
        (dict(teacher_tau=0.0, student_tau=0.0), False),  # pure task RL, no teacher
        (dict(teacher_tau=1.0, student_tau=1.0), True),  # hybrid
        (dict(teacher_tau=0.01, student_tau=0.01, kl_only_incorrect=True), True),  # gated
        (dict(adv_tau=0.0, teacher_tau=1.0, student_tau=1.0, skip_verification=True), True),  # pure distillation
        (dict(teacher_tau=0.01, student_tau=0.01, use_full_reward_baseline=False), True),  # token-level
    ],
)
def test_valid_configurations(overrides, teacher):
    cfg(**overrides).validate(group_size=4, batch_size=16, teacher_available=teacher)


# ------------------------------------------------------------------------------------------ teacher inputs
def test_build_teacher_inputs_layout():
    prompt_ids = torch.tensor([[0, 0, 3, 4], [5, 6, 7, 9]])
    prompt_mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    completion_ids = torch.tensor([[10, 11, 0], [12, 0, 0]])
    completion_mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    ids, mask, keep = build_teacher_inputs([7, 8], prompt_ids, prompt_mask, completion_ids, completion_mask, 0)
    # [7, 8, 3, 4] (4 tokens) and [7, 8, 5, 6, 7, 9] (6 tokens), left-padded to 6
    assert ids.tolist() == [[0, 0, 7, 8, 3, 4, 10, 11, 0], [7, 8, 5, 6, 7, 9, 12, 0, 0]]
    assert mask.tolist() == [[0, 0, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1, 0, 0]]
    assert keep == 3
    # empty context = the student's prompt (surplus pad columns dropped)
    prompt_ids, prompt_mask = torch.tensor([[0, 0, 3], [0, 5, 6]]), torch.tensor([[0, 0, 1], [0, 1, 1]])
    ids, mask, _ = build_teacher_inputs([], prompt_ids, prompt_mask, completion_ids[:, :1], completion_mask[:, :1], 0)
    assert ids.tolist() == [[0, 3, 10], [5, 6, 12]] and mask.tolist() == [[0, 1, 1], [1, 1, 1]]


def test_build_teacher_inputs_keeps_bos_first():
    prompt_ids, prompt_mask = torch.tensor([[0, 2, 3], [2, 4, 5]]), torch.tensor([[0, 1, 1], [1, 1, 1]])
    completion_ids, completion_mask = torch.tensor([[6], [6]]), torch.ones(2, 1)
    ids, _, _ = build_teacher_inputs([9], prompt_ids, prompt_mask, completion_ids, completion_mask, 0, bos_id=2)
    assert ids.tolist() == [[0, 2, 9, 3, 6], [2, 9, 4, 5, 6]]


def test_build_teacher_inputs_rejects_right_padded_prompts():
    prompt_ids, prompt_mask = torch.tensor([[3, 0]]), torch.tensor([[1, 0]])
    with pytest.raises(ValueError, match="left-padded"):
        build_teacher_inputs([1], prompt_ids, prompt_mask, torch.tensor([[4]]), torch.ones(1, 1), 0)


# ------------------------------------------------------------------------------------------ teacher log-probs
def _tiny_model(kind):
    """A random float32 causal LM: Llama (rotary positions) or GPT-2 (absolute positions, so a left-padded
    row matches its unpadded forward only with position ids taken from the attention mask)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        config = GPT2Config(
            vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=64, initializer_range=0.3,
            bos_token_id=1, eos_token_id=1,
        )
        return GPT2LMHeadModel(config).float()
    config = LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3,
        attn_implementation=kind.removeprefix("llama-"),
    )
    return LlamaForCausalLM(config).float()


def _direct_logprobs(model, sequence, n_prompt, temperature):
    """log p(token_j | tokens before j) for the tokens after ``n_prompt`` in one unpadded forward."""
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0].double() / temperature
    logps = torch.log_softmax(logits, -1)
    return torch.tensor([logps[j - 1, sequence[j]] for j in range(n_prompt, len(sequence))])


@pytest.mark.parametrize("kind", ["llama-eager", "llama-sdpa", "gpt2"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_teacher_logprobs_match_unpadded_forward(kind, temperature):
    model = _tiny_model(kind)
    model.train()  # the teacher scores in eval mode and restores the mode
    context = [11, 12, 13]
    prompts = [[21, 22], [23, 24, 25, 26, 27], [28]]  # left-padded to 5
    completions = [[31, 32, 33, 34], [35], [36, 37]]  # right-padded to 4
    pad = 0
    prompt_ids = torch.tensor([[pad] * (5 - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (5 - len(p)) + [1] * len(p) for p in prompts])
    completion_ids = torch.tensor([c + [pad] * (4 - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (4 - len(c)) for c in completions])

    ids, mask, keep = build_teacher_inputs(context, prompt_ids, prompt_mask, completion_ids, completion_mask, pad)
    lp = teacher_logprobs(model, ids, mask, keep, temperature)
    assert model.training and lp.shape == (3, 4) and not lp.requires_grad
    model.eval()  # GPT-2 has dropout: the reference forward runs without it, as the teacher does
    for i, (p, c) in enumerate(zip(prompts, completions)):
        expected = _direct_logprobs(model, context + p + c, len(context) + len(p), temperature)
        torch.testing.assert_close(lp[i, : len(c)].double(), expected, atol=1e-5, rtol=0)
        assert lp[i, len(c) :].tolist() == [0.0] * (4 - len(c))
    # the check is sensitive: log-probs are far from uniform, and the context changes them
    assert lp[mask[:, -keep:].bool()].std() > 0.1
    no_context = _direct_logprobs(model, prompts[1] + completions[1], len(prompts[1]), temperature)
    assert (lp[1, 0] - no_context[0]).abs() > 1e-3
    # chunking the rows gives the same values
    chunked = teacher_logprobs(model, ids, mask, keep, temperature, batch_size=1)
    torch.testing.assert_close(chunked, lp, atol=1e-6, rtol=0)
