"""A sequence-classification reward model bound in config.yaml (``{model: path/to/rm}``).

For training, the checkpoint path goes to GRPOTrainer's ``reward_funcs`` as TRL accepts one: TRL loads it with
``AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)`` and scores ``prompt + completion``
(chat data: the chat template of prompt and completion) with ``logits[:, 0]`` (GRPOTrainer._calculate_rewards).
The project passes TRL the checkpoint's own tokenizer as its ``reward_processing_classes`` entry, loaded by
``trl_ext.models.load_tokenizer`` (the saved class as saved). Elsewhere (``--eval_rewards``, ``--base_reward``,
eval_run.py) :meth:`RewardModelSpec.score` does the same computation with a model it loads on first use.

Checked at config load without loading weights (:func:`check_reward_model`): the directory exists, its
config.json names a ``*ForSequenceClassification`` architecture with a single score (``num_labels`` 1, from
``id2label``), and it holds weights and a tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from trl_ext.registry import ConfigError

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")  # fmt: skip
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass
class RewardModelSpec:
    """A checked reward-model checkpoint; ``score`` loads it on first use (on CUDA when available)."""

    path: Path
    architecture: str
    _loaded: tuple | None = field(default=None, repr=False)

    def tokenizer(self):
        """The checkpoint's tokenizer, as TRL gets it (PAD falls back to EOS, as GRPOTrainer sets it)."""
        from trl_ext.models import load_tokenizer

        tok = load_tokenizer(str(self.path))
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        return tok

    def score(self, prompts: list, completions: list) -> list[float]:
        """``logits[:, 0]`` of ``prompt + completion``, right-padded, without special tokens (as TRL 1.16's
        GRPOTrainer._calculate_rewards scores a reward model); chat data through the tokenizer's chat template."""
        import torch
        from trl.data_utils import apply_chat_template, is_conversational

        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
        model, tok = self._load()
        if prompts and is_conversational({"prompt": prompts[0]}):
            texts = [apply_chat_template({"messages": p + c}, tok)["text"] for p, c in zip(prompts, completions)]
        else:
            texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        enc = tok(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
        with torch.inference_mode():
            return model(**enc.to(model.device)).logits[:, 0].float().tolist()

    def _load(self):
        if self._loaded is None:
            import torch
            from transformers import AutoModelForSequenceClassification

            tok = self.tokenizer()
            model = AutoModelForSequenceClassification.from_pretrained(self.path, num_labels=1)
            model.config.get_text_config().pad_token_id = tok.pad_token_id  # the last non-pad token is scored
            self._loaded = (model.to("cuda" if torch.cuda.is_available() else "cpu").eval(), tok)
        return self._loaded


def check_reward_model(path_text: object, base_dir: Path) -> RewardModelSpec:
    """The checkpoint ``path_text`` names (relative to the config file's directory ``base_dir``), checked from its
    files (module docstring); ConfigError naming what is wrong."""
    if not isinstance(path_text, str) or not path_text:
        raise ConfigError(f"model must be a checkpoint directory path, got {path_text!r}")
    path = Path(path_text).expanduser()
    path = (path if path.is_absolute() else base_dir / path).resolve()
    if not path.is_dir():
        raise ConfigError(f"reward model {path_text!r} is not a directory (looked for {path})")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"reward model {path} has no config.json")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"reward model {config_file} is not JSON: {e}") from None
    archs = [a for a in config.get("architectures") or [] if str(a).endswith("ForSequenceClassification")]
    if not archs:
        raise ConfigError(f"reward model {path}: config.json architectures {config.get('architectures')!r} name no "
                          "*ForSequenceClassification model (a reward model scores a sequence)")  # fmt: skip
    labels = len(config["id2label"]) if config.get("id2label") else config.get("num_labels", 2)
    if labels != 1:
        raise ConfigError(f"reward model {path} has {labels} labels; a reward model has a single score "
                          "(num_labels 1)")  # fmt: skip
    if not any((path / f).is_file() for f in WEIGHT_FILES):
        raise ConfigError(f"reward model {path} has no weights ({', '.join(WEIGHT_FILES)})")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(f"reward model {path} has no tokenizer ({', '.join(TOKENIZER_FILES)}): TRL scores its "
                          "texts with the reward model's own tokenizer")  # fmt: skip
    return RewardModelSpec(path=path, architecture=archs[0])
