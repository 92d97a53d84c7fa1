"""The builtin model (cache, lock, tokenizer conventions, shape) and model loading."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from trl_ext.models import builtin as builtin_model
from trl_ext.models.builtin import REQUIRED_FILES, VERSION, ensure_builtin
from trl_ext.models import load_model_and_tokenizer, model_source, load_tokenizer, prepare_tokenizer, resolve_model_arg
from trl_ext.registry import ConfigError


# ---------------------------------------------------------------- cache, lock, atomic build (fake builder)
@pytest.fixture
def fake_build(monkeypatch, tmp_path):
    monkeypatch.setenv("TRL_EXT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(builtin_model, "PINNED_DIR", tmp_path / "no-pinned-builds")  # build, not install
    calls = []

    def build(out_dir: Path, module: str):
        calls.append(out_dir)
        time.sleep(0.3)  # long enough for concurrent callers to queue on the lock
        for name in REQUIRED_FILES:
            (out_dir / name).write_text(str(len(calls)))

    monkeypatch.setattr(builtin_model, "_build_in_subprocess", build)
    return calls


def test_cache_dir_from_env_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv("TRL_EXT_CACHE", str(tmp_path))
    assert builtin_model.builtin_dir() == tmp_path / f"builtin-{VERSION}"
    monkeypatch.delenv("TRL_EXT_CACHE")
    assert builtin_model.cache_dir() == Path.home() / ".cache" / "trl_ext"


def test_concurrent_callers_build_once_then_reuse(fake_build, tmp_path):
    results = []
    threads = [threading.Thread(target=lambda: results.append(ensure_builtin())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    target = tmp_path / "cache" / f"builtin-{VERSION}"
    assert results == [target] * 3 and len(fake_build) == 1
    assert fake_build[0].parent == target.parent and fake_build[0] != target  # built elsewhere, then renamed
    assert ensure_builtin() == target and len(fake_build) == 1
    assert sorted(p.name for p in target.parent.iterdir()) == [f"builtin-{VERSION}", f"builtin-{VERSION}.lock"]


def test_rebuild_replaces_the_model(fake_build, tmp_path):
    target = ensure_builtin()
    assert (target / "config.json").read_text() == "1"
    assert ensure_builtin(rebuild=True) == target and len(fake_build) == 2
    assert (target / "config.json").read_text() == "2"
    assert sorted(p.name for p in target.parent.iterdir()) == [f"builtin-{VERSION}", f"builtin-{VERSION}.lock"]


def test_failed_build_leaves_nothing_and_incomplete_dir_fails_loudly(monkeypatch, tmp_path):
    monkeypatch.setenv("TRL_EXT_CACHE", str(tmp_path))
    monkeypatch.setattr(builtin_model, "PINNED_DIR", tmp_path / "no-pinned-builds")

    def broken(out_dir, module):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("boom")

    monkeypatch.setattr(builtin_model, "_build_in_subprocess", broken)
    with pytest.raises(RuntimeError, match="boom"):
        ensure_builtin()
    assert [p.name for p in tmp_path.iterdir()] == [f"builtin-{VERSION}.lock"]
    (tmp_path / f"builtin-{VERSION}").mkdir()
    with pytest.raises(RuntimeError, match="incomplete.*--rebuild"):
        ensure_builtin()


def test_lr_schedule():
    b = builtin_model
    assert b._lr(0, b.STEPS) == pytest.approx(b.PEAK_LR / b.WARMUP_STEPS)
    assert b._lr(b.WARMUP_STEPS - 1, b.STEPS) == pytest.approx(b.PEAK_LR)
    assert b._lr(b.WARMUP_STEPS, b.STEPS) == pytest.approx(b.PEAK_LR)  # cosine starts at the peak
    middle = b.WARMUP_STEPS + (b.STEPS - b.WARMUP_STEPS) / 2
    assert b._lr(middle, b.STEPS) == pytest.approx(b.PEAK_LR * (b.MIN_LR_FRACTION + (1 - b.MIN_LR_FRACTION) / 2))
    assert b._lr(b.STEPS, b.STEPS) == pytest.approx(b.PEAK_LR * b.MIN_LR_FRACTION)


# ---------------------------------------------------------------- --model validation (nothing loaded)
def test_resolve_model_arg(tmp_path):
    assert resolve_model_arg("builtin") == "builtin"
    assert resolve_model_arg("SimpleStories/SimpleStories-1.25M") == "SimpleStories/SimpleStories-1.25M"
    assert resolve_model_arg(str(tmp_path)) == str(tmp_path)
    for missing in ("./no_such_model", "/no/such/model", "~/no_such_model_dir_xyz", "../no_such"):
        with pytest.raises(ConfigError, match="--model path does not exist: " + missing.replace(".", r"\.")):
            resolve_model_arg(missing)
    with pytest.raises(ConfigError, match="must not be empty"):
        resolve_model_arg("")


def test_prepare_tokenizer_requires_eos():
    from tokenizers import Tokenizer, models

    no_eos = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, "[UNK]")))
    with pytest.raises(ValueError, match="no EOS token"):
        prepare_tokenizer(no_eos)


# ---------------------------------------------------------------- the built model (session fixture)
def test_tokenizer_conventions(builtin_path):
    tok = load_tokenizer(builtin_path)
    assert tok.convert_tokens_to_ids(["[UNK]", "[EOS]"]) == [0, 1]
    assert tok.unk_token_id == 0 and tok.eos_token_id == 1
    assert tok.bos_token is None and tok.pad_token is None and len(tok) <= 4096
    plain = tok("Mia felt happy.", add_special_tokens=False)["input_ids"]
    assert len(plain) == 4 and 1 not in plain  # mia, felt, happy, .
    assert tok("Mia felt happy.")["input_ids"] == plain + [1]
    assert tok.decode(plain) == "mia felt happy."  # lowercase normalizer, WordPiece decoder


def test_model_shape_matches_simplestories_1_25m(builtin_path):
    model, tok = load_model_and_tokenizer("builtin")
    c = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (4, 128, 4, 2)
    assert (c.intermediate_size, c.max_position_embeddings, c.tie_word_embeddings) == (341, 512, True)
    assert c.eos_token_id == 1 and c.bos_token_id is None and c.vocab_size == len(tok)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # tied embedding + 4 x (q,o 128x128; k,v 128x64; gate,up,down 128x341; 2 norms of 128) + final norm
    per_layer = 2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 341 + 2 * 128
    assert sum(p.numel() for p in model.parameters()) == len(tok) * 128 + 4 * per_layer + 128
    assert tok.pad_token_id == 1 and tok.padding_side == "left"
    assert model.generation_config.eos_token_id == 1


def test_build_info(builtin_path):
    info = json.loads((builtin_path / "build_info.json").read_text())
    assert info["version"] == VERSION and info["steps"] == builtin_model.STEPS
    assert info["corpus_stories"] == builtin_model.CORPUS_STORIES
    assert 0.0 < info["sample_happy_rate"] < 0.3  # a minority: RL has work to do
    assert info["sample_unique_fraction"] >= 0.95
    assert info["final_loss"] < 1.6


def test_local_copy_loads_with_identical_logits(builtin_path, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(builtin_path, copy)
    assert model_source("builtin") == str(builtin_path) and model_source(str(copy)) == str(copy)
    a, tok_a = load_model_and_tokenizer("builtin")
    b, tok_b = load_model_and_tokenizer(str(copy))
    texts = ["Mia felt happy. She", "One day, Leo went to the"]
    ids = tok_a(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    assert ids["input_ids"].tolist() == tok_b(texts, add_special_tokens=False, padding=True)["input_ids"]
    assert ids["input_ids"][0, 0] == 1 and ids["attention_mask"][0, 0] == 0  # left-padded with EOS
    with torch.no_grad():
        assert torch.equal(a(**ids).logits, b(**ids).logits)


def test_cli_prints_path_and_build_info(builtin_path):
    out = subprocess.run([sys.executable, "-m", "trl_ext.models.builtin"], capture_output=True, text=True, check=True)
    path, info = out.stdout.split("\n", 1)
    assert path == str(builtin_path)
    assert json.loads(info)["version"] == VERSION


def test_save_build_records_the_weights_hash(tmp_path):
    """Builds differ across machines, so build_info.json names the weights it describes by their SHA-256."""
    import hashlib

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))  # fmt: skip
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    info = builtin_model.save_build(tmp_path, model, tok, {"final_loss": 0.5}, time.time(), lambda _: None)
    weights = hashlib.sha256((tmp_path / "model.safetensors").read_bytes()).hexdigest()
    assert info["weights_sha256"] == weights and info["torch"] == torch.__version__
    assert json.loads((tmp_path / "build_info.json").read_text())["weights_sha256"] == weights
