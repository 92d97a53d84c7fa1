"""Tiny randomly initialised causal LMs of other architectures, built offline from their configs.

A researcher's model family can be tested without its weights: ``AutoConfig.for_model(model_type, ...)`` plus
``AutoModelForCausalLM.from_config`` gives a model of that family at a few hundred thousand parameters, saved with
a builtin tokenizer (``--model builtin`` or ``builtin_env``'s) so that every prompt and reward of the project works
on it. The weights are random: such a model trains and samples, it does not write stories.

    uv run python -m trl_ext.models.tiny qwen3 output/tiny-qwen3            # then --model output/tiny-qwen3
    uv run python -m trl_ext.models.tiny phi3 out/phi3 --tokenizer builtin_env --chat_template

A chat model (``--chat_template``, or ``chat_template=`` of `build_tiny`): the tokenizer gets one of
``CHAT_TEMPLATES``, small Jinja templates written in what the builtin WordPiece vocabularies encode without [UNK]
(``tags``: ``<user> ... </user> <assistant> ...`` for builtin_env's, which has ``< > /``; ``words``: ``user , ... !
assistant , ...`` for the builtin story tokenizer, which has only ``! , . ?`` besides letters). The bare flag picks
the first that ``--tokenizer`` encodes without [UNK]; a name or a Jinja file picks one. `with_chat_template` gives
any saved model (``builtin_env``'s pretrained weights) a template. A template whose rendering has [UNK] is refused.

A tool-calling model: ``--tokenizer bytes`` (`trl_ext.models.byte_tokenizer`, a byte-level BPE) with
``--chat_template trl:qwen2_5`` (TRL's own template file, whose tool calls TRL parses) and ``--positions 4096`` (TRL's
tool loop stops at the context length); environments/search_tools.py and its tests use it.

``FAMILIES`` lists the architectures (their transformers ``model_type``); every one is built with the same
size (``SIZE``) where its config has the field. Sliding-window families get a window larger than any sequence the
tests use unless ``sliding_window`` is given.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from trl_ext.models.byte_tokenizer import trl_template  # noqa: F401 (re-exported: --chat_template trl:NAME)

SIZE = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, "positions": 512}
SEED = 0

# model_type -> its config fields, from SIZE (families name the same quantities differently)
_FIELDS = {
    "llama": "llama", "qwen2": "llama", "qwen3": "llama", "mistral": "llama", "olmo2": "llama", "phi3": "llama",
    "gemma2": "gemma", "gemma3_text": "gemma", "gpt2": "gpt2", "gpt_neox": "gpt_neox",
}  # fmt: skip
FAMILIES = tuple(_FIELDS)
"""Architectures the factory builds, by transformers ``model_type``."""

# Every turn renders as "<open> content <close> " and the generation prompt is the assistant turn's opening, so an
# agent turn renders verbatim right after the prompt (what multi-turn environments need, `env.episodes`). No
# newlines: builtin_env's normaliser writes a newline as " | ".
CHAT_TEMPLATES = {
    "tags": ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} </{{ m['role'] }}> {% endfor %}"
             "{% if add_generation_prompt %}<assistant> {% endif %}"),
    "words": ("{% for m in messages %}{{ m['role'] }} , {{ m['content'] }} ! {% endfor %}"
              "{% if add_generation_prompt %}assistant , {% endif %}"),
}  # fmt: skip
"""Chat templates for the builtin tokenizers, by name (module docstring)."""
CHAT_TEMPLATE = CHAT_TEMPLATES["tags"]
"""The chat template of builtin_env's tokenizer (``< > /`` are in its vocabulary)."""
_PROBE = [{"role": "system", "content": "rules"}, {"role": "user", "content": "hello"},
          {"role": "assistant", "content": "hi"}, {"role": "user", "content": "go"}]  # fmt: skip


def check_positions(positions: int | None) -> None:
    """ValueError unless ``positions`` (a context length) is None (``SIZE``'s) or an int >= 1."""
    if positions is not None and (isinstance(positions, bool) or not isinstance(positions, int) or positions < 1):
        raise ValueError(f"positions must be an int >= 1, got {positions!r}")


def tiny_config(model_type: str, vocab_size: int, eos_token_id: int, sliding_window: int | None = None,
                positions: int | None = None):
    """The config of a tiny ``model_type`` model (see the module docstring); ``positions``: its context length
    (default ``SIZE["positions"]``)."""
    from transformers import AutoConfig

    if model_type not in _FIELDS:
        raise ValueError(f"unknown tiny model family {model_type!r}; families: {', '.join(FAMILIES)}")
    check_positions(positions)
    s = {**SIZE, "positions": SIZE["positions"] if positions is None else positions}
    kind = _FIELDS[model_type]
    common = {"vocab_size": vocab_size, "eos_token_id": eos_token_id, "bos_token_id": None, "pad_token_id": eos_token_id}
    if kind == "gpt2":
        fields = {"n_embd": s["hidden"], "n_layer": s["layers"], "n_head": s["heads"], "n_inner": s["intermediate"],
                  "n_positions": s["positions"]}  # fmt: skip
    elif kind == "gpt_neox":
        fields = {"hidden_size": s["hidden"], "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
                  "intermediate_size": s["intermediate"], "max_position_embeddings": s["positions"]}  # fmt: skip
    else:
        fields = {"hidden_size": s["hidden"], "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
                  "num_key_value_heads": s["kv_heads"], "intermediate_size": s["intermediate"],
                  "max_position_embeddings": s["positions"], "head_dim": s["hidden"] // s["heads"]}  # fmt: skip
        if kind == "gemma":
            fields |= {"query_pre_attn_scalar": s["hidden"] // s["heads"],
                       "sliding_window": sliding_window or s["positions"]}  # fmt: skip
        elif model_type in ("mistral", "qwen2", "qwen3") and sliding_window is not None:
            fields |= {"sliding_window": sliding_window, "use_sliding_window": True}
    return AutoConfig.for_model(model_type, **fields, **common)


def unknown_tokens(tok, chat_template: str) -> int:
    """How many [UNK] ids ``tok`` encodes a probe conversation rendered by ``chat_template`` into (0 without UNK)."""
    text = tok.apply_chat_template(_PROBE, chat_template=chat_template, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return 0 if tok.unk_token_id is None else ids.count(tok.unk_token_id)


def chat_template_for(tok, choice: str | None = None) -> str:
    """The Jinja text of ``choice`` for ``tok``: a ``CHAT_TEMPLATES`` name, ``trl:NAME`` (`trl_template`), a path to
    a Jinja file, or None for the first builtin template ``tok`` encodes without [UNK]. Raises ValueError when the
    template renders to [UNK]."""
    if choice is None:
        for template in CHAT_TEMPLATES.values():
            if unknown_tokens(tok, template) == 0:
                return template
        raise ValueError(f"no builtin chat template ({', '.join(CHAT_TEMPLATES)}) encodes without [UNK] in this "
                         "tokenizer: pass a Jinja file")  # fmt: skip
    template = trl_template(choice[len("trl:"):]) if choice.startswith("trl:") else CHAT_TEMPLATES.get(choice)
    if template is None:
        path = Path(choice)
        if not path.is_file():
            raise ValueError(f"--chat_template {choice!r} is neither one of {', '.join(CHAT_TEMPLATES)}, trl:NAME "
                             "nor a file")
        template = path.read_text()
    check_template(tok, template, repr(choice))
    return template


def check_template(tok, chat_template: str, name: str = "the chat template") -> None:
    """ValueError when ``chat_template`` renders a probe conversation to [UNK] tokens in ``tok``."""
    unk = unknown_tokens(tok, chat_template)
    if unk:
        raise ValueError(f"chat template {name} renders a probe conversation to {unk} [UNK] tokens in this "
                         "tokenizer: its markers are not in the vocabulary")  # fmt: skip


def with_chat_template(source: str, out_dir: str | Path, chat_template: str | None = None) -> Path:
    """Copy the saved model ``source`` (a builtin name or a directory) to ``out_dir`` with ``chat_template``
    (`chat_template_for`'s choice) set on its tokenizer: a chat model with the source's (pretrained) weights."""
    import shutil

    from trl_ext.models import load_tokenizer

    src = Path(tokenizer_source(source))
    tok = load_tokenizer(str(src))
    tok.chat_template = chat_template_for(tok, chat_template)
    out = Path(out_dir)
    shutil.copytree(src, out, dirs_exist_ok=True)
    tok.save_pretrained(out)
    return out


def tokenizer_source(tokenizer: str) -> str:
    """The directory of a builtin model (``builtin``, ``builtin_env``, ...) whose tokenizer a tiny model uses, or a
    path to any tokenizer."""
    from trl_ext.models import model_source

    return model_source(tokenizer)


def tiny_tokenizer(tokenizer: str):
    """The tokenizer a tiny model is built with: ``bytes`` (`byte_tokenizer`: a byte-level BPE that renders and
    decodes any chat template exactly, the one for tool calling), or `tokenizer_source`'s."""
    if tokenizer == "bytes":
        from trl_ext.models.byte_tokenizer import byte_tokenizer

        return byte_tokenizer()
    from trl_ext.models import load_tokenizer

    return load_tokenizer(tokenizer_source(tokenizer))


def build_tiny(model_type: str, out_dir: str | Path, tokenizer: str = "builtin", seed: int = SEED,
               chat_template: str | None = None, sliding_window: int | None = None,
               positions: int | None = None, overrides: dict | None = None) -> Path:
    """Build and save a tiny random ``model_type`` model with ``tokenizer``'s tokenizer into ``out_dir``
    (``overrides``: config fields set over the tiny size, e.g. ``{"num_attention_heads": 2}``).

    ``chat_template`` (Jinja text; ValueError when its rendering has [UNK] in this tokenizer) is set on the saved
    tokenizer (a chat model's). Deterministic in ``seed``. Returns ``out_dir``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer(tokenizer)
    if chat_template is not None:
        check_template(tok, chat_template)
        tok.chat_template = chat_template
    config = tiny_config(model_type, len(tok), tok.eos_token_id, sliding_window, positions)
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    info = {"family": model_type, "tokenizer": tokenizer, "seed": seed, "size": SIZE, "positions": SIZE["positions"]
            if positions is None else positions, "chat_template": chat_template
            is not None, "parameters": sum(p.numel() for p in model.parameters()),
            **({"overrides": overrides} if overrides else {})}  # fmt: skip
    (out / "tiny_info.json").write_text(json.dumps(info, indent=2))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Build a tiny random model of an architecture (offline).")
    p.add_argument("family", choices=FAMILIES)
    p.add_argument("out_dir")
    p.add_argument("--tokenizer", default="builtin", help="a builtin model name, a tokenizer path, or bytes (a "
                   "byte-level BPE for published chat templates: trl_ext.models.byte_tokenizer)")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--sliding_window", type=int, default=None)
    p.add_argument("--positions", type=int, default=None, help=f"context length (default {SIZE['positions']}; TRL's "
                   "tool loop stops a rollout at it)")
    p.add_argument("--chat_template", nargs="?", const="", default=None, metavar="NAME_OR_FILE",
                   help=f"give the tokenizer a chat template: {' or '.join(CHAT_TEMPLATES)} (CHAT_TEMPLATES), trl:NAME "
                        "(TRL's published templates, e.g. trl:qwen2_5 with --tokenizer bytes: tool calling), a Jinja "
                        "file, or bare: the first builtin one the tokenizer encodes without [UNK]")  # fmt: skip
    args = p.parse_args(argv)
    template = None
    if args.chat_template is not None:
        try:
            template = chat_template_for(tiny_tokenizer(args.tokenizer), args.chat_template or None)
        except ValueError as e:
            p.error(str(e))
    try:
        check_positions(args.positions)  # a usage error before anything is built
    except ValueError as e:
        p.error(str(e))
    out = build_tiny(args.family, args.out_dir, args.tokenizer, args.seed, template, args.sliding_window,
                     args.positions)
    print(out)


if __name__ == "__main__":
    main()


def build_tiny_in_hub_cache(model_type: str, hub_cache: str | Path, repo_id: str, **kwargs) -> Path:
    """`build_tiny` laid out as huggingface_hub caches a downloaded repository (``models--org--name/snapshots/<commit>``,
    ``refs/main`` naming the commit) under ``hub_cache`` (``$HF_HOME/hub``): ``repo_id`` then loads by its hub id with
    ``HF_HUB_OFFLINE=1``, as a user's downloaded model does. Returns the snapshot directory."""
    import hashlib

    repo = Path(hub_cache) / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo_id} {model_type} {sorted(kwargs.items())}".encode()).hexdigest()
    snapshot = build_tiny(model_type, repo / "snapshots" / commit, **kwargs)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot
