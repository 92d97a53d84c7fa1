"""The teacher's side of context distillation: its inputs (the context prepended to plain-text prompts, or given as
the system message of chat prompts, as the prime-rl fork 'contextual_learning' does) and its log-probs of the
student's agent tokens. Reward composition: `trl_ext.distill.advantages`."""

from __future__ import annotations

import torch
from torch import Tensor
from trl.trainer.utils import pad


def encode_context(tokenizer, text: str) -> list[int]:
    """Token ids of the teacher context, without special tokens (they belong to the prompt)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def build_teacher_inputs(
    context_ids: list[int],
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    pad_id: int,
    bos_id: int | None = None,
) -> tuple[Tensor, Tensor, int]:
    """The teacher's ``(input_ids, attention_mask, logits_to_keep)`` for ``context + prompt + completion``.

    ``prompt_ids``/``prompt_mask`` ``[B, P]`` are left-padded, ``completion_ids``/``completion_mask``
    ``[B, C]`` right-padded (TRL's layout). Each prompt's padding is removed, ``context_ids`` is prepended
    (after a leading ``bos_id`` when given, so BOS stays first), and the rows are left-padded again to a
    common width; the completion block is appended unchanged, so ``logits_to_keep = C``.
    """
    if prompt_ids.shape != prompt_mask.shape or completion_ids.shape != completion_mask.shape:
        raise ValueError("ids and masks must have the same shapes")
    if prompt_ids.size(0) != completion_ids.size(0):
        raise ValueError(f"{prompt_ids.size(0)} prompts but {completion_ids.size(0)} completions")
    keep = prompt_mask.bool()
    if (keep[:, 1:] < keep[:, :-1]).any():
        raise ValueError("prompt_mask must be left-padded (zeros, then ones, in every row)")
    context = torch.as_tensor(context_ids, dtype=prompt_ids.dtype, device=prompt_ids.device)
    rows = []
    for ids, row_keep in zip(prompt_ids, keep):
        real = ids[row_keep]
        if bos_id is not None and real.numel() and int(real[0]) == bos_id:
            rows.append(torch.cat([real[:1], context, real[1:]]))
        else:
            rows.append(torch.cat([context, real]))
    return teacher_batch(rows, completion_ids, completion_mask, pad_id)


def teacher_batch(
    prompt_rows: list[Tensor], completion_ids: Tensor, completion_mask: Tensor, pad_id: int
) -> tuple[Tensor, Tensor, int]:
    """``(input_ids, attention_mask, logits_to_keep)``: the teacher's unpadded prompt rows left-padded to a common
    width, then the (right-padded) completion block unchanged, so ``logits_to_keep = C``."""
    if len(prompt_rows) != completion_ids.size(0) or completion_ids.shape != completion_mask.shape:
        raise ValueError(f"{len(prompt_rows)} teacher prompts for completions {tuple(completion_ids.shape)} with mask "
                         f"{tuple(completion_mask.shape)}")  # fmt: skip
    if min(row.numel() for row in prompt_rows) == 0:
        raise ValueError("a row has neither context nor prompt tokens: its first completion token has no logit")
    rows = [row.to(completion_ids.device, completion_ids.dtype) for row in prompt_rows]
    teacher_ids = pad(rows, padding_value=pad_id, padding_side="left")
    teacher_mask = pad([torch.ones_like(row) for row in rows], 0, "left")
    input_ids = torch.cat([teacher_ids, completion_ids], dim=1)
    attention_mask = torch.cat([teacher_mask, completion_mask.to(teacher_mask.dtype)], dim=1)
    return input_ids, attention_mask, completion_ids.size(1)


def teacher_messages(messages: list[dict], context: str) -> list[dict]:
    """The teacher's chat prompt: the student's ``messages`` with ``context`` as the system message.

    As the reference fork ('contextual_learning' at bcf0a7b, ``orchestrator/orchestrator.py`` and
    ``eval/utils.py``): the content of the student's first system message is replaced by the context (the
    student's own instructions are not shown to the teacher: put what it must keep into the context); without a
    system message, one is inserted first. Every other message is kept; ``messages`` is not modified. An empty
    context returns the messages unchanged (standard distillation).
    """
    out = [dict(m) for m in messages]
    if not context:
        return out
    for m in out:
        if m.get("role") == "system":
            m["content"] = context
            return out
    return [{"role": "system", "content": context}, *out]


def chat_teacher_prompt(student_ids: list[int], student_rendered: list[int], teacher_rendered: list[int]) -> list[int]:
    """The teacher's prompt ids for a chat prompt: its rendered messages (``teacher_messages``), then whatever the
    student's prompt ids hold after the student's own rendered messages (an environment's ``<think>`` prefill).
    A student prompt that does not start with its rendered messages raises ValueError: the context's place in it
    would be a guess."""
    if list(student_ids[: len(student_rendered)]) != list(student_rendered):
        raise ValueError("the student's prompt ids do not start with its chat-rendered messages: cannot place the "
                         "teacher context as the system message")  # fmt: skip
    return list(teacher_rendered) + list(student_ids[len(student_rendered) :])


@torch.no_grad()
def teacher_logprobs(
    model,
    input_ids: Tensor,
    attention_mask: Tensor,
    logits_to_keep: int,
    temperature: float,
    batch_size: int | None = None,
    score_mask: Tensor | None = None,
) -> Tensor:
    """Per-token log-probs ``[B, C]`` of the last ``logits_to_keep`` tokens under ``model``, 0 where masked:
    outside the attention mask, and outside ``score_mask`` ``[B, C]`` when given (environment tokens, which the
    teacher reads as context but does not score).

    Logits are divided by the sampling ``temperature`` (as TRL scores the student), log-softmax in float32.
    Position ids come from the attention mask, so a left-padded row scores as its unpadded sequence would.
    The model runs in eval mode (no dropout; its mode is restored) and without gradients. Select the teacher
    before calling (e.g. ``with model.disable_adapter():``). ``batch_size`` chunks the rows to bound the
    ``[rows, C, vocab]`` logits memory.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 1 <= logits_to_keep < input_ids.size(1):
        raise ValueError(f"logits_to_keep must be in [1, {input_ids.size(1) - 1}], got {logits_to_keep}")
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    step = batch_size or input_ids.size(0)
    was_training = model.training
    model.eval()
    try:
        chunks = []
        for start in range(0, input_ids.size(0), step):
            rows = slice(start, start + step)
            logits = model(
                input_ids=input_ids[rows],
                attention_mask=attention_mask[rows],
                position_ids=position_ids[rows],
                logits_to_keep=logits_to_keep + 1,
                use_cache=False,
            ).logits
            # the logit at position t predicts token t+1: drop the last, keep the C before it
            logits = logits[:, -(logits_to_keep + 1) : -1].float() / temperature
            targets = input_ids[rows, -logits_to_keep:]
            chunks.append(logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1))
    finally:
        model.train(was_training)
    logps = torch.cat(chunks)
    scored = attention_mask[:, -logits_to_keep:].bool()
    if score_mask is not None:
        if score_mask.shape != scored.shape:
            raise ValueError(f"score_mask {tuple(score_mask.shape)} does not match the completion {tuple(scored.shape)}")
        scored = scored & score_mask.bool()
    return torch.where(scored, logps, 0.0)
