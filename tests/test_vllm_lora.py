"""The policy's adapters as one vLLM LoRA adapter, without vLLM (trl_ext.vllm.lora): the stacking math by hand, the
exported adapter loaded back by PEFT equal to the trainer's forward (PEFT LoRA, and dual LoRA in every routing eval
mode), what cannot be an adapter, the parse-time plan of --vllm_lora_sync, the publisher's base-once accounting and
the server's adapter names. On a vLLM engine and server: tests/test_vllm.py, tests/test_serve_vllm.py."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trl_ext.registry import ConfigError
from trl_ext.routing.adapters import ABLATION_SCALES, apply_dual_lora, scales
from trl_ext.vllm.args import lora_sync_of_model, lora_sync_plan
from trl_ext.vllm.lora import (
    CONFIG,
    adapter_rank,
    base_dir_of,
    engine_rank,
    stack_blocks,
    unservable,
    write_adapter,  # fmt: skip
)


def tiny_llama(seed=0, tied=False):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, max_position_embeddings=32, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).eval()


def randomize(model, seed=1):
    """Non-zero LoRA B matrices (PEFT and dual LoRA start at B = 0, which any export would match)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or name.endswith(("retain_B", "forget_B")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def test_stack_blocks_by_hand():
    a1, b1 = torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0], [0.0], [2.0]])  # rank 1: in 2, out 3
    a2 = torch.tensor([[0.0, 1.0], [1.0, 1.0]])
    b2 = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])  # rank 2
    a, b = stack_blocks([(a1, b1, 2.0), (a2, b2, 0.5)], rank=4)
    assert a.tolist() == [[1, 2], [0, 1], [1, 1], [0, 0]]
    assert b.tolist() == [[2, 0.5, 0, 0], [0, 0, 0.5, 0], [4, 0.5, 0.5, 0]]
    # B A = 2 B1 A1 + 0.5 B2 A2, by hand: row 0 = 2*[1,2] + 0.5*[0,1]; row 1 = 0.5*[1,1]; row 2 = 4*[1,2] + 0.5*[1,2]
    assert (b @ a).tolist() == [[2, 4.5], [0.5, 0.5], [4.5, 9]]
    a, b = stack_blocks([(a1, b1, 2.0), (a2, b2, 0.0)], rank=3)  # a side at scale 0: its columns 0, shape kept
    assert a.shape == (3, 2) and b[:, 1:].abs().sum() == 0 and (b @ a).tolist() == [[2, 4], [0, 0], [4, 8]]
    with pytest.raises(ValueError, match="more than the adapter's 2"):
        stack_blocks([(a1, b1, 1.0), (a2, b2, 1.0)], rank=2)


def test_engine_rank_is_the_smallest_vllm_takes():
    assert [engine_rank(r) for r in (1, 2, 8, 9, 16, 24, 320, 321, 512)] == [1, 8, 8, 16, 16, 32, 320, 512, 512]
    assert engine_rank(513) is None


def reload_as_peft(base_seed: int, directory) -> torch.nn.Module:
    """The exported adapter loaded by PEFT onto a fresh copy of the base model (what vLLM reads: PEFT's format)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(tiny_llama(base_seed), str(directory)).eval()


def test_peft_lora_exported_equals_the_trainer_forward(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                         "down_proj"]))  # fmt: skip
    randomize(model)
    nbytes = write_adapter(model, str(tmp_path / "v1"), True, rank=8)  # padded to the engine's rank
    config = json.loads((tmp_path / "v1" / CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (8, 8, ["down_proj", "q_proj", "v_proj"])
    # 2 layers x (A (8, in) + B (out, 8)) in float32: q 16 -> 16, v 16 -> 8, down 24 -> 16
    assert nbytes == 4 * 2 * 8 * ((16 + 16) + (16 + 8) + (24 + 16))
    x = torch.randint(0, 32, (2, 7))
    with torch.no_grad():
        want, got = model(x).logits, reload_as_peft(0, tmp_path / "v1")(x).logits
        base = tiny_llama()(x).logits
    assert (want - base).abs().max() > 1e-2  # the adapter matters
    assert torch.allclose(got, want, atol=1e-6, rtol=0), (got - want).abs().max()


def test_dual_lora_exported_in_every_routing_mode(tmp_path):
    """retain (rank 4, scaling 2) and forget (rank 2, scaling 4) as one adapter of rank 8 whose forward equals the
    dual-LoRA forward in each eval mode: a side at scale 0 is a block of zero columns."""
    model = tiny_llama()
    apply_dual_lora(model, 4, 2, alpha=8.0)
    randomize(model)
    assert adapter_rank(model) == 6
    x = torch.randint(0, 32, (2, 7))
    outs = {}
    for mode, (retain, forget) in ABLATION_SCALES.items():
        with scales(model, retain, forget), torch.no_grad():
            write_adapter(model, str(tmp_path / mode), True, rank=8)
            want = model(x).logits
            got = reload_as_peft(0, tmp_path / mode)(x).logits
        assert torch.allclose(got, want, atol=1e-5, rtol=0), (mode, (got - want).abs().max())
        outs[mode] = got
    assert (outs["both"] - outs["retain_only"]).abs().max() > 1e-2  # the modes differ
    assert (outs["retain_only"] - outs["forget_only"]).abs().max() > 1e-2


def test_what_cannot_be_an_adapter():
    from peft import LoraConfig, get_peft_model

    assert "full fine-tune" in unservable(tiny_llama())
    dora = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    assert "DoRA" in unservable(dora)
    saved = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    assert "modules_to_save" in unservable(saved)
    head = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    assert "output head" in unservable(head)
    embed = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]))
    assert "embedding" in unservable(embed)
    plain = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj"]))
    assert unservable(plain) is None


def flags(**kw):
    base = dict(use_vllm=True, vllm_lora_sync="auto", lora_config=None, retain_rank=None, forget_rank=None,
                adapter_type="lora", lora_lm_head=False, gradient_routing=False, vllm_weight_transfer="files",
                vllm_enable_sleep_mode=False)
    return SimpleNamespace(**{**base, **kw})


def test_lora_sync_plan_from_the_flags():
    assert lora_sync_plan(flags(), 16)[0] == 16
    assert lora_sync_plan(flags(), 12)[0] == 16  # the engines' rank: the smallest vLLM takes
    assert lora_sync_plan(flags(lora_config="r8", gradient_routing=True), 0)[0] == 16  # retain 8 + forget 8
    assert lora_sync_plan(flags(retain_rank=32, forget_rank=4), 0)[0] == 64
    rank, why = lora_sync_plan(flags(), 0)
    assert rank is None and "full fine-tune" in why
    rank, why = lora_sync_plan(flags(vllm_weight_transfer="gloo"), 8)
    assert rank is None and "pushes whole tensors" in why
    assert lora_sync_plan(flags(vllm_lora_sync="merged"), 8)[0] is None
    assert "sleep" in lora_sync_plan(flags(vllm_enable_sleep_mode=True), 8)[1]
    assert "MLP" in lora_sync_plan(flags(retain_rank=4, forget_rank=4, adapter_type="mlp"), 0)[1]
    assert "above vLLM's largest" in lora_sync_plan(flags(), 600)[1]
    assert lora_sync_plan(flags(use_vllm=False), 8) == (None, "")
    for kw, rank in ((dict(), 0), (dict(vllm_weight_transfer="nccl"), 8), (dict(lora_lm_head=True, lora_config="r8"),
                                                                            0)):  # fmt: skip
        with pytest.raises(ConfigError, match="--vllm_lora_sync adapter"):
            lora_sync_plan(flags(vllm_lora_sync="adapter", **kw), rank)


def test_lora_sync_decided_on_the_built_model():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=8, target_modules=["q_proj"], use_dora=True))
    rank, why = lora_sync_of_model(flags(), model)
    assert rank is None and "DoRA" in why
    with pytest.raises(ConfigError, match="DoRA"):
        lora_sync_of_model(flags(vllm_lora_sync="adapter"), model)
    dual = tiny_llama()
    apply_dual_lora(dual, 8, 4, alpha=8.0)
    assert lora_sync_of_model(flags(), dual)[0] == 16


def test_train_refuses_adapter_sync_it_cannot_keep(train_cli_error, monkeypatch):
    """Exit 2 at parse time, before any model loads (and without vLLM installed: a server's client needs none)."""
    import trl_ext.vllm.args

    monkeypatch.setattr(trl_ext.vllm.args, "vllm_installed", lambda: False)  # the fast tier's install
    server = ["--use_vllm", "--vllm_mode", "server", "--vllm_server_base_url", "http://127.0.0.1:1"]
    assert "full fine-tune" in train_cli_error("--reward", "happy_binary", *server, "--vllm_lora_sync", "adapter")
    assert "pushes whole tensors" in train_cli_error("--reward", "happy_binary", *server, "--lora_rank", "8",
                                                     "--vllm_weight_transfer", "gloo", "--vllm_lora_sync", "adapter")
    assert "needs --use_vllm" in train_cli_error("--reward", "happy_binary", "--lora_rank", "8", "--vllm_lora_sync",
                                                 "merged")  # fmt: skip


class _Accelerator:
    is_main_process = is_local_main_process = True
    num_processes = 1

    def wait_for_everyone(self):
        pass


def test_publisher_sends_the_base_once(tmp_path):
    """Adapter versions: the base weights at the first publish only, then each version's adapter alone; the
    metrics say so (bytes per publish, base sends)."""
    from collections import defaultdict

    from peft import LoraConfig, get_peft_model

    from trl_ext.vllm.publish import CheckpointPublisher

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    metrics = defaultdict(list)
    pub = CheckpointPublisher(_Accelerator(), 1, 0, root=str(tmp_path), adapter_rank=8, metrics=lambda: metrics)
    for v in range(4):
        pub.publish(v, model)
    assert [k for k, _, _ in pub.sent] == ["base", "adapter", "adapter", "adapter", "adapter"]
    adapter = pub.sent[1][1]
    assert adapter == 4 * 2 * (8 * 16 + 16 * 8 + 8 * 16 + 8 * 8)  # float32, 2 layers: q (16 -> 16), v (16 -> 8)
    assert metrics["vllm/base_sends"] == [1.0] * 4
    assert metrics["vllm/publish_bytes"][1:] == [float(adapter)] * 3
    assert metrics["vllm/publish_bytes"][0] == pub.sent[0][1] + adapter > 2 * adapter  # the base, then its adapter
    assert base_dir_of(pub.snapshot(3)) == os.path.join(pub.root, "base")
    assert sorted(os.listdir(pub.root)) == ["base", "v00000002", "v00000003"]  # k = 1: two versions kept
    assert base_dir_of(os.path.join(pub.root, "base")) is None  # a merged checkpoint is not an adapter
    eval_dir = pub.publish_adapter("eval-s1-both", model)
    assert base_dir_of(eval_dir) == os.path.join(pub.root, "base")
    with pytest.raises(ValueError, match="published already"):
        pub.publish_adapter("eval-s1-both", model)
    merged = CheckpointPublisher(_Accelerator(), 0, 0, root=str(tmp_path / "m"))
    merged.publish(0, model)
    assert [k for k, _, _ in merged.sent] == ["merged"] and merged.base_sends == 0


def test_an_adapter_is_asked_for_by_its_served_name(tmp_path, monkeypatch):
    from trl_ext.serve import client
    from trl_ext.serve.endpoint import adapter_name

    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / CONFIG).write_text("{}")
    (tmp_path / "m").mkdir()
    assert adapter_name(str(tmp_path / "v1")) == adapter_name(str(tmp_path / "x" / ".." / "v1"))
    assert adapter_name(str(tmp_path / "v1")) != adapter_name(str(tmp_path / "m"))
    sent = []

    class Answer:
        headers = {"X-Policy-Version": "3"}

        def json(self):
            return {"choices": [{"token_ids": [1], "logprobs": {"token_logprobs": [-0.5]}}]}

    replica = client.Replica("http://127.0.0.1:1")
    replica.model = "base-model"
    monkeypatch.setattr(replica, "_request", lambda method, path, body, headers, resend_check=None:
                        sent.append((body["model"], dict(headers))) or Answer())  # fmt: skip
    for d in ("v1", "m"):
        replica.sample([1, 2], max_tokens=1, temperature=1.0, seed=0, stop_token_ids=[], version=3,
                       directory=str(tmp_path / d))  # fmt: skip
    assert sent[0][0] == adapter_name(str(tmp_path / "v1")) and sent[1][0] == "base-model"
    assert sent[0][1]["X-Policy-Dir"] == str(tmp_path / "v1")


def test_layout_starts_the_policy_servers_for_the_runs_adapters():
    """layout.py reads train.py's flags: a dual LoRA r8 run at k = 1 gets policy servers with LoRA up to rank 16 and
    k + 2 adapters per batch; a full fine-tune gets none (its versions go merged)."""
    from trl_ext.serve.plan import LayoutArgs, plan_layout

    args = LayoutArgs(inference_gpu_ids="0", trainer_gpu_ids="1")
    dual = plan_layout(args, ["--reward", "sentence_length_5_with_happy", "--model", "builtin", "--lora_config", "r8",
                              "--gradient_routing", "--routing_mode", "shared", "--max_async_level", "1"], False)
    command = dual.servers[0].command
    i = command.index("--enable-lora")
    assert command[i:i + 7] == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "3", "--max-cpu-loras", "6"]
    full = plan_layout(args, ["--reward", "happy_binary", "--model", "builtin"], False)
    assert "--enable-lora" not in full.servers[0].command
    merged = plan_layout(args, ["--reward", "happy_binary", "--model", "builtin", "--lora_rank", "8",
                                "--vllm_lora_sync", "merged"], False)  # fmt: skip
    assert "--enable-lora" not in merged.servers[0].command


def test_an_engine_with_lora_serves_runs_without_it(monkeypatch):
    """shared_llm: one engine per arguments in a process; an engine started with LoRA also serves a run without LoRA
    and a run asking for a smaller LoRA, not one asking for more (a later engine is started for it)."""
    from trl_ext.vllm import engine as engines
    from trl_ext.vllm.engine import lora_settings, shared_llm

    monkeypatch.setattr(engines, "_ENGINES", {})
    built = []

    def build(**kwargs):
        built.append(kwargs)
        return len(built)

    first = shared_llm(build, model="m", **lora_settings(16, 0))
    assert shared_llm(build, model="m") == first  # no LoRA: served by the LoRA engine
    assert shared_llm(build, model="m", **lora_settings(8, 0)) == first  # a smaller rank
    assert shared_llm(build, model="other") != first  # other arguments: another engine
    bigger = shared_llm(build, model="m", **lora_settings(32, 1))
    assert bigger != first and len(built) == 3
    plain = shared_llm(build, model="p")
    assert shared_llm(build, model="p", **lora_settings(8, 0)) != plain  # an engine without LoRA serves no adapter
