"""FSDP2 on 2 CPU processes (gloo): the parse-time rules of sharded launches, the parallelism read from the prepared
model, one SGD step of 2 FSDP2 processes equal to one process (full fine-tune and PEFT LoRA), and train.py runs whose
full-state-dict checkpoints load in eval_run.py and resume exactly on 2 processes.

The equivalence reuses tests/test_procs.py's driver (scripted completions as a function of the prompt and of the
global position, the completion length as reward, plain SGD at lr 1.0, 2 x 4 completions against 1 x 8), with
``fsdp=True`` on the 2 processes, launched once for these variants and the features' (tests/test_fsdp_features.py's
`fsdp_steps`).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import zygote
import yaml
from test_fsdp_features import FSDP_STEPS, compare_step
from test_procs import ROOT, TWO, torchrun

from trl_ext.launch.fsdp import Parallelism, check_parallelism, read_parallelism
from trl_ext.launch.sharding import check_fsdp, fsdp_settings, sharding_tag
from trl_ext.registry import ConfigError

VARIANTS = ("full", "lora")  # the plain paths FSDP2 runs (tests/test_procs.py's VARIANTS entries)
TOL, MOVED = 1e-5, 1e-2


# ------------------------------------------------------------------------------------------ parse-time rules (pure)
class Cfg:
    """The fields `check_fsdp` reads, as ExtGRPOConfig holds them before TrainingArguments resolves them."""

    def __init__(self, fsdp=None, fsdp_config=None, deepspeed=None):
        self.fsdp, self.fsdp_config, self.deepspeed = fsdp, fsdp_config, deepspeed


def test_fsdp_needs_several_processes_or_a_gpu_launcher():
    """accelerate applies FSDP only to several CPU processes or a launched GPU process: elsewhere it would drop the
    plugin and train unsharded, so --fsdp is refused there."""
    check_fsdp(Cfg(fsdp=True), TWO, cuda=False)  # 2 CPU processes
    check_fsdp(Cfg(fsdp=True), {"WORLD_SIZE": "1", "LOCAL_RANK": "0"}, cuda=True)  # accelerate launch, 1 GPU
    check_fsdp(Cfg(), {}, cuda=False)  # no sharding asked for
    with pytest.raises(ConfigError, match=r"--fsdp shards over the processes of a launch, and this is one CPU process"):
        check_fsdp(Cfg(fsdp=True), {}, cuda=False)
    with pytest.raises(ConfigError, match="this is one CPU process"):  # torchrun --nproc_per_node 1 on CPU
        check_fsdp(Cfg(fsdp=True), {"WORLD_SIZE": "1", "LOCAL_RANK": "0"}, cuda=False)
    with pytest.raises(ConfigError, match=r"a plain start \(no torchrun / accelerate launch\)"):
        check_fsdp(Cfg(fsdp=True), {}, cuda=True)
    with pytest.raises(ConfigError, match="this is one CPU process"):  # accelerate's FSDP config, one CPU process
        check_fsdp(Cfg(), {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, cuda=False)


def test_fsdp2_and_full_state_dict_only(tmp_path):
    v1, sharded, ok = tmp_path / "v1.json", tmp_path / "sharded.json", tmp_path / "ok.json"
    v1.write_text('{"fsdp_version": 1}')
    sharded.write_text('{"state_dict_type": "SHARDED_STATE_DICT"}')
    ok.write_text('{"fsdp_version": 2, "fsdp_state_dict_type": "FULL_STATE_DICT", "reshard_after_forward": false}')
    assert fsdp_settings(Cfg(fsdp=True)) == (2, "FULL_STATE_DICT")  # transformers' defaults for --fsdp
    assert fsdp_settings(Cfg(fsdp=True, fsdp_config=str(ok))) == (2, "FULL_STATE_DICT")
    assert fsdp_settings(Cfg(fsdp="full_shard auto_wrap", fsdp_config={"version": 1})) == (1, "FULL_STATE_DICT")
    assert fsdp_settings(Cfg(), {"FSDP_VERSION": "2"}) == (2, "SHARDED_STATE_DICT")  # accelerate's env defaults
    check_fsdp(Cfg(fsdp=True, fsdp_config=str(ok)), TWO, cuda=False)
    check_fsdp(Cfg(), {**TWO, "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_STATE_DICT_TYPE":
                       "FULL_STATE_DICT"}, cuda=False)  # accelerate_configs/fsdp2.yaml's variables  # fmt: skip
    with pytest.raises(ConfigError, match="FSDP version 1: only FSDP2 has been run here"):
        check_fsdp(Cfg(fsdp=True, fsdp_config=str(v1)), TWO, cuda=False)
    with pytest.raises(ConfigError, match="FSDP version 1"):  # accelerate's default FSDP_VERSION
        check_fsdp(Cfg(), {**TWO, "ACCELERATE_USE_FSDP": "true"}, cuda=False)
    with pytest.raises(ConfigError, match="state_dict_type SHARDED_STATE_DICT: only FULL_STATE_DICT checkpoints"):
        check_fsdp(Cfg(fsdp=True, fsdp_config=str(sharded)), TWO, cuda=False)
    with pytest.raises(ConfigError, match="no such file"):
        check_fsdp(Cfg(fsdp=True, fsdp_config=str(tmp_path / "missing.json")), TWO, cuda=False)
    with pytest.raises(ConfigError, match="--fsdp_config is read only with --fsdp"):
        check_fsdp(Cfg(fsdp_config=str(ok)), TWO, cuda=False)


def test_deepspeed_refused_on_cpu_processes():
    """accelerate ignores DeepSpeed on CPU (``cpu=True``) and runs DDP."""
    with pytest.raises(ConfigError, match="DeepSpeed needs GPUs"):
        check_fsdp(Cfg(deepspeed="ds.json"), TWO, cuda=False)
    check_fsdp(Cfg(deepspeed="ds.json"), TWO, cuda=True)


def test_train_py_refuses_fsdp_on_one_process(train_cli_error):
    err = train_cli_error("--reward", "happy_binary", "--fsdp")
    assert "--fsdp shards over the processes of a launch" in err
    assert "--fsdp_config is read only with --fsdp" in train_cli_error("--reward", "happy_binary", "--fsdp_config",
                                                                        "x.json")  # fmt: skip


def test_run_name_of_an_fsdp_run():
    """An FSDP run's name ends in ``_fsdp2`` (after ``_procs2``), not in the resolved fsdp_config dict, whatever the
    spelling of --fsdp; the features not run under FSDP are refused while parsing, naming their flag."""
    from trl_ext.cli_train import build_plan
    from trl_ext.sweep_plan import planned_processes

    base = ["--reward", "happy_binary", "--max_steps", "2"]
    with planned_processes(2):
        names = {build_plan([*base, *flags]).run_dir.name for flags in (["--fsdp"], ["--fsdp", "full_shard auto_wrap"])}
        assert names == {"happy_binary_builtin_lr1e-5_b0.02_bs32_ng16_full_st2_s42_procs2_fsdp2"}
        with pytest.raises(ConfigError, match=r"--generation_backend fast: the fast generation backend has not been "
                                              r"run under FSDP \(at k = 0 it samples from the policy"):
            build_plan([*base, "--fsdp", "--generation_backend", "fast"])
        build_plan([*base, "--fsdp", "--generation_backend", "fast", "--max_async_level", "1"])  # the generator's copy
        build_plan(["--mode", "sft", "--env", "arithmetic", "--model", "builtin_env", "--fsdp"])  # test_fsdp_sft.py
    assert sharding_tag(Cfg(fsdp=True), {}) == "_fsdp2" and sharding_tag(Cfg(), {}) == ""


# ------------------------------------------------------------------------------------------ the parallelism in effect
def test_parallelism_is_read_from_the_model():
    import torch

    p = read_parallelism(torch.nn.Linear(3, 2), 1)
    assert (p.kind, p.params, p.elements, p.local_elements) == ("none", 2, 8, 8)
    sharded = Parallelism("FSDP2", 2, sharded_modules=8, dtensor_params=38, params=38)
    assert sharded.describe() == "FSDP2: 8 modules sharded over 2 processes, 38 of 38 parameters as DTensor shards"
    assert Parallelism("DDP", 2).describe() == "DDP"
    check_parallelism(Cfg(fsdp=True), sharded)
    check_parallelism(Cfg(), Parallelism("DDP", 2))
    with pytest.raises(ConfigError, match="FSDP was asked for, but the prepared model is DDP over 2 process"):
        check_parallelism(Cfg(fsdp=True), Parallelism("DDP", 2))


def test_launch_header_records_the_parallelism(tmp_path, capsys):
    """train.log's launch line and run_config.yaml's ``launch.parallelism`` come from the trainer's parallelism once
    the model is prepared; a resume does not compare the description."""
    from types import SimpleNamespace

    from trl_ext.naming import is_defining
    from trl_ext.runs.checkpoints import config_differences
    from trl_ext.runs.rundir import LaunchHeader

    saved = {"ExtGRPOConfig": {"seed": 1}, "launch": {"num_processes": 2}}
    (tmp_path / "run_config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    cfg = SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=1, ddp_backend="gloo")
    found = Parallelism("FSDP2", 2, sharded_modules=8, dtensor_params=38, params=38)
    LaunchHeader(SimpleNamespace(cfg=cfg, run_dir=tmp_path), SimpleNamespace(parallelism=found)).on_train_begin(
        None, None, None)
    assert "processes: 1; batch: 4 completions per process = 4 per optimizer step" in capsys.readouterr().out
    written = yaml.safe_load((tmp_path / "run_config.yaml").read_text())
    assert written == {**saved, "launch": {"num_processes": 2, "parallelism": found.describe()}}
    assert config_differences(written, saved, is_defining) == []


# ------------------------------------------------------------------------------------------ the real launcher
@pytest.mark.slow
@FSDP_STEPS
def test_fsdp2_equals_one_process(fsdp_steps):
    """One SGD step, full fine-tune and PEFT LoRA: 2 FSDP2 processes x 4 completions == 1 process x 8, within 1e-5,
    the step moving the parameters by more than 1e-2; the 2-process model really was sharded (every parameter a
    DTensor shard, each process holding about half of the elements). The steps are the session's `fsdp_steps`
    (tests/conftest.py), one launch for every variant."""
    for variant in VARIANTS:
        compare_step(*fsdp_steps, variant)
        assert json.loads((fsdp_steps[0] / f"{variant}.parallelism.json").read_text())["kind"] == "none"


def _train(out: Path, *extra: str) -> Path:
    proc = torchrun(["train.py", "--reward", "happy_binary", "--fsdp", "--batch_size", "4", "--num_generations", "4",
                     "--max_completion_length", "8", "--save_steps", "2", "--logging_steps", "1", "--lr", "3e-4",
                     "--no_wandb", "--output_dir", str(out), *extra])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = [d for d in out.iterdir() if d.is_dir()]
    return run_dir


def _history(run_dir: Path, step: int) -> dict[int, dict]:
    state = json.loads((run_dir / f"checkpoint-{step}" / "trainer_state.json").read_text())
    return {r["step"]: {k: r[k] for k in ("loss", "reward", "kl", "grad_norm")} for r in state["log_history"]
            if "loss" in r}  # fmt: skip


@pytest.mark.slow
def test_fsdp2_checkpoint_resumes_on_two_processes(tmp_path):
    """`torchrun --nproc_per_node 2 train.py --fsdp` (full fine-tune) to step 4: the header and run_config.yaml name
    FSDP2 as read from the prepared model; each checkpoint holds the gathered model.safetensors (equal to the FSDP
    resume file, and what eval_run.py's loader loads on one process) beside the full optimizer state. The run cut
    back to checkpoint-2 and resumed with ``--resume_from_checkpoint latest`` on 2 processes logs steps 3-4 as the
    uninterrupted run did and ends on its weights, bit for bit."""
    import safetensors.torch
    import torch

    from trl_ext.evaluate import detect_checkpoint, load_model

    out = tmp_path / "out"
    run_dir = _train(out, "--max_steps", "4")
    log = (run_dir / "train.log").read_text()
    assert run_dir.name.endswith("_procs2_fsdp2") and log.count("$ train.py") == 1
    assert "processes: 2 (gloo backend, FSDP2: " in log and " modules sharded over 2 processes, " in log
    launch = yaml.safe_load((run_dir / "run_config.yaml").read_text())["launch"]
    assert launch["num_processes"] == 2 and launch["parallelism"].startswith("FSDP2: ")
    ckpt = run_dir / "checkpoint-2"
    assert {"model.safetensors", "pytorch_model_fsdp.bin", "optimizer.bin", "rng_state_1.pth"} <= {
        p.name for p in ckpt.iterdir()}
    weights = safetensors.torch.load_file(str(ckpt / "model.safetensors"))
    fsdp_file = torch.load(ckpt / "pytorch_model_fsdp.bin", weights_only=True)
    assert weights.keys() == fsdp_file.keys() and all(torch.equal(weights[k], fsdp_file[k]) for k in weights)
    model, _ = load_model(ckpt, detect_checkpoint(ckpt))  # eval_run.py's loader, on this one process
    loaded = model.state_dict()
    assert weights.keys() <= loaded.keys() and all(torch.equal(loaded[k], weights[k]) for k in weights)

    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    cut = resumed / run_dir.name
    shutil.rmtree(cut / "checkpoint-4")
    (cut / "run_summary.json").unlink()
    again = _train(resumed, "--max_steps", "4", "--resume_from_checkpoint", "latest")
    assert "RESUMED from" in (again / "train.log").read_text()
    expected, got = _history(run_dir, 4), _history(again, 4)
    assert sorted(got) == [1, 2, 3, 4] and got == expected
    final = [safetensors.torch.load_file(str(d / "checkpoint-4" / "model.safetensors")) for d in (run_dir, again)]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])
    assert max((final[0][k] - weights[k]).abs().max().item() for k in weights) > 1e-4  # steps 3-4 trained


@pytest.mark.slow
def test_fsdp2_lora_checkpoint_loads_in_eval_run(tmp_path):
    """PEFT LoRA under FSDP2 on 2 processes: the checkpoint's adapter (gathered from the shards) loads in eval_run.py
    on one process and samples; the adapter moved from its initial zero B."""
    import safetensors.torch

    run_dir = _train(tmp_path / "out", "--max_steps", "2", "--lora_rank", "4")
    assert "FSDP2: " in (run_dir / "train.log").read_text()
    ckpt = run_dir / "checkpoint-2"
    adapter = safetensors.torch.load_file(str(ckpt / "adapter_model.safetensors"))
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapter.items())
    ev = zygote.run([sys.executable, "eval_run.py", "--model_path", str(ckpt), "--n_samples", "4"],
                        capture_output=True, text=True, timeout=240, cwd=ROOT)  # fmt: skip
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert f"checkpoint: {ckpt} (peft_lora)" in ev.stdout

