"""A byte-level BPE tokenizer built offline, for tiny models that speak a published chat template.

The builtin WordPiece vocabularies cannot render the chat templates that TRL knows how to parse (Qwen's
``<|im_start|>``, ``<tool_call>`` with a JSON body, newlines), and a WordPiece decode does not give the text back
(``< tool _ call >``). Tool calling (TRL's ``environment_factory`` / ``tools=``) needs both: the template renders the
tool schema and the tool results, and TRL parses the decoded completion with the template's response schema.

`byte_tokenizer` trains a byte-level BPE (GPT-2's pre-tokenizer and byte alphabet: every string encodes, no [UNK],
and decoding gives the text back exactly) with the ``tokenizers`` library on a fixed text (the search corpus, its
questions, the search tools' JSON schemas, Qwen2.5's default system turn and a few tool calls: 1047 entries), and
adds Qwen's special tokens. It is deterministic: the same text and ``vocab_size`` give the same vocabulary. ``EOS``
is Qwen's end of turn, so generation stops at the end of an assistant turn as it does with a Qwen model.
"""

from __future__ import annotations

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS = "<|im_end|>"
ADDED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
"""Qwen's added (not special) tokens: they decode as text, so the response parser sees them."""
VOCAB_SIZE = 2048
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."  # Qwen2.5's default system turn


def _training_text() -> list[str]:
    """What the merges are learned from (module docstring)."""
    import json

    from transformers.utils import get_json_schema

    from environments.search import DEFAULT_CORPUS_SEED, DEFAULT_PAGES
    from environments.search_corpus import build_corpus
    from environments.search_tools import SearchTools

    corpus = build_corpus(DEFAULT_PAGES, DEFAULT_CORPUS_SEED)
    lines = [p.text for p in corpus.pages] + [q.text for q in corpus.questions]
    lines += [json.dumps(get_json_schema(getattr(SearchTools, name)))
              for name in ("search", "read", "answer")] * 20
    lines += [QWEN_SYSTEM] * 20
    lines += [f'<tool_call>\n{{"name": "{verb}", "arguments": {{"{arg}": "{p.title}"}}}}\n</tool_call>'
              for p in corpus.pages[:50] for verb, arg in (("search", "query"), ("read", "title"))]  # fmt: skip
    return lines


def byte_tokenizer(vocab_size: int = VOCAB_SIZE, lines: list[str] | None = None):
    """A ``PreTrainedTokenizerFast``: byte-level BPE of at most ``vocab_size`` entries learned from ``lines`` (default:
    the module docstring's text), EOS ``<|im_end|>``, PAD ``<|endoftext|>``, no chat template (set one:
    ``trl_ext.models.tiny``). Loaded back from a model's directory it is the tokenizer class of the model's type
    (``AutoTokenizer``: a Qwen2 model's splits numbers into digits, "2000" one token here and four there): train a
    model on the ids of the tokenizer as loaded (`trl_ext.models.builtin_tools.as_loaded`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(_training_text() if lines is None else lines, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token="<|endoftext|>")
    fast.add_tokens(list(ADDED))
    return fast


def trl_template(name: str) -> str:
    """The Jinja text of TRL's published chat template ``name`` (``trl/chat_templates/NAME.jinja``: ``qwen2_5``,
    ``qwen3``, ``llama3_2``, ...; those TRL parses tool calls of, `trl.chat_template_utils.add_response_schema`)."""
    from importlib.resources import files

    path = files("trl") / "chat_templates" / f"{name}.jinja"
    if not path.is_file():
        known = sorted(p.name[: -len(".jinja")] for p in (files("trl") / "chat_templates").iterdir()
                       if p.name.endswith(".jinja"))  # fmt: skip
        raise ValueError(f"--chat_template trl:{name}: TRL ships no such template; it has {', '.join(known)}")
    return path.read_text()
