"""trl_ext.serve.fit: the dry-run plan of a layout on stated inventories, from configs alone (built in memory or
saved to tmp_path: no download, no weights). Every number is checked against a hand computation written out here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import GPT2Config, Qwen2Config

from trl_ext.registry import ConfigError
from trl_ext.serve import fit
from trl_ext.serve.dry_run import dry_run
from trl_ext.serve.fit import (GiB, ServerPart, TrainerPart, cuda_inventory, kv_bytes_per_token, lora_params,
                               model_shape, parse_inventory, plan_fit)  # fmt: skip

# Qwen2.5-7B's shape (its config.json), untied embeddings
H, L, HEADS, KV, I, V = 3584, 28, 28, 4, 18944, 152064
HD = H // HEADS  # 128
QWEN7B = dict(hidden_size=H, num_hidden_layers=L, num_attention_heads=HEADS, num_key_value_heads=KV,
              intermediate_size=I, vocab_size=V, tie_word_embeddings=False)  # fmt: skip

# the hand count: q/k/v carry biases in Qwen2, o and the MLP do not; RMSNorms have one weight vector
ATTN = (H * H + H) + 2 * (H * KV * HD + KV * HD) + H * H
LAYER = ATTN + 3 * H * I + 2 * H
OUTSIDE = V * H + V * H + H  # embeddings, lm_head (untied), final norm
PARAMS = OUTSIDE + L * LAYER
LORA16 = 16 * L * ((H + H) + 2 * (H + KV * HD) + (H + H) + 2 * (H + I) + (I + H))  # q, k, v, o, gate, up, down


@pytest.fixture(scope="module")
def qwen7b():
    return model_shape(Qwen2Config(**QWEN7B))


def tiny_qwen(**kw) -> Qwen2Config:
    base = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=100, tie_word_embeddings=True)  # fmt: skip
    return Qwen2Config(**{**base, **kw})


def test_7b_shape_matches_the_hand_count(qwen7b):
    assert PARAMS == 7_615_616_512  # Qwen2.5-7B's published parameter count
    assert qwen7b.params == PARAMS
    assert (qwen7b.layers, qwen7b.hidden, qwen7b.heads, qwen7b.kv_heads, qwen7b.head_dim, qwen7b.vocab) == \
        (L, H, HEADS, KV, HD, V)  # fmt: skip
    assert qwen7b.largest_layer_params == LAYER and qwen7b.outside_params == OUTSIDE
    assert len(qwen7b.linear_shapes) == 7 * L
    assert qwen7b.linear_shapes[:3] == (("self_attn.q_proj", H, H), ("self_attn.k_proj", H, KV * HD),
                                        ("self_attn.v_proj", H, KV * HD))  # fmt: skip
    assert kv_bytes_per_token(qwen7b, "bfloat16", 1) == 2 * 28 * 4 * 128 * 2 == 57344
    assert kv_bytes_per_token(qwen7b, "float32", 1) == 2 * 57344
    # vLLM splits the 4 KV heads over the ranks, and replicates them past 4 ranks (at least one per rank)
    assert kv_bytes_per_token(qwen7b, "bfloat16", 2) == 57344 // 2
    assert kv_bytes_per_token(qwen7b, "bfloat16", 8) == 2 * 28 * 1 * 128 * 2


def test_tied_embeddings_count_once_and_a_saved_folder_reads(tmp_path):
    tiny_qwen().save_pretrained(tmp_path)
    shape = model_shape(str(tmp_path))
    layer = (64 * 64 + 64) + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert shape.tied_embeddings and shape.params == 100 * 64 + 64 + 2 * layer  # one embedding, final norm
    assert model_shape(tiny_qwen(tie_word_embeddings=False)).params == shape.params + 100 * 64
    with pytest.raises(ConfigError, match="cannot read the config of"):
        model_shape(str(tmp_path / "missing"))


def test_8x80_policy_teacher_and_fsdp2_lora_trainer_fit(qwen7b):
    servers = [ServerPart("policy", 0, qwen7b, [0], "bfloat16"), ServerPart("teacher", 0, qwen7b, [1], "bfloat16")]
    trainer = TrainerPart(qwen7b, [2, 3, 4, 5, 6, 7], "FSDP2", lora_rank=16, rows_per_micro_batch=4, seq_len=2048,
                          gradient_checkpointing=True, reference_copy=True)  # fmt: skip
    plan = plan_fit(servers, trainer, parse_inventory("8x80"))
    assert plan.problems == []
    plan.check()
    # the policy server on GPU 0: 0.92 of 80 GiB, less bf16 weights and the reserve (1 GiB + 1024 rows of fp32
    # logits: vLLM's max_num_seqs default on an 80 GiB device), in whole 16-token blocks of 57344 bytes a token
    (_, [server]) = plan.devices[0]
    share = int(0.92 * 80 * GiB)
    budget = share - PARAMS * 2 - (GiB + 1024 * V * 4)
    assert server.claimed == share
    assert [n for _, n, _ in server.items] == [PARAMS * 2, GiB + 1024 * V * 4, budget]
    assert server.kv_tokens == budget // (57344 * 16) * 16 == 1_082_928
    # each trainer process: FSDP2 shards the fp32 base and the LoRA adapters, their gradients and AdamW state / 6
    assert LORA16 == 40_370_176
    (_, [proc]) = plan.devices[2]
    items = dict((label.split(",")[0].split(" (")[0], n) for label, n, _ in proc.items)
    assert items["parameters"] == (PARAMS * 4 + LORA16 * 4) // 6
    assert items["gradients"] == LORA16 * 4 // 6
    assert items["AdamW state"] == 2 * LORA16 * 4 // 6
    assert items["FSDP2 all-gather: root unit + 2 blocks"] == (OUTSIDE + 2 * LAYER) * 4
    assert items["logits + fp32 log-softmax of 4 x 2048 tokens"] == 4 * 2048 * V * (4 + 4)
    assert items["activations of 4 x 2048 tokens"] == 4 * 2048 * H * (L + fit.ACTIVATION_ELEMENTS) * 4
    assert "reference model" not in items  # beta > 0 under LoRA: the adapter-disabled model is the reference
    assert proc.claimed == sum(n for _, n, _ in proc.items)
    assert plan.free_bytes(7) == 80 * GiB - proc.claimed
    text = plan.describe()
    assert "KV cache holds 1,082,928 tokens; max_model_len 8,192 tokens" in text
    assert "(estimate)" in text and "GiB" in text and text.endswith("fits (estimates labelled; GiB = 2**30 bytes)")


def test_full_fine_tune_fits_under_fsdp2_but_not_ddp(qwen7b):
    inventory = parse_inventory("8x80")
    fsdp = TrainerPart(qwen7b, [2, 3, 4, 5, 6, 7], "FSDP2", reference_copy=True)
    items = {label.split(",")[0].split(" (")[0]: n for label, n, _ in fit.trainer_items(fsdp)}
    assert items["parameters"] == PARAMS * 4 // 6 and items["AdamW state"] == 2 * PARAMS * 4 // 6
    assert items["reference model"] == PARAMS * 4 // 6  # TRL shards the reference model under FSDP2 too
    assert plan_fit([], fsdp, inventory).problems == []
    ddp = TrainerPart(qwen7b, [2, 3, 4, 5, 6, 7], "DDP", reference_copy=True)
    items = {label.split(",")[0].split(" (")[0]: n for label, n, _ in fit.trainer_items(ddp)}
    assert items["parameters"] == PARAMS * 4 and items["gradients"] == 2 * PARAMS * 4  # + DDP's bucket copy
    problems = plan_fit([], ddp, inventory).problems
    assert len(problems) == 1
    assert problems[0].startswith("GPU 2 (80.00 GiB) (and GPUs 3, 4, 5, 6, 7 alike): a trainer process needs "
                                  f"{sum(n for _, n, _ in fit.trainer_items(ddp)) / GiB:.2f} GiB (parameters 28.37 GiB")
    assert problems[0].endswith("but 80.00 GiB is left")


def test_policy_and_teacher_on_one_24_gib_device_are_refused(qwen7b):
    servers = [ServerPart("policy", 0, qwen7b, [0], "bfloat16", 0.45), ServerPart("teacher", 0, qwen7b, [0],
                                                                                 "bfloat16", 0.45)]  # fmt: skip
    plan = plan_fit(servers, None, parse_inventory("1x24"))
    reserve = (GiB + 256 * V * 4) / GiB  # max_num_seqs 256 below 70 GiB
    assert f"{PARAMS * 2 / GiB:.2f}" == "14.19" and f"{0.45 * 24:.2f}" == "10.80"
    expected = (f"GPU 0 (24.00 GiB): policy server 0 needs 14.19 GiB of weights in bfloat16 + {reserve:.2f} GiB of "
                "activations (estimate) with 0.45 of the device = 10.80 GiB")
    assert plan.problems[0] == expected and plan.problems[1].startswith("GPU 0 (24.00 GiB): teacher server 0 needs")
    with pytest.raises(ConfigError, match=r"does not fit its devices: GPU 0 \(24\.00 GiB\): policy server 0 needs"):
        plan.check()
    assert "does not fit: GPU 0 (24.00 GiB)" in plan.describe()
    # at vLLM's default share each, the two servers claim more than the device
    both = plan_fit([ServerPart("policy", 0, qwen7b, [0]), ServerPart("teacher", 0, qwen7b, [0])], None,
                    parse_inventory("1x24"))  # fmt: skip
    assert "GPU 0 (24.00 GiB): its servers claim 0.92 + 0.92 = 1.84 of the device" in "\n".join(both.problems)


def test_kv_cache_shorter_than_max_model_len_and_tp_heads_are_refused(qwen7b):
    alone = ServerPart("policy", 0, qwen7b, [0], "bfloat16", max_model_len=8192)
    assert plan_fit([alone], None, parse_inventory("1x24")).problems == []
    alone.max_model_len = 200_000
    budget = int(0.92 * 24 * GiB) - PARAMS * 2 - (GiB + 256 * V * 4)
    (problem,) = plan_fit([alone], None, parse_inventory("1x24")).problems
    assert problem.startswith(f"GPU 0 (24.00 GiB): policy server 0's KV cache of {budget / GiB:.2f} GiB")
    assert f"holds {budget // (57344 * 16) * 16:,} tokens at 57,344 bytes per token, fewer than max_model_len " \
           "200,000" in problem  # fmt: skip
    tp3 = plan_fit([ServerPart("policy", 0, qwen7b, [0, 1, 2])], None, parse_inventory("4x80"))
    assert tp3.problems[0].startswith("GPUs 0,1,2: policy server 0's tensor-parallel size 3 does not divide the 28 "
                                      "attention heads")
    tp4 = plan_fit([ServerPart("policy", 0, qwen7b, [0, 1, 2, 3], "bfloat16")], None, parse_inventory("4x80"))
    assert tp4.problems == [] and tp4.devices[3][1][0].items[0][1] == PARAMS * 2 // 4


def test_inventory_parsing_and_refusals(qwen7b):
    devices = parse_inventory("8x80")
    assert [d.index for d in devices] == list(range(8)) and {d.total_bytes for d in devices} == {80 * 2**30}
    mixed = parse_inventory("2x80, 1x23.5")
    assert [(d.index, d.total_bytes) for d in mixed] == [(0, 80 * GiB), (1, 80 * GiB), (2, int(23.5 * GiB))]
    for bad in ["", "8", "8*80", "x80", "8x", "8x80,", "-1x80", "eightx80"]:
        with pytest.raises(ConfigError, match="COUNTxGIB"):
            parse_inventory(bad)
    for bad in ["0x80", "8x0"]:
        with pytest.raises(ConfigError, match="counts >= 1 and sizes > 0"):
            parse_inventory(bad)
    with pytest.raises(ConfigError, match=r"teacher server 0 names GPU 2, which the inventory lacks \(GPUs: 0, 1\)"):
        plan_fit([ServerPart("teacher", 0, qwen7b, [2])], None, parse_inventory("2x80"))
    with pytest.raises(ConfigError, match="the trainer names GPU 1 twice"):
        plan_fit([], TrainerPart(qwen7b, [1, 1]), parse_inventory("2x80"))
    with pytest.raises(ConfigError, match="gpu_memory_utilization must be in"):
        plan_fit([ServerPart("policy", 0, qwen7b, [0], gpu_memory_utilization=1.5)], None, parse_inventory("1x80"))
    with pytest.raises(ConfigError, match="cannot size dtype 'auto'"):
        plan_fit([ServerPart("policy", 0, qwen7b, [0], "auto")], None, parse_inventory("1x80"))


def test_cuda_inventory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda_inventory() == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(total_memory=(80 + i) * GiB, name=f"card{i}"))  # fmt: skip
    assert [(d.index, d.total_bytes, d.name) for d in cuda_inventory()] == [(0, 80 * GiB, "card0"),
                                                                            (1, 81 * GiB, "card1")]  # fmt: skip


def test_lora_count_on_a_tiny_config_matches_hand_and_peft():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    shape = model_shape(tiny_qwen())
    # per layer, rank 4: q (64+64), k (64+32), v (64+32), o (64+64), gate and up (64+128), down (128+64)
    assert lora_params(shape, 4) == 2 * 4 * (128 + 96 + 96 + 128 + 192 + 192 + 192) == 8192
    assert lora_params(shape, 4, ["q_proj", "v_proj"]) == 2 * 4 * (128 + 96)
    assert lora_params(shape, 4, ["self_attn.o_proj"]) == 2 * 4 * 128
    with pytest.raises(ConfigError, match="LoRA target 'lm_head' names no linear layer of a qwen2 block"):
        lora_params(shape, 4, ["lm_head"])
    torch.manual_seed(0)
    for config, targets in [(tiny_qwen(), None), (tiny_qwen(), ["q_proj", "v_proj"]),
                            (GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=50, n_positions=16), None)]:
        shape = model_shape(config)
        arch_targets = targets or sorted({p.split(".")[-1] if config.model_type != "gpt2" else p
                                          for p, _, _ in shape.linear_shapes})  # fmt: skip
        peft = get_peft_model(AutoModelForCausalLM.from_config(config),
                              LoraConfig(r=4, target_modules=arch_targets, fan_in_fan_out=config.model_type == "gpt2"))
        assert lora_params(shape, 4, targets) == peft.get_nb_trainable_parameters()[0]


def test_hub_id_resolves_from_the_local_cache_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants

    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    tiny_qwen().save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # read at import
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert model_shape("org/tiny") == model_shape(tiny_qwen())
    with pytest.raises(ConfigError, match="cannot read the config of org/absent"):
        model_shape("org/absent")


def test_dry_run_sizes_dual_adapters(tmp_path):
    """Gradient routing's dual adapters are the trainable parameters (the base frozen, no reference copy): dual LoRA
    8 + 8 as a LoRA of rank 16 on the same linears, dual MLP adapters as 3 x hidden x neurons per block."""
    Qwen2Config(**QWEN7B).save_pretrained(tmp_path)
    model = str(tmp_path)
    server = SimpleNamespace(role="policy", index=0, model=model, devices=[0], gpu_share=0.9, max_model_len=8192,
                             config=Qwen2Config.from_pretrained(model),
                             command=["python", "-m", "vllm.entrypoints.openai.api_server", "--dtype", "bfloat16"])
    routed = ["--model", model, "--gradient_routing", "--routing_mode", "shared", "--beta", "0.04",
              "--per_device_train_batch_size", "1", "--activation_checkpointing"]
    layout = SimpleNamespace(servers=[server], flags=[*routed, "--lora_config", "r8"], trainer_devices=[1])
    text = dry_run(layout, SimpleNamespace(plan_gpus="2x80"))
    assert f"parameters (dual LoRA 8 + 8: {LORA16:,} trainable, fp32), unsharded" in text
    assert "reference model" not in text  # the adapters disabled are the reference
    layout.flags = [*routed, "--adapter_type", "mlp", "--mlp_config", "m16"]
    mlp = QWEN7B["num_hidden_layers"] * 3 * QWEN7B["hidden_size"] * 32
    assert f"parameters (dual MLP adapters 16 + 16: {mlp:,} trainable" in dry_run(layout, SimpleNamespace(plan_gpus="2x80"))


def test_dry_run_reads_the_layout_and_train_flags(tmp_path):
    """layout.py --dry_run's adapter: the servers as the layout starts them, the trainer from train.py's flags."""
    Qwen2Config(**QWEN7B).save_pretrained(tmp_path)  # config.json only
    model = str(tmp_path)

    def server(role, devices, share):
        return SimpleNamespace(role=role, index=0, model=model, devices=devices, gpu_share=share, max_model_len=8192,
                               config=Qwen2Config.from_pretrained(model),
                               command=["python", "-m", "vllm.entrypoints.openai.api_server", "--dtype", "bfloat16"])

    flags = ["--model", model, "--fsdp", "full_shard auto_wrap", "--lora_rank", "16", "--teacher_tau", "1", "--bf16",
             "--per_device_train_batch_size", "4", "--activation_checkpointing", "--max_completion_length", "512"]
    layout = SimpleNamespace(servers=[server("policy", [0], 0.9), server("teacher", [1], 0.9)], flags=flags,
                             trainer_devices=[2, 3, 4, 5, 6, 7])  # fmt: skip
    text = dry_run(layout, SimpleNamespace(plan_gpus="8x80"))
    assert text.startswith("layout.py --dry_run: 8 GPUs (--plan_gpus 8x80)")
    assert text.endswith("fits (estimates labelled; GiB = 2**30 bytes)")
    assert f"parameters (LoRA rank 16: {LORA16:,} trainable, fp32), / 6 (FSDP2)" in text
    assert "logits + fp32 log-softmax of 4 x 512 tokens (estimate)" in text
    assert "activations of 4 x 8192 tokens, checkpointed (estimate)" in text
    assert f"{(OUTSIDE + 2 * LAYER) * 2 / GiB:.2f} GiB" in text  # the all-gather in bfloat16 under --bf16
    layout.servers = [server("policy", [0], 0.45), server("teacher", [0], 0.45)]
    layout.trainer_devices = [1]
    layout.flags = flags[:-5]  # 32 rows of up to 8192 tokens, no activation checkpointing: the trainer is refused too
    with pytest.raises(ConfigError) as refused:
        dry_run(layout, SimpleNamespace(plan_gpus="1x24,1x80"))
    message = str(refused.value)
    assert message.startswith("the layout does not fit its devices: GPU 0 (24.00 GiB): policy server 0 needs "
                              "14.19 GiB of weights in bfloat16")
    assert "GPU 1 (80.00 GiB): a trainer process needs" in message
    assert "planned at the servers' max_model_len, 8192 tokens" in message and "GPU 0 (24.00 GiB) planned" in message
