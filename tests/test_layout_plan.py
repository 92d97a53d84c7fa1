"""layout.py before anything starts (`trl_ext.serve.plan`, `trl_ext.serve.layout`): a hub id resolved as transformers
resolves it, each server's GPU share and dtype, tensor parallel checked against the model, the weights directory
sized, bad flags and every check of train.py's plan refused with exit 2 before a server starts, the model pinned to
each process's GPU, and LoRA on a tied head refused with vLLM. No server starts here (tests/test_serve_vllm.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trl_ext.registry import ConfigError

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["--reward", "happy_binary", "--lora_rank", "4", "--max_steps", "2"]


def _plan(layout_kw=None, train=None, cuda=False, environ=None):
    from trl_ext.serve.plan import LayoutArgs, plan_layout

    return plan_layout(LayoutArgs(**(layout_kw or {})), train or TRAIN, cuda, environ or {})


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory):
    """$HF_HOME with two tiny random Qwen3 laid out as huggingface_hub caches downloads: ``org/tiny-qwen3`` (head
    size 32, which CPU vLLM takes) and ``org/tiny-qwen3-h16`` (head size 16, which it does not)."""
    from trl_ext.models.tiny import build_tiny_in_hub_cache

    home = tmp_path_factory.mktemp("hf_home")
    build_tiny_in_hub_cache("qwen3", home / "hub", "org/tiny-qwen3", overrides={"head_dim": 32})
    build_tiny_in_hub_cache("qwen3", home / "hub", "org/tiny-qwen3-h16")
    return home


def _layout_cli(*argv: str, env: dict | None = None, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "layout.py", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "CUDA_VISIBLE_DEVICES": "", **(env or {})})


def test_a_hub_id_is_read_from_the_hub_cache(hub_home, tmp_path):
    """``--model ORG/NAME`` from the hub cache, offline: the servers are planned on the hub id (vLLM resolves it, and
    answers to that name: --served-model-name), their context from the cached config; a model whose head size CPU vLLM
    does not take is refused before anything starts (vLLM installed: the check reads its registry). Was: a
    FileNotFoundError on ``ORG/NAME/config.json``."""
    code = ("import json, sys; from trl_ext.serve.plan import LayoutArgs, plan_layout; "
            "s = plan_layout(LayoutArgs(), sys.argv[1:], False, {}).servers[0]; "
            "print(json.dumps([s.model, s.max_model_len, s.command]))")  # fmt: skip
    env = {**os.environ, "HF_HOME": str(hub_home), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code, "--model", "org/tiny-qwen3", *TRAIN], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    model, length, cmd = json.loads(out.stdout.strip().splitlines()[-1])
    assert model == "org/tiny-qwen3" and length == 512  # the tiny config's max_position_embeddings
    assert cmd[cmd.index("--model") + 1] == cmd[cmd.index("--served-model-name") + 1] == "org/tiny-qwen3"
    pytest.importorskip("vllm")
    bad = _layout_cli("--log_dir", str(tmp_path / "logs"), "--", "--model", "org/tiny-qwen3-h16", *TRAIN, env=env)
    assert bad.returncode == 2 and "head size 16" in bad.stderr and "org/tiny-qwen3-h16" in bad.stderr, bad.stderr
    assert not (tmp_path / "logs").exists()


def test_servers_sharing_a_gpu_split_its_memory_and_start_one_after_the_other():
    from trl_ext.serve.plan import GPU_SHARE, start_waves

    distill = [*TRAIN, "--teacher_tau", "1", "--temperature", "1"]
    layout = _plan({"inference_gpu_ids": "0", "teacher_gpu_ids": "0", "trainer_gpu_ids": "1"}, distill, cuda=True)
    shares = [float(s.command[s.command.index("--gpu-memory-utilization") + 1]) for s in layout.servers]
    assert shares == [GPU_SHARE / 2, GPU_SHARE / 2]
    assert [[s.role for s in w] for w in start_waves(layout.servers, True)] == [["policy"], ["teacher"]]
    flags = layout.flags  # the trainer waits for both waves: each its --server_timeout
    assert flags[flags.index("--vllm_server_timeout") + 1] == "1200"
    apart = _plan({"inference_gpu_ids": "0", "teacher_gpu_ids": "1", "trainer_gpu_ids": "2"}, distill, cuda=True)
    assert [s.gpu_share for s in apart.servers] == [GPU_SHARE, GPU_SHARE]
    assert len(start_waves(apart.servers, True)) == 1
    with pytest.raises(ConfigError, match=r"GPU 0 is shared by policy server 0, teacher server 0.*1\.2 of the GPU"):
        _plan({"inference_gpu_ids": "0", "teacher_gpu_ids": "0", "trainer_gpu_ids": "1",
               "gpu_memory_utilization": 0.6}, distill, cuda=True)  # fmt: skip
    with pytest.raises(ConfigError, match="no CUDA here"):
        _plan({"gpu_memory_utilization": 0.5})
    assert "--gpu-memory-utilization" not in _plan().servers[0].command  # CPU: VLLM_CPU_KVCACHE_SPACE


def test_the_servers_dtype_is_bfloat16_on_cuda_and_float32_without():
    def dtype(cuda, **kw):
        cmd = _plan({"trainer_gpu_ids": "1", **kw}, cuda=cuda).servers[0].command
        return cmd[cmd.index("--dtype") + 1]

    assert dtype(True) == "bfloat16" and dtype(False) == "float32"
    assert dtype(True, server_dtype="float32") == "float32"


@pytest.fixture(scope="module")
def qwen7b(tmp_path_factory) -> str:
    """Qwen2.5-7B's config alone (28 heads, 4 KV heads, MLP 18944): what the plan reads; no weights."""
    from transformers import Qwen2Config

    path = tmp_path_factory.mktemp("qwen7b")
    Qwen2Config(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768, tie_word_embeddings=False,
                architectures=["Qwen2ForCausalLM"]).save_pretrained(path)  # fmt: skip
    return str(path)


@pytest.mark.parametrize("devices, match", [
    ("0,1,2", "3 GPUs (tensor parallel 3) do not divide the model's 28 attention heads"),
    ("0,1,2,3,4,5,6,7", "8 GPUs (tensor parallel 8) do not divide the model's 28 attention heads"),
    ("0,1", None),
    ("0,1,2,3", None),
])  # fmt: skip
def test_tensor_parallel_must_divide_the_heads(qwen7b, devices, match):
    """Was: 3 GPUs for a 28-head model failed inside vLLM after its start."""
    layout_kw = {"inference_gpu_ids": devices, "trainer_gpu_ids": "9"}
    train = ["--model", qwen7b, *TRAIN]
    if match is None:
        cmd = _plan(layout_kw, train, cuda=True).servers[0].command
        assert cmd[cmd.index("--tensor-parallel-size") + 1] == str(len(devices.split(",")))
        return
    with pytest.raises(ConfigError, match=re.escape(match)):
        _plan(layout_kw, train, cuda=True)
    with pytest.raises(ConfigError, match="MLP width 341"):  # the builtin model: 4 heads, an MLP of 341
        _plan({"inference_gpu_ids": "0,1", "trainer_gpu_ids": "9"}, cuda=True)


def test_kv_heads_and_tensor_parallel_divide_one_another():
    from types import SimpleNamespace

    from trl_ext.serve.plan import ServerSpec, check_tensor_parallel

    config = SimpleNamespace(num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944)  # Qwen2.5-7B
    check_tensor_parallel(ServerSpec("policy", 0, "m", 1, [0, 1, 2, 3]), config)
    check_tensor_parallel(ServerSpec("policy", 0, "m", 1, [0, 1]), config)
    with pytest.raises(ConfigError, match="28 attention heads"):
        check_tensor_parallel(ServerSpec("policy", 0, "m", 1, [0, 1, 2]), config)
    config = SimpleNamespace(num_attention_heads=12, num_key_value_heads=4, intermediate_size=None)
    with pytest.raises(ConfigError, match="4 KV heads: one must divide the other"):
        check_tensor_parallel(ServerSpec("policy", 0, "m", 1, [0, 1, 2, 3, 4, 5]), config)


def test_the_weights_directory_goes_to_disk_when_dev_shm_is_small(qwen7b, monkeypatch):
    """A container's /dev/shm (64 MiB) cannot hold the run's checkpoints: the default weights directory then goes to
    the temporary directory, and the plan says why (was: /dev/shm unchecked, filled mid-run)."""
    import shutil
    import tempfile
    from collections import namedtuple

    from trl_ext.serve.fit import model_shape

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**36, 0, 2**36))  # 64 GiB free
    train = ["--model", qwen7b, *TRAIN, "--max_async_level", "2"]
    layout = _plan({}, train)
    need = 4 * model_shape(layout.servers[0].config).params * (2 + 2)  # float32, k = 2: 4 checkpoints, 113.5 GiB
    assert need == 4 * 7_615_616_512 * 4
    assert layout.weights_dir.startswith(tempfile.gettempdir()) and "written to disk" in layout.weights_why
    assert f"{need / 2**30:.2f} GiB needed" in layout.weights_why
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**40, 0, 2**40))
    assert _plan({}, train).weights_dir.startswith("/dev/shm/")


@pytest.mark.parametrize("argv, match", [
    (["--bogus"], "unknown arguments: --bogus"),
    (["--inference_dp", "x"], "--inference_dp.*invalid int value"),
    (["--inference_dp", "0"], "--inference_dp must be >= 1"),
    (["--server_dtype", "fp8"], "--server_dtype"),
    (["--gpu_memory_utilization", "1.5"], "--gpu_memory_utilization must be in"),
    (["--plan_gpus", "8x80"], "--plan_gpus states the GPUs a dry run plans for: it needs --dry_run"),
])  # fmt: skip
def test_layout_flags_refused_with_exit_2(argv, match):
    from trl_ext.serve.layout import parse_args

    with pytest.raises(ConfigError, match=match):
        parse_args([*argv, "--", *TRAIN])


def test_the_cli_exits_2_on_its_own_bad_flag_and_on_any_refusal_of_train_py(tmp_path):
    """Was: a ValueError traceback from HfArgumentParser (exit 1). And train.py's whole plan, as its 2 processes will
    see it, runs before a server starts: a missing --dataset file exits 2 in seconds."""
    out = _layout_cli("--bogus", "--", *TRAIN)
    assert out.returncode == 2 and "layout.py: configuration error: unknown arguments: --bogus" in out.stderr
    assert "Traceback" not in out.stderr
    logs = tmp_path / "logs"
    out = _layout_cli("--trainer_gpu_ids", "0,1", "--log_dir", str(logs), "--", *TRAIN, "--dataset",
                      str(tmp_path / "missing.jsonl"))  # fmt: skip
    assert out.returncode == 2 and "missing.jsonl" in out.stderr, out.stderr[-2000:]
    assert not logs.exists()


def test_a_teacher_model_of_its_own_with_a_full_fine_tune_passes_every_check(tmp_path):
    """``--teacher_model`` moves onto the teacher server (``--teacher_server_url``); a full fine-tune at beta 0 has
    no other teacher. train.py's plan accepted it and every trainer process then died in the Python API's check,
    which did not count the server as a teacher, after the servers' start: both now give one answer
    (`trl_ext.distill.args.has_teacher`), and layout.py runs them all before anything starts."""
    from trl_ext.api import check_trainer_arguments
    from trl_ext.serve.plan import check_trainer_plan

    train = ["--reward", "happy_binary", "--beta", "0", "--teacher_tau", "1", "--temperature", "1", "--teacher_model",
             "builtin", "--fsdp", "full_shard auto_wrap", "--max_steps", "2", "--output_dir", str(tmp_path)]
    layout = _plan({"inference_gpu_ids": "0", "inference_dp": 1, "teacher_gpu_ids": "1", "trainer_gpu_ids": "0,1"},
                   train)  # fmt: skip
    assert "--teacher_model" not in layout.flags and "--teacher_server_url" in layout.flags
    check_trainer_plan(layout)
    from trl_ext.cli_train import parser

    _run, cfg, _ = parser().parse_args_into_dataclasses(
        args=[a for a in layout.flags if a not in ("--fsdp", "full_shard auto_wrap")] + ["--vllm_server_timeout",
                                                                                       "600"],
        return_remaining_strings=True)  # fmt: skip
    check_trainer_arguments(cfg, adapters=False)  # the trainer's own check, as each process runs it
    cfg.teacher_server_url = ""
    with pytest.raises(ValueError, match="needs a teacher"):
        check_trainer_arguments(cfg, adapters=False)


def test_each_process_loads_its_model_on_its_own_gpu():
    """TRL's ``device_map="auto"`` (one process, FSDP) spreads a model over every GPU it sees: each process is pinned
    to its local GPU, unless --model_init_kwargs names a device_map; nothing changes without CUDA."""
    from types import SimpleNamespace

    from trl_ext.launch.processes import model_init_kwargs

    cfg = SimpleNamespace(model_init_kwargs={"dtype": "bfloat16"})
    assert model_init_kwargs(cfg, cuda=True, local_rank=3) == {"dtype": "bfloat16", "device_map": {"": 3}}
    assert model_init_kwargs(cfg, cuda=False) == {"dtype": "bfloat16"}
    own = SimpleNamespace(model_init_kwargs={"device_map": "auto"})
    assert model_init_kwargs(own, cuda=True, local_rank=1) == {"device_map": "auto"}


ROUTED = ["--lora_config", "r8", "--gradient_routing", "--routing_mode", "shared", "--routing_two_pass"]


@pytest.mark.parametrize("flags, refused", [
    ([*ROUTED, "--lora_lm_head"], True),
    (ROUTED, False),
    (["--lora_rank", "4"], False),  # PEFT LoRA on every linear of the decoder blocks: not the head
])  # fmt: skip
def test_lora_on_a_tied_head_is_refused_with_vllm(flags, refused):
    """The builtin model ties its head to its embeddings: vLLM would serve the head without its adapter. train.py
    refuses it while parsing; a Python API model with such an adapter is refused when the trainer is built
    (`trl_ext.vllm.args.head_adapter`)."""
    from trl_ext.cli_train import build_plan
    from trl_ext.serve.register import servers_not_started

    base = ["--reward", "sentence_length_5_with_happy", *flags, "--max_steps", "2", "--eval_routing_steps", "0"]
    vllm = ["--use_vllm", "--vllm_mode", "server", "--vllm_server_base_url", "http://127.0.0.1:9"]
    with servers_not_started():
        if not refused:
            build_plan([*base, *vllm])
            return
        with pytest.raises(ConfigError, match="output head 'lm_head'.*tie_word_embeddings"):
            build_plan([*base, *vllm])
    build_plan(base)  # without vLLM the head's adapter generates as it trains: allowed


def test_a_peft_adapter_on_a_tied_head_is_found():
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trl_ext.models import model_source
    from trl_ext.routing.adapters import apply_dual_lora
    from trl_ext.vllm.args import head_adapter

    def model():
        return AutoModelForCausalLM.from_pretrained(model_source("builtin"), dtype=torch.float32)

    assert head_adapter(get_peft_model(model(), LoraConfig(r=2, target_modules=["lm_head", "q_proj"]))) == "lm_head"
    assert head_adapter(get_peft_model(model(), LoraConfig(r=2, target_modules=["q_proj"]))) is None
    dual = model()
    apply_dual_lora(dual, 2, 2, 4.0, 0, None, 1, None, include_lm_head=True)
    assert head_adapter(dual) == "lm_head"


def test_on_cuda_the_trainers_checks_run_in_a_child_that_sees_only_its_gpus(tmp_path):
    """On CUDA train.py's checks run in a child process with CUDA_VISIBLE_DEVICES = the trainer's GPUs (this process
    would otherwise hold a CUDA context on a server's GPU): its refusal comes back as the ConfigError (exit 2), its
    acceptance as nothing. Run here without CUDA: the child path is the same."""
    from trl_ext.serve.plan import check_trainer_plan

    ok = _plan({"trainer_gpu_ids": "5"}, [*TRAIN, "--output_dir", str(tmp_path)], cuda=True)
    assert ok.cuda
    check_trainer_plan(ok)
    bad = _plan({"trainer_gpu_ids": "5"}, [*TRAIN, "--dataset", str(tmp_path / "missing.jsonl")], cuda=True)
    with pytest.raises(ConfigError, match="missing.jsonl"):
        check_trainer_plan(bad)


def test_the_python_api_pins_the_models_it_loads(monkeypatch):
    """The trainer's own arguments carry the pin to TRL's loads (the policy from its path, the reference model)."""
    from unittest import mock

    from trl_ext.api import trainer_arguments
    from trl_ext.config import ExtGRPOConfig

    cfg = ExtGRPOConfig(output_dir="/tmp/pin", per_device_train_batch_size=4, num_generations=4, bf16=False,
                        activation_checkpointing=False)  # fmt: skip
    monkeypatch.setenv("LOCAL_RANK", "2")
    with mock.patch("torch.cuda.is_available", return_value=True):
        named = trainer_arguments((), {"model": "builtin", "args": cfg, "reward_funcs": []})
    assert named["args"].model_init_kwargs == {"device_map": {"": 2}}
