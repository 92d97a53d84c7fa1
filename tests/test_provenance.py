"""Start weights (`trl_ext.runs.provenance`): exact digests on hand-made files, the resume check, and end to end on
the builtin model (the record holds its weights' digest; a resume from other weights exits 2)."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest
import zygote
import torch

from trl_ext.registry import ConfigError
from trl_ext.runs.provenance import (
    START_WEIGHTS, file_sha256, fingerprint, read_start_weights, record_start_weights, start_id, weights_id,
)

ROOT = Path(__file__).resolve().parents[1]
SHA_ABC = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"  # SHA-256("abc"), FIPS 180-2 example
SHA_EMPTY = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def test_file_sha256_in_chunks_matches_the_standard_vectors(tmp_path):
    (tmp_path / "w.bin").write_bytes(b"abc")
    (tmp_path / "e.bin").write_bytes(b"")
    assert file_sha256(tmp_path / "w.bin", chunk=1) == SHA_ABC  # 3 reads of one byte each
    assert file_sha256(tmp_path / "w.bin") == SHA_ABC
    assert file_sha256(tmp_path / "e.bin") == SHA_EMPTY


def test_directory_fingerprint_hashes_weight_files_only(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"abc")
    (tmp_path / "config.json").write_text("{}")  # not a weight file: a config edit is not a new start
    record = fingerprint("mine", str(tmp_path))
    assert record == {"model": "mine", "path": str(tmp_path.resolve()), "files": {"model.safetensors": SHA_ABC}}
    assert weights_id(record) == SHA_ABC  # one file: its own digest (= build_info.json's weights_sha256)
    (tmp_path / "extra.bin").write_bytes(b"")
    two = fingerprint("mine", str(tmp_path))
    lines = f"extra.bin {SHA_EMPTY}\nmodel.safetensors {SHA_ABC}\n"  # sorted by name
    assert weights_id(two) == hashlib.sha256(lines.encode()).hexdigest()


def test_a_hub_id_is_named_by_the_commit_of_the_snapshot_transformers_loaded(tmp_path, monkeypatch):
    """A hub id, offline, from a cache laid out as huggingface_hub lays it out (refs/<branch> holds the commit,
    snapshots/<commit>/ the files): the record names the snapshot from_pretrained loaded, of the default branch or of
    ``@revision``; a hub id that is not cached, and a directory without weights, are refused."""
    import huggingface_hub.constants
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    commits = {"main": "0123456789abcdef0123456789abcdef01234567", "v2": "89abcdef0123456789abcdef0123456789abcdef"}
    for seed, (branch, commit) in enumerate(commits.items()):
        torch.manual_seed(seed)
        LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2)).save_pretrained(
            repo / "snapshots" / commit)  # fmt: skip
        (repo / "refs" / branch).write_text(commit)
    main = AutoModelForCausalLM.from_pretrained("org/tiny", cache_dir=tmp_path, local_files_only=True)
    v2 = AutoModelForCausalLM.from_pretrained("org/tiny", revision="v2", cache_dir=tmp_path, local_files_only=True)
    assert not torch.equal(main.lm_head.weight, v2.lm_head.weight)  # two snapshots really loaded
    record = fingerprint("org/tiny", "org/tiny")
    assert record == {"model": "org/tiny", "path": "org/tiny", "commit": commits["main"]}
    assert weights_id(record) == f"org/tiny@{commits['main']}"
    assert fingerprint("org/tiny@v2", "org/tiny@v2")["commit"] == commits["v2"]
    with pytest.raises(ConfigError, match="nor in the local hub cache"):
        fingerprint("org/other", "org/other")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no weight file"):
        fingerprint("mine", str(tmp_path / "empty"))


def test_the_path_is_not_part_of_the_identity(tmp_path):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "model.safetensors").write_bytes(b"abc")
    a, b = (fingerprint("m", str(tmp_path / d)) for d in ("a", "b"))
    assert a["path"] != b["path"] and weights_id(a) == weights_id(b)


def test_record_then_check_on_resume(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    same = {"model": "m", "path": "/x", "files": {"model.safetensors": SHA_ABC}}
    moved = {"model": "m", "path": "/elsewhere", "files": {"model.safetensors": SHA_ABC}}
    other = {"model": "m", "path": "/y", "files": {"model.safetensors": SHA_EMPTY}}
    # a run that predates the record: resumed, nothing written (it cannot know what it started from)
    assert "not recorded at this run's start" in record_start_weights(run_dir, same, resumed=True)
    assert read_start_weights(run_dir) is None
    assert record_start_weights(run_dir, same, resumed=False) == f"start weights: {SHA_ABC} (/x)"
    assert json.loads((run_dir / START_WEIGHTS).read_text()) == same
    assert record_start_weights(run_dir, moved, resumed=True) == f"start weights: {SHA_ABC}, as at this run's start"
    with pytest.raises(ConfigError) as e:
        record_start_weights(run_dir, other, resumed=True)
    assert f"weights {SHA_ABC} (/x)" in str(e.value) and f"now loads {SHA_EMPTY} (/y)" in str(e.value)
    assert read_start_weights(run_dir) == same  # the refusal leaves the record alone
    with pytest.raises(ConfigError, match="exists before this fresh run"):
        record_start_weights(run_dir, same, resumed=False)


def test_a_distillation_teacher_is_part_of_the_start(tmp_path):
    policy = {"model": "m", "path": "/x", "files": {"model.safetensors": SHA_ABC}}
    with_teacher = {**policy, "teacher": {"model": "t", "path": "/t", "files": {"model.safetensors": SHA_EMPTY}}}
    assert start_id(policy) == SHA_ABC and start_id(with_teacher) == f"{SHA_ABC}, teacher {SHA_EMPTY}"
    record_start_weights(tmp_path, with_teacher, resumed=False)
    other_teacher = {**policy, "teacher": {"model": "t", "path": "/t", "files": {"model.safetensors": SHA_ABC}}}
    with pytest.raises(ConfigError, match=f"teacher {SHA_ABC}"):  # same policy, another teacher build
        record_start_weights(tmp_path, other_teacher, resumed=True)
    with pytest.raises(ConfigError, match="now loads"):  # the teacher dropped
        record_start_weights(tmp_path, policy, resumed=True)


def test_pinned_search_build_fingerprint_equals_its_build_info():
    pinned = ROOT / "experiments" / "models" / "builtin_search-7693a12a"
    info = json.loads((pinned / "build_info.json").read_text())
    record = fingerprint(str(pinned), str(pinned))
    assert weights_id(record) == info["weights_sha256"] and info["weights_sha256"].startswith("7693a12a")


@pytest.mark.slow
def test_train_py_records_start_weights_and_refuses_a_resume_from_others(builtin_path, tmp_path):
    base = [sys.executable, "train.py", "--reward", "happy_binary", "--batch_size", "4", "--num_generations", "2",
            "--max_completion_length", "8", "--max_steps", "4", "--save_steps", "2", "--logging_steps", "1", "--no_wandb",
            "--output_dir", str(tmp_path)]  # fmt: skip

    def train(*flags):
        return zygote.run([*base, *flags], cwd=ROOT, capture_output=True, text=True)

    def cut_to_checkpoint_2():  # as if killed after checkpoint 2
        shutil.rmtree(run_dir / "checkpoint-4")
        (run_dir / "run_summary.json").unlink()

    first = train()
    assert first.returncode == 0, first.stderr[-3000:]
    (run_dir,) = tmp_path.iterdir()
    built = hashlib.sha256((Path(builtin_path) / "model.safetensors").read_bytes()).hexdigest()
    record = read_start_weights(run_dir)
    assert record["model"] == "builtin" and record["files"] == {"model.safetensors": built}
    assert f"start weights: {built}" in (run_dir / "train.log").read_text()
    cut_to_checkpoint_2()  # a resume from the same weights: test_resume_e2e's SIGKILL tests
    record["files"]["model.safetensors"] = SHA_ABC  # as if the run had started from another build
    (run_dir / START_WEIGHTS).write_text(json.dumps(record))
    refused = train("--resume_from_checkpoint", "latest")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert f"weights {SHA_ABC}" in refused.stderr and f"now loads {built}" in refused.stderr
    assert not (run_dir / "checkpoint-4").exists()


@pytest.mark.slow
def test_train_py_checks_a_rerun_from_a_run_config_against_its_start_weights(builtin_path, tmp_path):
    """Claim (docs/recipes.md "The same start", trl_ext/runs/provenance.py ``start_weights``): a run again from
    another run's run_config.yaml (``train.py @ RUN/run_config.yaml``) starts from that run's start weights. End to
    end, train.py as a process on the builtin model: a 1-step run records its run_config.yaml and start weights; with
    its record saying another build, the rerun from its run_config.yaml exits 2 naming both digests, before training
    (no start weights recorded, no step, no checkpoint; its summary says config_error); with its record as written,
    the rerun trains and records the same start. With train.py's call ignoring the recipe's run (sabotage row
    ``recipe_start_weights``) the first rerun trains."""
    base = [sys.executable, "train.py", "--no_wandb"]

    def train(*flags):
        return zygote.run([*base, *flags], cwd=ROOT, capture_output=True, text=True, timeout=300)

    first = train("--reward", "happy_binary", "--batch_size", "4", "--num_generations", "2", "--max_completion_length",
                  "8", "--max_steps", "1", "--save_steps", "1", "--logging_steps", "1", "--output_dir",
                  str(tmp_path / "a"))  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    (run_dir,) = (tmp_path / "a").iterdir()
    config, record = run_dir / "run_config.yaml", read_start_weights(run_dir)
    built = hashlib.sha256((Path(builtin_path) / "model.safetensors").read_bytes()).hexdigest()
    assert record["files"] == {"model.safetensors": built}
    (run_dir / START_WEIGHTS).write_text(json.dumps({**record, "files": {"model.safetensors": SHA_ABC}}))
    refused = train("@", str(config), "--output_dir", str(tmp_path / "b"))
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert f"weights {SHA_ABC}" in refused.stderr and f"now loads {built}" in refused.stderr
    assert "would not reproduce it" in refused.stderr
    (again_dir,) = (tmp_path / "b").iterdir()
    assert again_dir.name == run_dir.name and read_start_weights(again_dir) is None
    assert not list(again_dir.glob("checkpoint-*"))
    assert json.loads((again_dir / "run_summary.json").read_text())["status"] == "config_error"
    assert "'loss'" not in (again_dir / "train.log").read_text()
    (run_dir / START_WEIGHTS).write_text(json.dumps(record))
    again = train("@", str(config), "--output_dir", str(tmp_path / "c"))
    assert again.returncode == 0, again.stderr[-3000:]
    (again_dir,) = (tmp_path / "c").iterdir()
    assert start_id(read_start_weights(again_dir)) == start_id(record)
    assert (again_dir / "checkpoint-1" / "checkpoint_complete.json").is_file()
