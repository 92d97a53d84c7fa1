"""The project's features under FSDP2 on 2 CPU processes (gloo): one SGD step of 2 FSDP2 processes equal to one
process for each feature (tests/test_procs.py's driver and variants, with ``fsdp=True`` on the 2 processes), and
train.py runs of the features to a checkpoint that eval_run.py loads on one process.

This file is also the driver the equivalence test launches (``python tests/test_fsdp_features.py equivalence OUT
MODEL ENV_MODEL VARIANT,...`` under torchrun or alone).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import zygote
from test_procs import ROOT, torchrun

TOL, MOVED = 1e-5, 1e-2  # as tests/test_fsdp.py
# tests/test_procs.py's VARIANTS entries that run under FSDP2 (each feature's own refusal is gone).
FEATURE_VARIANTS = ("dual_lora", "routed_single", "routed_two_pass", "routed_two_pass_bnpo", "distill_full",
                    "distill_token", "offpolicy", "env_multiturn")


# ------------------------------------------------------------------------------------------ pure pieces (fast tier)
def test_every_two_process_variant_is_checked_under_fsdp2():
    """Each variant of tests/test_procs.py's equivalence (a feature checked on 2 DDP processes) is checked on 2 FSDP2
    processes too: the plain ones in tests/test_fsdp.py, the features here."""
    from test_fsdp import VARIANTS as PLAIN
    from test_procs import VARIANTS

    assert sorted(PLAIN + FEATURE_VARIANTS) == sorted(v[0] for v in VARIANTS(None))


def test_generator_copy_loads_whole_parameters_by_name():
    """`load_full` sets every parameter of the generator's plain copy from the gathered dict, and refuses a dict whose
    names differ (a copy that would silently keep stale weights); `full_parameters` on an unsharded model gives
    copies of its (trainable) parameters."""
    import torch

    from trl_ext.offpolicy.sharded import full_parameters, is_sharded, load_full

    torch.manual_seed(0)
    policy, copy = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)), torch.nn.Sequential(
        torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    policy[0].bias.requires_grad_(False)
    assert not is_sharded(policy)
    assert set(full_parameters(policy, trainable_only=True)) == {"0.weight", "1.weight", "1.bias"}
    state = full_parameters(policy, trainable_only=False)
    load_full(copy, state)
    assert all(torch.equal(a, b) for a, b in zip(policy.parameters(), copy.parameters(), strict=True))
    state["0.weight"].add_(1.0)  # a copy, not the policy's own tensor
    assert not torch.equal(state["0.weight"], policy[0].weight)
    with pytest.raises(RuntimeError, match=r"differ in parameters: \['1.bias'\]"):
        load_full(copy, {k: v for k, v in state.items() if k != "1.bias"})


def test_adapter_only_checkpoint_reads_the_gathered_state_dict():
    """Under FSDP2 the adapter-only checkpoint takes the adapter weights from the full state dict the Trainer
    gathered (the model's own parameters are shards); without it, from the model."""
    import torch

    from trl_ext.routing.adapters import DualLoRALinear
    from trl_ext.routing.checkpoint import adapter_state

    model = torch.nn.Sequential(DualLoRALinear(torch.nn.Linear(4, 4), 2, 1, 2.0))
    own = adapter_state(model)
    assert set(own) == {"0.retain_A", "0.retain_B", "0.forget_A", "0.forget_B"}
    gathered = {k: torch.full_like(v, 7.0) for k, v in model.state_dict().items()}
    assert all(torch.equal(v, torch.full_like(v, 7.0)) for v in adapter_state(model, gathered).values())
    with pytest.raises(KeyError, match="no adapter weights"):
        adapter_state(model, {"0.base_layer.weight": gathered["0.base_layer.weight"]})


def run_fsdp_steps(out: Path) -> tuple[Path, Path]:
    """(1 process, 2 FSDP2 processes): the output directories of one step of every variant, the plain ones of
    tests/test_fsdp.py and the features here, on tiny Llamas built into ``out``. The session's `fsdp_steps` fixture
    (tests/conftest.py) runs it once: one launch for all the tests that compare a variant, not one per test."""
    from test_fsdp import VARIANTS as PLAIN

    from trl_ext.models.tiny import build_tiny

    models = build_tiny("llama", out / "llama"), build_tiny("llama", out / "llama_env", tokenizer="builtin_env")
    one, two = out / "one", out / "two"
    args = ["equivalence", None, str(models[0]), str(models[1]), ",".join(PLAIN + FEATURE_VARIANTS)]
    single = zygote.run([sys.executable, __file__, *[str(one) if a is None else a for a in args]],
                        capture_output=True, text=True, timeout=400, cwd=ROOT)  # fmt: skip
    assert single.returncode == 0, single.stderr[-3000:]
    double = torchrun([__file__, *[str(two) if a is None else a for a in args]], timeout=600)
    assert double.returncode == 0, double.stderr[-3000:]
    return one, two


def _equivalence(steps: tuple[Path, Path], variants: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    """{variant: (largest parameter difference 2 FSDP2 processes vs 1 process, largest parameter move)}, after the
    checks: the step moved the parameters, the 2-process model was sharded."""
    found = {variant: compare_step(*steps, variant) for variant in variants}
    print(json.dumps(found))
    return found


def compare_step(one: Path, two: Path, variant: str) -> tuple[float, float]:
    """(largest difference, largest move) of ``variant``'s parameters after one step on 1 process (``one``) and on 2
    FSDP2 processes (``two``), asserting the bound, the no-op guard and that the 2-process model was sharded."""
    import torch

    init, a, b = (torch.load(p / f"{variant}.pt") for p in (one / "init", one, two))
    assert a.keys() == b.keys() == init.keys() and len(a) > 0
    moved = max((a[k] - init[k]).abs().max().item() for k in a)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert moved > MOVED, f"{variant}: the step did not move the parameters ({moved})"
    assert worst < TOL, f"{variant}: 2 FSDP2 processes differ from 1 process by {worst}"
    p = json.loads((two / f"{variant}.parallelism.json").read_text())
    assert p["kind"] == "FSDP2" and p["processes"] == 2 and p["sharded_modules"] >= 2
    assert p["dtensor_params"] == p["params"] > 0 and p["local_elements"] < 0.51 * p["elements"]
    return worst, moved


FSDP_STEPS = pytest.mark.xdist_group("fsdp_steps")  # the tests reading `fsdp_steps` share one worker and its run


@pytest.mark.slow
@FSDP_STEPS
def test_routing_on_fsdp2_equals_one_process(fsdp_steps):
    """Dual LoRA, and gradient routing with both backward modes (single pass; the two-pass reference, whose routed-away
    side's gradient is restored on the shards), with TRL's default loss (dapo) and the two-pass step with bnpo:
    2 FSDP2 processes x 4 == 1 process x 8 within 1e-5."""
    import torch

    _equivalence(fsdp_steps, ("dual_lora", "routed_single", "routed_two_pass", "routed_two_pass_bnpo"))
    a, b = (torch.load(fsdp_steps[1] / f"{v}.pt") for v in ("routed_single", "routed_two_pass"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6  # the two modes agree sharded too
    c = torch.load(fsdp_steps[1] / "dual_lora.pt")
    assert max((a[k] - c[k]).abs().max().item() for k in a) > 1e-2  # routing changed the sharded step


@pytest.mark.slow
@FSDP_STEPS
def test_distillation_on_fsdp2_equals_one_process(fsdp_steps):
    """Distillation with the LoRA policy's adapters disabled as the teacher (one group of 8 split over the processes),
    both paths (full-reward baseline and per-token): 2 FSDP2 processes x 4 == 1 process x 8 within 1e-5."""
    _equivalence(fsdp_steps, ("distill_full", "distill_token"))


@pytest.mark.slow
@FSDP_STEPS
def test_offpolicy_on_fsdp2_equals_one_process(fsdp_steps):
    """k = 1: the generator's plain copy loaded from the gathered shards, the IS loss with the default masks (a
    scripted sampler per process): 2 FSDP2 processes x 4 == 1 process x 8 within 1e-5, its metrics logged over both
    processes."""
    _equivalence(fsdp_steps, ("offpolicy",))
    logs = [json.loads((d / "offpolicy.json").read_text()) for d in fsdp_steps]
    assert 0 < logs[0]["offpolicy/masked_frac"] < 1 and logs[0]["offpolicy/policy_lag_max"] == 0
    for name in ("offpolicy/masked_frac", "offpolicy/ratio_max", "offpolicy/mismatch_kl", "entropy"):
        assert abs(logs[0][name] - logs[1][name]) < 1e-5, name


@pytest.mark.slow
@FSDP_STEPS
def test_environment_on_fsdp2_equals_one_process(fsdp_steps):
    """A multi-turn environment (frozenlake, 3 turns, the episode loop in lockstep over the processes): 2 FSDP2
    processes x 4 == 1 process x 8 within 1e-5, the episode metrics over both processes."""
    _equivalence(fsdp_steps, ("env_multiturn",))
    logs = [json.loads((d / "env_multiturn.json").read_text()) for d in fsdp_steps]
    assert 0 < logs[0]["env/success"] < 1 and 2 < logs[0]["env/turns"] < 3
    assert all(logs[0][k] == logs[1][k] for k in logs[0] if k.startswith("env/"))


# ------------------------------------------------------------------------------------------ train.py runs
SMALL = ["--batch_size", "4", "--num_generations", "4", "--max_completion_length", "8",
         "--save_steps", "2", "--logging_steps", "1", "--no_wandb", "--fsdp"]


def _run(out: Path, *args: str, steps: int = 2, small: list[str] = SMALL) -> tuple[Path, str]:
    proc = torchrun(["train.py", *args, *small, "--max_steps", str(steps), "--output_dir", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = out.iterdir()
    log = (run_dir / "train.log").read_text()
    assert log.count("$ train.py") == 1 and run_dir.name.endswith("_procs2_fsdp2")
    assert "processes: 2 (gloo backend, FSDP2: " in log
    return run_dir, log


def _eval_run(ckpt: Path) -> str:
    ev = zygote.run([sys.executable, "eval_run.py", "--model_path", str(ckpt), "--n_samples", "4"],
                        capture_output=True, text=True, timeout=240, cwd=ROOT)  # fmt: skip
    assert ev.returncode == 0, ev.stderr[-3000:]
    return ev.stdout


@pytest.mark.slow
def test_fsdp2_routed_run_to_an_adapter_checkpoint(tmp_path):
    """`torchrun --nproc_per_node 2 train.py --fsdp` routed r4 (two-pass), with the routing eval (set_scales on the
    sharded model; every process generates, checked equal across them) and --save_adapter_only: the adapters are
    gathered from the shards into the checkpoint, moved from their zero B, and eval_run.py loads them on one process."""
    import safetensors.torch

    run_dir, log = _run(tmp_path / "out", "--reward", "sentence_length_5_with_happy", "--gradient_routing",
                        "--routing_mode", "exclusive", "--routing_two_pass", "--lora_config", "r4",
                        "--save_adapter_only", "--eval_routing_steps", "2", "--eval_routing_prompts", "8")
    assert "advantages: routing:retain-only (step 1)" in log and log.count("'routing/n_samples': '8'") == 2
    records = [json.loads(line) for line in (run_dir / "routing_eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2] and set(records[0]["modes"]) == {"both", "retain_only", "forget_only"}
    ckpt = run_dir / "checkpoint-2"
    assert (ckpt / "dual_lora_layout.json").is_file() and not (ckpt / "model.safetensors").exists()
    adapters = safetensors.torch.load_file(str(next(ckpt.glob("*.safetensors"))))
    assert adapters and all(k.endswith(("_A", "_B")) for k in adapters)
    assert any(k.endswith("retain_B") and v.abs().max() > 0 for k, v in adapters.items())
    out = _eval_run(ckpt)
    assert f"checkpoint: {ckpt} (dual_lora)" in out and "retain_only" in out


@pytest.mark.slow
def test_fsdp2_distillation_runs_to_a_checkpoint(tmp_path):
    """Distillation on LoRA (the sharded policy with its adapters disabled teaches) and with --eval_baseline: one run
    to a checkpoint whose adapter eval_run.py loads."""
    run_dir, log = _run(tmp_path / "out", "--reward", "happy_binary", "--lora_rank", "4", "--teacher_tau", "0.1",
                        "--teacher_context", "A happy story.", "--eval_baseline", "--eval_baseline_prompts", "8")
    assert "advantages: distill (step 1)" in log and "distill/teacher_logp_sum" in log
    assert log.count("eval_baseline student:") == 1
    assert "(peft_lora)" in _eval_run(run_dir / "checkpoint-2")


@pytest.mark.slow
def test_fsdp2_teacher_model_runs_to_a_checkpoint(tmp_path):
    """A separate --teacher_model (an unsharded frozen copy on every process) beside the sharded full fine-tune."""
    run_dir, log = _run(tmp_path / "out", "--reward", "happy_binary", "--teacher_tau", "0.1", "--teacher_model",
                        "builtin", "--teacher_context", "A happy story.")
    assert "distill/teacher_logp_sum" in log
    assert "(plain)" in _eval_run(run_dir / "checkpoint-2")


K1_RUN = ["--batch_size", "8", "--num_generations", "4", "--max_completion_length", "16", "--save_steps", "8",
          "--logging_steps", "1", "--no_wandb", "--fsdp"]


@pytest.mark.slow
@pytest.mark.parametrize("sampler", [[], ["--generation_backend", "fast"]], ids=["transformers", "fast"])
def test_offpolicy_generator_follows_the_sharded_policy(tmp_path, sampler):
    """--max_async_level 1 --strict_async_level, 8 steps at a constant lr 3e-4, both samplers of the generator: each
    process's generator samples with a plain copy gathered from the shards at its start (step 1 at float error) and
    loaded from the gathered publish of every step, so from step 2 on the gap to the sharded trainer is one step's
    drift. Measured mean |log ratio| at steps 1-8 (both samplers draw the same tokens): 4e-7 / 5e-7, then 0.058, 0.037,
    0.028, 0.040, 0.015, 0.019, 0.017; with the publishes' gather returning nothing (the copy keeps the start
    weights) 0.058, 0.095, 0.086, 0.13, 0.16, 0.28, 0.23. Step 2's gap (policy 1 against policy 0) is the same either
    way: the yardstick. eval_run.py loads the checkpoint on one process."""
    run_dir, log = _run(tmp_path / "out", "--reward", "happy_binary", "--max_async_level", "1", "--strict_async_level",
                        "--disable_dropout", "--lr", "3e-4", "--lr_scheduler_type", "constant", *sampler, steps=8,
                        small=K1_RUN)  # fmt: skip
    assert "its copy on cpu (gathered from the FSDP2 shards)" in log
    state = json.loads((run_dir / "checkpoint-8" / "trainer_state.json").read_text())
    logs = [r for r in state["log_history"] if "loss" in r]
    gap = [r["offpolicy/abs_log_ratio_mean"] for r in logs]
    assert [r["offpolicy/policy_lag_max"] for r in logs] == [0] + [1] * 7 and gap[0] < 1e-5, logs
    assert gap[1] > 1e-2 and max(gap[-3:]) < gap[1], gap  # steps 6-8: on <= 0.32x step 2's gap, off >= 2.7x
    if not sampler:
        assert "(plain)" in _eval_run(run_dir / "checkpoint-8")


@pytest.mark.slow
def test_offpolicy_lora_bf16_trains_under_fsdp2(tmp_path):
    """--max_async_level 1 with PEFT LoRA, --bf16 and the reference KL (beta 0.02, the default) under FSDP2: the
    generator samples with its own copy, so the sharded policy's first forward is TRL's reference pass, inside PEFT's
    disable_adapter (adapters' requires_grad off). FSDP2 reads each group's trainable dtype at its lazy init, so
    ``trl_ext.launch.fsdp.init_fsdp2_now`` runs it when the model is prepared; run at the first forward instead, the
    LoRA groups record no dtype and the first backward fails (RuntimeError: a BFloat16 gradient for a Float
    tensor: first seen on an H200, bench/results/gpu_check-h200.log). The adapters train: the loss is finite and the
    LoRA B matrices moved from zero."""
    import safetensors.torch

    run_dir, log = _run(tmp_path / "out", "--reward", "happy_binary", "--lora_rank", "4", "--bf16",
                        "--max_async_level", "1", "--disable_dropout", "--lr", "1e-3",
                        small=[*K1_RUN, "--save_steps", "2"])  # fmt: skip
    assert "its copy on cpu (gathered from the FSDP2 shards)" in log
    state = json.loads((run_dir / "checkpoint-2" / "trainer_state.json").read_text())
    assert all(r["loss"] == r["loss"] for r in state["log_history"] if "loss" in r)
    adapters = safetensors.torch.load_file(run_dir / "checkpoint-2" / "adapter_model.safetensors")
    lora_b = [t for k, t in adapters.items() if "lora_B" in k]
    assert lora_b and all(t.abs().max() > 0 for t in lora_b)


@pytest.mark.slow
def test_fsdp2_environments_run_to_a_checkpoint(tmp_path):
    """`--env frozenlake,arithmetic` (multi- and single-turn episodes in one batch, so the processes' episodes end at
    different turns) with TRL's generation from the sharded model: the episode loop in lockstep runs to a checkpoint
    (a process that stopped calling generation would hang the other: the launch would time out); eval_run.py's
    loader loads the checkpoint on one process."""
    run_dir, log = _run(tmp_path / "out", "--env", "frozenlake,arithmetic", "--model", "builtin_env",
                        "--max_completion_length", "48")
    from trl_ext.evaluate import detect_checkpoint, load_model

    ckpt = run_dir / "checkpoint-2"
    assert "'env/frozenlake/share'" in log and (ckpt / "checkpoint_complete.json").is_file()
    load_model(ckpt, detect_checkpoint(ckpt))  # eval_run.py's loader (its story prompts need the Hub)


if __name__ == "__main__":
    import os

    from test_procs import run_equivalence

    from trl_ext.launch.processes import end_processes

    if sys.argv[1] == "equivalence":
        sharded = {"fsdp": True} if int(os.environ.get("WORLD_SIZE", "1")) > 1 else {}
        run_equivalence(Path(sys.argv[2]), sys.argv[3], sys.argv[4], only=tuple(sys.argv[5].split(",")), **sharded)
    end_processes()
