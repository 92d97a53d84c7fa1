"""Bring your own model: the adapters' view of each architecture (trl_ext/models/arch.py) and the architecture
matrix: tiny random models of nine families, each trained 2 steps through train.py's ``main`` in five modes (full,
PEFT LoRA, routed dual LoRA, the fast generation backend, k = 1 off-policy). A cell either runs and keeps its
invariants, or is refused at parse time (exit 2) with a stated reason. ``uv run pytest tests/test_architectures.py``.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import trl_ext.cli_train as cli
from trl_ext.models.arch import architecture, architecture_of, model_config
from trl_ext.models.tiny import build_tiny, tiny_config
from trl_ext.registry import ConfigError

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3", "olmo2", "gpt2", "gpt_neox")
LLAMA = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# family -> (ModuleList of its decoder blocks, default LoRA targets: one name per linear layer of a block)
STRUCTURE = {
    **{f: ("model.layers", LLAMA) for f in ("llama", "qwen2", "qwen3", "mistral", "gemma2", "olmo2")},
    "phi3": ("model.layers", ("o_proj", "qkv_proj", "gate_up_proj", "down_proj")),
    "gpt2": ("transformer.h", ("c_attn", "attn.c_proj", "c_fc", "mlp.c_proj")),
    "gpt_neox": ("gpt_neox.layers", ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")),
}
CONV1D = {"gpt2"}  # transformers' Conv1D layers (weight [in, out]): PEFT's fan_in_fan_out


def tiny_arch(family):
    return architecture_of(tiny_config(family, 64, 1))


@pytest.mark.parametrize("family", FAMILIES)
def test_structure_from_the_config_alone(family):
    arch = tiny_arch(family)
    blocks, targets = STRUCTURE[family]
    assert (arch.model_type, arch.blocks, arch.num_blocks, arch.has_mlp) == (family, blocks, 2, True)
    assert arch.default_targets == targets
    resolved = arch.resolve(None)
    assert resolved.names == targets and resolved.fan_in_fan_out == (family in CONV1D)
    assert len(arch.matched(targets)) == len(arch.linears)  # the defaults select every linear layer of a block
    # the meta-device view is the real model's
    from transformers import AutoModelForCausalLM

    assert architecture(AutoModelForCausalLM.from_config(tiny_config(family, 64, 1))) == arch


def test_target_names_are_checked_against_the_model():
    gpt2 = tiny_arch("gpt2")
    assert gpt2.matched(["c_proj"]) == ["attn.c_proj", "mlp.c_proj"]  # PEFT's suffix rule: both
    assert gpt2.resolve(["c_attn", "mlp.c_proj"]).names == ("c_attn", "mlp.c_proj")
    with pytest.raises(ConfigError, match=r"'q_proj' names no linear layer.*gpt2 block: c_attn, attn.c_proj, c_fc"):
        gpt2.resolve(["q_proj"])
    with pytest.raises(ConfigError, match="distinct"):
        gpt2.resolve(["c_fc", "c_fc"])
    with pytest.raises(ConfigError, match="'lm_head' names no linear layer"):
        tiny_arch("llama").resolve(["lm_head"])
    assert tiny_arch("phi3").resolve(["qkv_proj"]).names == ("qkv_proj",)  # fused: one linear layer
    with pytest.raises(ConfigError, match="'q_proj' names no linear layer of the model; linear layers of a phi3"):
        tiny_arch("phi3").resolve(["q_proj"])
    assert architecture_of(model_config("builtin")).resolve(None).names == LLAMA


@pytest.mark.parametrize("adapter", ["lora", "mlp"])
@pytest.mark.parametrize("family", FAMILIES)
def test_dual_adapter_checkpoints_round_trip(family, adapter, tmp_path):
    """Dual LoRA on every linear layer (or MLP adapters beside every block's MLP) of each family: the model starts as
    the base model, and full and adapter-only checkpoints rebuild it exactly."""
    from transformers import AutoModelForCausalLM

    from trl_ext.routing.adapter_layout import ADAPTER_FILENAME, save_layout
    from trl_ext.routing.adapters import apply_dual_lora, forget_params, retain_params
    from trl_ext.routing.checkpoint import adapter_state, base_fingerprint, load_dual_lora_checkpoint
    from trl_ext.routing.mlp import apply_dual_mlp

    base_dir = build_tiny(family, tmp_path / "base", tokenizer="builtin")
    model = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    fingerprint = base_fingerprint(model)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    base_logits = model(ids).logits
    if adapter == "lora":
        layout = apply_dual_lora(model, 2, 3, 4.0)
        assert layout.targets == STRUCTURE[family][1] and layout.layers == [0, 1]
    else:
        layout = apply_dual_mlp(model, 2, 3)
    assert torch.equal(model(ids).logits, base_logits)  # B = 0 (LoRA), down = 0 (MLP)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in retain_params(model) + forget_params(model):
            p.normal_(0, 0.1)
    want = model(ids).logits
    assert (want - base_logits).abs().max() > 1e-3
    full, adapter_only = tmp_path / "full", tmp_path / "adapter_only"
    model.save_pretrained(full)
    save_layout(full, layout, "exclusive")
    adapter_only.mkdir()
    from safetensors.torch import save_file

    save_file(adapter_state(model), adapter_only / ADAPTER_FILENAME)
    save_layout(adapter_only, layout, "shared", base={"path": str(base_dir), "fingerprint": fingerprint})
    for ckpt in (full, adapter_only):
        assert torch.equal(load_dual_lora_checkpoint(ckpt)(ids).logits, want), ckpt.name


def test_mlp_adapters_refused_for_blocks_without_mlp(train_cli_error, tmp_path, monkeypatch):
    import dataclasses

    import trl_ext.models.arch as arch

    real = arch.architecture_of
    monkeypatch.setattr(arch, "architecture_of", lambda cfg: dataclasses.replace(real(cfg), has_mlp=False))
    err = train_cli_error("--reward", "happy_binary", "--output_dir", str(tmp_path), "--adapter_type", "mlp",
                          "--mlp_config", "m16")
    assert "--adapter_type mlp wraps each decoder block's .mlp: llama blocks have none" in err


def test_targets_at_parse_time(train_cli_error, tmp_path):
    base = ["--reward", "happy_binary", "--output_dir", str(tmp_path)]
    err = train_cli_error(*base, "--lora_rank", "4", "--lora_target_modules", "q_proj,c_attn")
    assert "'c_attn' names no linear layer" in err and "llama block: q_proj, k_proj" in err
    err = train_cli_error(*base, "--lora_config", "r4", "--lora_target_modules", "w_proj")
    assert "'w_proj' names no linear layer" in err
    assert "applies only with --lora_rank" in train_cli_error(*base, "--lora_target_modules", "q_proj")
    mlp = ["--adapter_type", "mlp", "--mlp_config", "m16", "--lora_target_modules", "q_proj"]
    assert "applies only with --lora_rank" in train_cli_error(*base, *mlp)
    assert "must be comma-separated names" in train_cli_error(*base, "--lora_rank", "4", "--lora_target_modules", "a,")
    err = train_cli_error(*base, "--lora_config", "r4", "--lora_layer_start", "2", "--lora_layer_end", "9")
    assert "exceed the 4 decoder blocks" in err
    plan = cli.build_plan([*base, "--lora_rank", "4", "--lora_target_modules", "q_proj, v_proj"])
    assert plan.run.lora_targets.names == ("q_proj", "v_proj") and not plan.run.lora_targets.fan_in_fan_out
    assert cli.build_plan([*base, "--lora_config", "r4"]).run.lora_targets.names == LLAMA
    assert cli.build_plan(base).run.lora_targets is None


# ------------------------------------------------------------------------------------------- the matrix
MODES = {
    "full": [],
    "lora": ["--lora_rank", "4"],
    "routed": ["--gradient_routing", "--routing_mode", "shared", "--lora_config", "r4", "--rh_detector", "happy",
               "--eval_routing_steps", "0", "--save_adapter_only"],
    "fast": ["--generation_backend", "fast"],
    "k1": ["--max_async_level", "1", "--disable_dropout"],  # GPT-2's dropout: refused without it (below)
}
# A reward that random completions spread (a sentence's word count), so every cell gets nonzero advantages and its
# weights move; the routed cells add the "happy" detector.
REWARD = "sentence_length_5_smooth"
FAST_REFUSED = {"gpt2", "gpt_neox"}  # the fast backend implements neither (trl_ext.generation.families)
CELLS = [(f, m) for f in FAMILIES for m in MODES]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, builtin_path):
    root = tmp_path_factory.mktemp("tiny")
    return {f: build_tiny(f, root / f, tokenizer="builtin") for f in FAMILIES}


def lora_shapes(model_dir, rank=4) -> dict[str, int]:
    """Expected LoRA parameter count per linear layer of every block: r * (in + out)."""
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    from trl_ext.models.arch import block_linears, decoder_blocks

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prefix, blocks = decoder_blocks(model)
    out = {}
    for i, block in enumerate(blocks):
        for path, m in block_linears(block).items():
            fan_in, fan_out = m.weight.shape if isinstance(m, Conv1D) else m.weight.shape[::-1]
            out[f"{prefix}.{i}.{path}"] = rank * (fan_in + fan_out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family,mode", CELLS, ids=[f"{f}-{m}" for f, m in CELLS])
def test_cell(tiny_models, tmp_path, capsys, family, mode):
    model_dir = tiny_models[family]
    argv = ["--reward", REWARD, "--model", str(model_dir), "--prompts", "builtin", "--max_completion_length",
            "8", "--batch_size", "4", "--num_generations", "2", "--max_steps", "2", "--logging_steps", "1",
            "--save_steps", "2", "--lr", "1e-3", "--no_wandb", "--output_dir", str(tmp_path), *MODES[mode]]
    if mode == "fast" and family in FAST_REFUSED:
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert f"'{family}'" in err and "--generation_backend trl" in err
        return
    assert cli.main(argv) == 0
    (run_dir,) = tmp_path.iterdir()
    ckpt = run_dir / "checkpoint-2"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    logs = [r for r in state["log_history"] if "loss" in r]
    assert [r["step"] for r in logs] == [1, 2] and all(math.isfinite(r["loss"]) for r in logs)
    if mode == "k1":
        assert all(r["offpolicy/policy_lag_max"] <= 1 for r in logs)
    if mode == "lora":
        check_lora_checkpoint(model_dir, ckpt, family)
    elif mode == "routed":
        check_routed_checkpoint(model_dir, ckpt, family)
    else:
        check_full_checkpoint(model_dir, ckpt)
    if mode in ("lora", "routed"):  # eval_run.py rebuilds the adapters from the checkpoint and samples
        from trl_ext.evaluate import main as eval_main

        assert eval_main(["--model_path", str(ckpt), "--n_samples", "4", "--n_print", "0", "--device", "cpu"]) == 0
        report = json.loads((run_dir / "eval_checkpoint-2.json").read_text())
        assert report["kind"] == {"lora": "peft_lora", "routed": "dual_lora"}[mode]
        assert (report["routing"] is not None) == (mode == "routed")


def check_full_checkpoint(model_dir, ckpt):
    """Every parameter trains: the checkpoint reloads and every block's linear weights moved."""
    from transformers import AutoModelForCausalLM

    from trl_ext.models.arch import block_linears, decoder_blocks

    before, after = (AutoModelForCausalLM.from_pretrained(d) for d in (model_dir, ckpt))
    moved = [not torch.equal(a.weight, b.weight) for blocks in [(decoder_blocks(before)[1], decoder_blocks(after)[1])]
             for x, y in zip(*blocks) for a, b in zip(block_linears(x).values(), block_linears(y).values())]
    assert moved and all(moved)


def check_lora_checkpoint(model_dir, ckpt, family):
    """PEFT adapters on every linear layer of every block (r * (in + out) parameters each), nothing else; the
    adapter checkpoint reloads onto the base model and changes its output only through B (B = 0 at init)."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    saved = load_file(ckpt / "adapter_model.safetensors")
    counts: dict[str, int] = {}
    for key, t in saved.items():
        module = key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
        counts[module] = counts.get(module, 0) + t.numel()
    assert counts == lora_shapes(model_dir)
    config = json.loads((ckpt / "adapter_config.json").read_text())
    assert config["fan_in_fan_out"] == (family in CONV1D)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), ckpt)
    ids = torch.tensor([[3, 4, 5, 6]])
    assert torch.isfinite(model(ids).logits).all()


def check_routed_checkpoint(model_dir, ckpt, family):
    """Retain and forget adapters on every linear layer of every block; the adapter-only checkpoint reloads onto the
    base model (its fingerprint checked) with its layout."""
    from trl_ext.routing.adapters import DualLoRALinear
    from trl_ext.routing.checkpoint import load_dual_lora_checkpoint

    layout = json.loads((ckpt / "dual_lora_layout.json").read_text())
    assert layout["targets"] == list(STRUCTURE[family][1]) and layout["routing_mode"] == "shared"
    assert layout["base_model"]["path"] == str(model_dir.resolve())
    model = load_dual_lora_checkpoint(ckpt)
    wrapped = {n: m for n, m in model.named_modules() if isinstance(m, DualLoRALinear)}
    expected = lora_shapes(model_dir)
    assert set(wrapped) == set(expected)
    for name, m in wrapped.items():  # retain rank 4 + forget rank 4
        assert sum(p.numel() for _, p in m.adapter_named_parameters()) == 2 * expected[name]
    assert any(m.retain_B.abs().max() > 0 for m in wrapped.values())  # the retain adapter trained
    assert torch.isfinite(model(torch.tensor([[3, 4, 5, 6]])).logits).all()


@pytest.mark.slow
def test_sft_lora_on_gpt2_merges_conv1d(tmp_path):
    """--mode sft with PEFT LoRA on GPT-2's Conv1D layers (fan_in_fan_out): the merged model reloads as a plain GPT-2
    whose every block linear moved and whose embeddings did not."""
    from transformers import AutoModelForCausalLM

    from trl_ext.models import model_source
    from trl_ext.models.arch import block_linears, decoder_blocks

    model_source("builtin_env")  # its tokenizer (built once, cached)
    base = build_tiny("gpt2", tmp_path / "gpt2", tokenizer="builtin_env")
    argv = ["--mode", "sft", "--env", "frozenlake", "--model", str(base), "--lora_rank", "4", "--sft_train_size", "4",
            "--sft_test_size", "2", "--sft_epochs", "1", "--batch_size", "16", "--max_completion_length", "16",
            "--lr", "1e-3", "--logging_steps", "1", "--no_wandb", "--output_dir", str(tmp_path / "out")]
    assert cli.main(argv) == 0
    (run_dir,) = (tmp_path / "out").iterdir()
    summary = json.loads((run_dir / "run_summary.json").read_text())
    assert summary["status"] == "done" and math.isfinite(summary["train_loss"])
    before, after = (AutoModelForCausalLM.from_pretrained(d) for d in (base, summary["model_dir"]))
    pairs = zip(decoder_blocks(before)[1], decoder_blocks(after)[1])
    moved = [not torch.equal(a.weight, b.weight) for x, y in pairs
             for a, b in zip(block_linears(x).values(), block_linears(y).values())]
    assert len(moved) == 8 and all(moved)
    assert torch.equal(before.transformer.wte.weight, after.transformer.wte.weight)


def test_offpolicy_with_active_dropout_exits_2(tiny_models, train_cli_error):
    """GPT-2's config has dropout 0.1: the generator samples without it, the trainer's forward applies it, so the
    lag-0 importance ratio would not be 1. Refused at parse time unless --disable_dropout."""
    err = train_cli_error("--model", str(tiny_models["gpt2"]), "--prompts", "builtin", "--reward", REWARD,
                          "--max_async_level", "1")  # fmt: skip
    assert "active dropout (transformer.drop" in err and "pass --disable_dropout" in err
