"""Reference computations shared by the sampler tests (imported as ``from reference import ...``: pytest puts tests/
on the path)."""

from __future__ import annotations

import torch

EOS = 1


def trainer_logprobs(model, prompts, completions, temperature, generate_positions=False, full=False):
    """Log-probs of the completions under one forward of the left-padded rows as TRL's trainer runs it (input ids and
    attention mask, no position ids: positions 0..len-1 over the padded row), from the raw logits / temperature.
    ``generate_positions``: positions counted from each row's first real token instead, as ``transformers.generate``
    numbers them. ``full``: also the log-softmax over the vocabulary at every completion position."""
    width, length = max(map(len, prompts)), max(map(len, completions))
    ids = torch.full((len(prompts), width + length), EOS)
    attention = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ids[i, width - len(p) : width + len(c)] = torch.tensor(p + c)
        attention[i, width - len(p) : width + len(c)] = 1
    extra = {"position_ids": (attention.cumsum(-1) - 1).clamp_min(0)} if generate_positions else {}
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention, **extra).logits[:, width - 1 : -1]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    all_lp = logits.log_softmax(-1)
    lp = all_lp.gather(2, ids[:, width:, None]).squeeze(2)
    out = [lp[i, : len(c)].tolist() for i, c in enumerate(completions)]
    return (out, all_lp) if full else out


def word_tokenizer(words: str, chat_template: str | None = None):
    """A word-level tokenizer over ``words`` (space-separated; "[UNK]" and "[EOS]" among them), splitting on
    whitespace and punctuation and decoding with spaces between tokens; PAD = EOS, left padding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = words.split()
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Punctuation()])
    backend.decoder = decoders.WordPiece(prefix="##")  # joins tokens with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="[EOS]", pad_token="[EOS]")
    tok.padding_side = "left"
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok
