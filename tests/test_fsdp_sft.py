"""SFT mode (`trl_ext.sft`) under FSDP2 on 2 CPU processes (gloo): one SGD step of 2 FSDP2 processes equal to one
process (full fine-tune and PEFT LoRA, the trained parameters read back through SFT mode's own gather into the main
process's plain copy), and `torchrun --nproc_per_node 2 train.py --mode sft --fsdp` to a merged model, a checkpoint
that eval_run.py's loader loads on one process, and its validation records; a resume from a checkpoint.

This file is also the driver the equivalence test launches (``python tests/test_fsdp_sft.py equivalence OUT MODEL``
under torchrun or alone).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
import zygote
from test_fsdp_features import compare_step
from test_procs import ROOT, torchrun

GLOBAL_BATCH = 8  # 8 arithmetic levels: one record each, so the one step trains every record on 1 and on 2 processes
VARIANTS = ("full", "lora")


def test_sft_mode_parses_under_fsdp():
    """--mode sft --fsdp on 2 processes: accepted while parsing (no refusal), named like any FSDP run."""
    from trl_ext.cli_train import build_plan
    from trl_ext.sweep_plan import planned_processes

    with planned_processes(2):
        plan = build_plan(["--mode", "sft", "--env", "arithmetic", "--model", "builtin_env", "--fsdp"])
    assert plan.run_dir.name.endswith("_procs2_fsdp2") and plan.cfg.fsdp


@pytest.fixture(scope="module")
def tiny_env_model(tmp_path_factory):
    from trl_ext.models.tiny import build_tiny

    return build_tiny("llama", tmp_path_factory.mktemp("tiny") / "llama_env", tokenizer="builtin_env")


@pytest.mark.slow
def test_sft_step_on_fsdp2_equals_one_process(tiny_env_model, tmp_path):
    """One SGD step (lr 1.0) of SFT mode's trainer on 8 arithmetic records: 2 FSDP2 processes x 4 == 1 process x 8
    within 1e-5, full fine-tune and LoRA; the step moves the parameters by more than 1e-2 and the 2-process model is
    sharded (every parameter a DTensor, each process holding about half of the elements)."""
    one, two = tmp_path / "one", tmp_path / "two"
    single = zygote.run([sys.executable, __file__, "equivalence", str(one), str(tiny_env_model)],
                            capture_output=True, text=True, timeout=240, cwd=ROOT)  # fmt: skip
    assert single.returncode == 0, single.stderr[-3000:]
    double = torchrun([__file__, "equivalence", str(two), str(tiny_env_model)], timeout=300)
    assert double.returncode == 0, double.stderr[-3000:]
    found = {}
    for variant in VARIANTS:
        found[variant] = compare_step(one, two, variant)
        losses = [json.loads((d / f"{variant}.json").read_text())["loss"] for d in (one, two)]
        assert abs(losses[0] - losses[1]) < 1e-4, losses  # the logged loss is over both processes' tokens
    print(json.dumps(found))


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", ["4", "0"], ids=["lora", "full"])
def test_torchrun_sft_mode_on_fsdp2(tmp_path, lora_rank):
    """`torchrun --nproc_per_node 2 train.py --mode sft --env arithmetic --fsdp`, LoRA r4 and full: one run, trained
    sharded; the main process loads the gathered shards into its plain copy, merges the LoRA, saves the model and
    validates it (one record before, one after); the saved model loads with from_pretrained and its weights differ
    from the start; the last checkpoint (an adapter, or model.safetensors, which the Trainer gathers itself) loads in
    eval_run.py's loader on one process and holds the same weights as the saved model."""
    from transformers import AutoModelForCausalLM

    from trl_ext.evaluate import detect_checkpoint, load_model
    from trl_ext.models import model_source

    out = tmp_path / "out"
    run_dir = _sft_run(out, "--lora_rank", lora_rank)
    log = (run_dir / "train.log").read_text()
    assert log.count("$ train.py") == 1 and run_dir.name.endswith("_procs2_fsdp2")
    assert "processes: 2 (gloo backend, FSDP2: " in log and "batch: 8 completions per process x 2 processes = 16" in log
    assert log.count("validation before SFT") == 1 and log.count("validation after SFT") == 1
    state = json.loads((run_dir / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == state["max_steps"] == 2
    summary = json.loads((run_dir / "run_summary.json").read_text())
    assert summary["status"] == "done" and summary["records"] == 32
    for key in ("validation_before", "validation_after"):
        assert summary[key]["levels"] == 4 and 0 <= summary[key]["success_rate"] <= 1
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    start = AutoModelForCausalLM.from_pretrained(model_source("builtin_env"))
    assert not any("lora" in k for k in merged.state_dict())
    diff = max((a - b).abs().max().item() for a, b in zip(merged.parameters(), start.parameters(), strict=True))
    assert diff > 1e-6, diff  # the merged LoRA changed the weights (gathered from the shards, not the start copy)
    ckpt = run_dir / "checkpoint-2"
    assert (ckpt / "checkpoint_complete.json").is_file()
    kind = detect_checkpoint(ckpt)
    assert kind == ("peft_lora" if lora_rank != "0" else "plain"), kind
    loaded, _ = load_model(ckpt, kind)  # eval_run.py's loader, on one process
    loaded = loaded.merge_and_unload() if lora_rank != "0" else loaded
    same = max((a - b).abs().max().item() for a, b in zip(merged.parameters(), loaded.parameters(), strict=True))
    assert same < 1e-6, same  # the last checkpoint (the Trainer's own gather) holds the saved model's weights
    print(json.dumps({"diff_from_start": diff, "diff_from_checkpoint": same,
                      **{k: summary[k] for k in ("validation_before", "validation_after")}}))  # fmt: skip


def _sft_run(out: Path, *extra: str) -> Path:
    """`torchrun --nproc_per_node 2 train.py --mode sft --env arithmetic --fsdp`: 32 records at 8 per process, 2 steps,
    a checkpoint at step 2 (``extra`` may change it); the run directory."""
    proc = torchrun(["train.py", "--mode", "sft", "--env", "arithmetic", "--model", "builtin_env", "--sft_train_size",
                     "32", "--sft_test_size", "4", "--sft_epochs", "1", "--batch_size", "8", "--save_steps", "2",
                     "--logging_steps", "1", "--lr", "1e-3", "--max_completion_length", "16", "--no_wandb", "--fsdp",
                     "--output_dir", str(out), *extra], timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = out.iterdir()
    return run_dir


@pytest.mark.slow
def test_sft_mode_on_fsdp2_resumes(tmp_path):
    """A full fine-tune SFT run under FSDP2 with a checkpoint at each step, cut back to checkpoint-1 and resumed on 2
    processes with ``--resume_from_checkpoint latest``: its step-2 checkpoint and its saved model equal the
    uninterrupted run's, bit for bit."""
    import shutil

    import safetensors.torch
    import torch

    run_dir = _sft_run(tmp_path / "out", "--save_steps", "1")
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "out", resumed)
    cut = resumed / run_dir.name
    for gone in ("checkpoint-2", "model"):
        shutil.rmtree(cut / gone)
    (cut / "run_summary.json").unlink()
    again = _sft_run(resumed, "--save_steps", "1", "--resume_from_checkpoint", "latest")
    assert "RESUMED from" in (again / "train.log").read_text()
    for name in ("checkpoint-2/model.safetensors", "model/model.safetensors"):
        a, b = (safetensors.torch.load_file(str(d / name)) for d in (run_dir, again))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert json.loads((again / "run_summary.json").read_text())["status"] == "done"


# ------------------------------------------------------------------------------------------ the equivalence driver
def run_sft_equivalence(out: Path, model_path: str) -> None:
    """One SGD step (lr 1.0) of SFT mode's trainer (`sft_trainer_class`) per `VARIANTS` entry on 8 arithmetic records,
    with ``--fsdp`` on several processes; the main process saves the trainable parameters (under FSDP2: read from its
    plain copy after SFT mode's gather, `gather_into`) and, on one process, their initial values to ``out``."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig

    from trl_ext.env.args import TRAIN_LEVELS
    from trl_ext.env.episodes import uses_chat
    from trl_ext.models import load_tokenizer, prepare_tokenizer
    from trl_ext.sft import gather_into, plain_copy, sft_records, sft_trainer_class

    torch.set_num_threads(1)
    n = int(os.environ.get("WORLD_SIZE", "1"))
    out.mkdir(parents=True, exist_ok=True)
    tok = prepare_tokenizer(load_tokenizer(model_path))
    records = sft_records("arithmetic", GLOBAL_BATCH, TRAIN_LEVELS, uses_chat(tok))
    assert len(records) == GLOBAL_BATCH
    for variant in VARIANTS:
        torch.manual_seed(0)
        peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        cfg = SFTConfig(output_dir=str(out / variant), max_steps=1, learning_rate=1.0, optim="sgd",
                        per_device_train_batch_size=GLOBAL_BATCH // n, report_to=[], save_strategy="no",
                        logging_steps=1, seed=0, max_length=None, use_cpu=True, bf16=False,
                        **({"ddp_backend": "gloo", "fsdp": True} if n > 1 else {}))  # fmt: skip
        trainer = sft_trainer_class()(model=AutoModelForCausalLM.from_pretrained(model_path), args=cfg,
                                      train_dataset=Dataset.from_list(records), processing_class=tok,
                                      peft_config=peft if variant == "lora" else None)  # fmt: skip
        main = trainer.accelerator.is_main_process
        plain = plain_copy(trainer, main)
        model = trainer.accelerator.unwrap_model(trainer.model)
        names = [k for k, p in model.named_parameters() if p.requires_grad]
        if n == 1:
            (out / "init").mkdir(exist_ok=True)
            torch.save({k: p.detach().clone() for k, p in model.named_parameters() if k in names},
                       out / "init" / f"{variant}.pt")  # fmt: skip
        trainer.train()
        if trainer.is_fsdp_enabled:
            gather_into(trainer, plain)  # every process
            model = plain
        if main:
            torch.save({k: p.detach().clone() for k, p in model.named_parameters() if k in names},
                       out / f"{variant}.pt")  # fmt: skip
            (out / f"{variant}.parallelism.json").write_text(json.dumps(dataclasses.asdict(trainer.parallelism)))
            (out / f"{variant}.json").write_text(json.dumps(trainer.state.log_history[0]))
        trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    from trl_ext.launch.processes import end_processes

    if sys.argv[1] == "equivalence":
        run_sft_equivalence(Path(sys.argv[2]), sys.argv[3])
    end_processes()
