"""The builtin_mood variant: its title steers the mood (the premise of the distillation experiment)."""

from __future__ import annotations

import json

import pytest
import torch

import trl_ext.cli_train as cli
from trl_ext import models
from trl_ext.models.builtin_mood import TEACHER_CONTEXT, VERSION, builtin_mood_dir, ensure_builtin_mood


@pytest.fixture(scope="session")
def mood_path(builtin_cache):
    """The built builtin_mood model (built once, ~3 minutes on 2 cores, if not cached)."""
    return ensure_builtin_mood()


def test_model_names_resolve_to_their_builds(monkeypatch, tmp_path):
    calls = []
    for name in models.BUILTIN_MODELS:
        monkeypatch.setitem(models.BUILTIN_MODELS, name, lambda rebuild, name=name: calls.append((name, rebuild)) or
                            tmp_path / name)  # fmt: skip
    assert models.model_source("builtin_mood") == str(tmp_path / "builtin_mood")
    assert models.model_source("builtin_env", rebuild=True) == str(tmp_path / "builtin_env")
    assert calls == [("builtin_mood", False), ("builtin_env", True)]
    assert models.model_source("SimpleStories/SimpleStories-1.25M") == "SimpleStories/SimpleStories-1.25M"
    monkeypatch.setenv("TRL_EXT_CACHE", str(tmp_path))
    assert builtin_mood_dir() == tmp_path / f"builtin-mood-{VERSION}"


def test_mood_model_prompts_are_the_builtin_stories():
    plan = cli.build_plan(["--reward", "happy_binary", "--model", "builtin_mood", "--output_dir", "/tmp/unused"])
    assert cli.prompt_source(plan.run) == "builtin"
    assert "builtin-mood" in plan.cfg.run_name


@pytest.mark.slow
def test_title_raises_happy_only_when_it_says_happy(mood_path):
    """Next-token probability of "happy" at a feeling slot, with and without a title (direct forward passes)."""
    from transformers import AutoModelForCausalLM

    from trl_ext.models import load_tokenizer
    tok = load_tokenizer(mood_path)
    model = AutoModelForCausalLM.from_pretrained(mood_path).eval()
    happy = tok.convert_tokens_to_ids("happy")

    def p_happy(text: str) -> float:
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            return model(ids).logits[0, -1].softmax(-1)[happy].item()

    slot = "Mia loved to play at the park. Mia felt"
    plain, titled, sad = p_happy(slot), p_happy(f"{TEACHER_CONTEXT} {slot}"), p_happy(f"A sad story. {slot}")
    assert titled > 0.5 and titled > 5 * plain and sad < plain, (plain, titled, sad)  # measured 0.066, 0.92, 0.002
    info = json.loads((mood_path / "build_info.json").read_text())
    assert info["sample_happy_rate"] <= 0.25 and info["teacher_sample_happy_rate"] >= info["sample_happy_rate"] + 0.3
