"""Resolve ``--model`` and load a causal LM with its tokenizer prepared for GRPO generation.

``--model builtin`` is the embedded offline model (``trl_ext.models.builtin``), ``builtin_env``, ``builtin_search``
and ``builtin_mood`` its variants for the environments, for RL on search and for context distillation; anything else
is a local directory or a hub id loaded with ``from_pretrained`` (e.g. ``SimpleStories/SimpleStories-1.25M``:
no BOS, ``[EOS]`` = 1, no PAD, prompts tokenized with ``add_special_tokens=False``, generation until EOS).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from trl_ext.models.builtin import BUILTIN, ensure_builtin
from trl_ext.models.builtin_env import BUILTIN_ENV, ensure_builtin_env
from trl_ext.models.builtin_mood import BUILTIN_MOOD, ensure_builtin_mood
from trl_ext.models.builtin_search import BUILTIN_SEARCH, ensure_builtin_search
from trl_ext.models.builtin_tools import BUILTIN_TOOLS, ensure_builtin_tools
from trl_ext.registry import ConfigError

# --model name -> the function that returns its built directory (building it on first use)
BUILTIN_MODELS = {
    BUILTIN: ensure_builtin, BUILTIN_ENV: ensure_builtin_env, BUILTIN_MOOD: ensure_builtin_mood,
    BUILTIN_SEARCH: ensure_builtin_search, BUILTIN_TOOLS: ensure_builtin_tools,
}  # fmt: skip
STORY_MODELS = (BUILTIN, BUILTIN_MOOD)  # builtin models trained on the builtin stories (their prompts' source)


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", ".", "~")) or os.path.exists(model)


def resolve_model_arg(model: str) -> str:
    """Validate ``--model`` without loading anything: a builtin name, an existing local path, or a hub id."""
    if not model:
        raise ConfigError("--model must not be empty")
    if model in BUILTIN_MODELS:
        return model
    if _looks_like_path(model):
        path = Path(model).expanduser()
        if not path.exists():
            raise ConfigError(f"--model path does not exist: {model}")
        return str(path)
    return model


def model_source(model: str, rebuild: bool = False) -> str:
    """What ``from_pretrained`` loads for ``--model``: the built directory of a builtin model (built on
    first use, or again with ``rebuild``), else the path or hub id.

    Pass this string (not an in-memory model) to GRPOTrainer when beta > 0: TRL reloads the reference
    model from it.
    """
    model = resolve_model_arg(model)
    if model in BUILTIN_MODELS:
        return str(BUILTIN_MODELS[model](rebuild=rebuild))
    return model


def load_tokenizer(source: str):
    """The tokenizer saved at ``source`` (a directory or hub id), as saved.

    transformers 5 replaces the saved class of a few model types (Qwen2, Phi-3, ...: its
    ``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS``) with the family's own tokenizer class, which silently mis-tokenizes
    any other tokenizer saved beside such a model (a tiny Qwen2 with the builtin WordPiece tokenizer split "the dog"
    into letters). A directory whose ``tokenizer_config.json`` names the generic fast class is loaded as that class.
    """
    import json

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config = Path(source) / "tokenizer_config.json"
    if config.is_file() and json.loads(config.read_text()).get("tokenizer_class") in _GENERIC_TOKENIZERS:
        return PreTrainedTokenizerFast.from_pretrained(source)
    return AutoTokenizer.from_pretrained(source)


_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def prepare_tokenizer(tokenizer):
    """Set PAD explicitly to EOS and pad on the left, for batched generation; raises without an EOS token.

    PAD = EOS is safe here: TRL cuts each completion at its first EOS and masks everything after it,
    and masks the left padding of prompts through the attention mask, so a pad id is never trained on
    or attended to. SimpleStories' tokenizer has no PAD token in its vocabulary to use instead.
    """
    if tokenizer.eos_token is None or tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no EOS token; generation could never stop")
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_model_and_tokenizer(model: str, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` for ``--model``; generation stops at the tokenizer's EOS (kept with any other EOS ids)."""
    from transformers import AutoModelForCausalLM

    source = model_source(model)
    tokenizer = prepare_tokenizer(load_tokenizer(source))
    lm = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    eos = lm.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if tokenizer.eos_token_id not in eos:
        eos = [tokenizer.eos_token_id, *eos]
    lm.generation_config.eos_token_id = eos[0] if len(eos) == 1 else eos
    lm.generation_config.pad_token_id = tokenizer.pad_token_id
    return lm, tokenizer
