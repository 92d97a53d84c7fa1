"""Resume on families that transformers 5 saves under other key names (GPT-NeoX's head is ``embed_out`` on disk):
the resumed run must train the saved weights, not the base model's. HF's own resume loads non-strictly and would keep
the untrained head; ``runs.lifecycle.RunLifecycle._load_from_checkpoint`` renames the keys back and checks them."""

from __future__ import annotations

import shutil

import pytest
import safetensors.torch
import torch

import trl_ext.cli_train as cli
from trl_ext.models.tiny import build_tiny


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt_neox", "llama"])
def test_full_resume_equals_uninterrupted(builtin_path, tmp_path, family):
    model = build_tiny(family, tmp_path / family)
    flags = ["--model", str(model), "--prompts", "builtin", "--reward", "sentence_length_5_smooth", "--batch_size", "4", "--num_generations",
             "2", "--max_completion_length", "8", "--max_steps", "2", "--save_steps", "1", "--logging_steps", "1",
             "--lr", "1e-3", "--beta", "0", "--no_wandb"]  # fmt: skip
    assert cli.main([*flags, "--output_dir", str(tmp_path / "a")]) == 0
    (run_a,) = (tmp_path / "a").iterdir()
    run_b = tmp_path / "b" / run_a.name
    shutil.copytree(run_a, run_b)
    for p in (run_b / "checkpoint-2", run_b / "run_summary.json"):  # as if killed after checkpoint 1
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    assert cli.main([*flags, "--output_dir", str(tmp_path / "b"), "--resume_from_checkpoint", "latest"]) == 0
    a = safetensors.torch.load_file(str(run_a / "checkpoint-2" / "model.safetensors"))
    b = safetensors.torch.load_file(str(run_b / "checkpoint-2" / "model.safetensors"))
    one = safetensors.torch.load_file(str(run_a / "checkpoint-1" / "model.safetensors"))
    assert a.keys() == b.keys()
    head = "embed_out.weight" if family == "gpt_neox" else "lm_head.weight"
    if head in a:
        assert not torch.equal(a[head], one[head])  # the head trains: a stale head would show
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]
