"""DualLoRALinear, presets, apply/layout, scales and parameter groups (trl_ext/routing/adapters.py)."""

import copy
import math

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from trl_ext.registry import ConfigError
from trl_ext.routing.adapters import (
    ABLATION_SCALES, DualLoRALinear, adapters_disabled, apply_dual_lora, dual_lora_modules, forget_params, retain_params, scales, set_scales,
)
from trl_ext.routing.adapter_layout import LAYOUT_FILENAME, DualLoRALayout, load_layout, save_layout
from trl_ext.routing.checkpoint import apply_layout
from trl_ext.routing.step import routing_mask

D = torch.float64
ALL_LLAMA_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # a Llama block's linears


def hand_layer() -> DualLoRALinear:
    """2 -> 2 layer with retain rank 1, forget rank 2, alpha 2: s_r = 2, s_f = 1."""
    layer = DualLoRALinear(nn.Linear(2, 2).to(D), retain_rank=1, forget_rank=2, alpha=2)
    with torch.no_grad():
        layer.base_layer.weight.copy_(torch.tensor([[1.0, 2.0], [0.0, 1.0]]))
        layer.base_layer.bias.copy_(torch.tensor([0.5, -0.5]))
        layer.retain_A.copy_(torch.tensor([[1.0, 2.0]]))
        layer.retain_B.copy_(torch.tensor([[3.0], [4.0]]))
        layer.forget_A.copy_(torch.eye(2))
        layer.forget_B.copy_(torch.tensor([[1.0, 1.0], [0.0, 2.0]]))
    return layer


def tiny_llama(layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=32, max_position_embeddings=32, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).to(D)


def randomize_adapters(model):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in retain_params(model) + forget_params(model):
            p.normal_(0, 0.3)


def test_forward_by_hand_and_scales():
    layer, x = hand_layer(), torch.tensor([[1.0, 1.0]], dtype=D)
    # base W x + b = [3.5, 0.5]; retain 2 * B_r (A_r x = 3) = [18, 24]; forget 1 * B_f (A_f x = [1, 1]) = [2, 2].
    expected = {(1, 1): [23.5, 26.5], (1, 0): [21.5, 24.5], (0, 1): [5.5, 2.5], (0, 0): [3.5, 0.5],
                (0.5, 2): [16.5, 16.5]}
    for (r, f), y in expected.items():
        layer.retain_scale, layer.forget_scale = r, f
        assert torch.equal(layer(x), torch.tensor([y], dtype=D)), (r, f)


def test_gradients_by_hand():
    layer = hand_layer()
    x = torch.tensor([[1.0, 1.0]], dtype=D, requires_grad=True)
    layer(x).sum().backward()
    # L = sum(y): dB_r = s_r * (A_r x) = 2 * 3; dA_r = s_r * (1^T B_r) x^T = 2 * 7 * [1, 1];
    # dB_f = s_f * 1 (A_f x)^T = ones; dA_f = s_f * (B_f^T 1) x^T = [[1, 1], [3, 3]];
    # dx = W^T 1 + s_r A_r^T (B_r^T 1) + s_f A_f^T (B_f^T 1) = [1, 3] + 14 * [1, 2] + [1, 3] = [16, 34].
    assert torch.equal(layer.retain_B.grad, torch.tensor([[6.0], [6.0]], dtype=D))
    assert torch.equal(layer.retain_A.grad, torch.tensor([[14.0, 14.0]], dtype=D))
    assert torch.equal(layer.forget_B.grad, torch.ones(2, 2, dtype=D))
    assert torch.equal(layer.forget_A.grad, torch.tensor([[1.0, 1.0], [3.0, 3.0]], dtype=D))
    assert torch.equal(x.grad, torch.tensor([[16.0, 34.0]], dtype=D))
    assert layer.base_layer.weight.grad is None and not layer.base_layer.weight.requires_grad


def test_merged_weight_by_hand():
    layer = hand_layer()
    # W + 2 * B_r A_r + 1 * B_f A_f = [[1, 2], [0, 1]] + [[6, 12], [8, 16]] + [[1, 1], [0, 2]].
    assert torch.equal(layer.weight, torch.tensor([[8.0, 15.0], [8.0, 19.0]], dtype=D))
    with scales(layer, 0, 0):
        assert layer.weight is layer.base_layer.weight
    with routing_mask(layer, torch.tensor([True, False]), "shared"):
        with pytest.raises(RuntimeError, match="merged weight cannot route"):
            layer.weight
    # An all-good batch in exclusive mode: forget learns nothing, and gets a zero gradient tensor.
    with routing_mask(layer, torch.tensor([True, True]), "exclusive"):
        layer.weight.sum().backward()
    assert torch.equal(layer.forget_A.grad, torch.zeros(2, 2, dtype=D))
    assert torch.equal(layer.retain_B.grad, torch.tensor([[6.0], [6.0]], dtype=D))  # 2 * (A_r 1) = 2 * 3


def test_init_like_lora():
    torch.manual_seed(0)
    layer = DualLoRALinear(nn.Linear(25, 7), retain_rank=4, forget_rank=0, alpha=8)
    # Kaiming-uniform with a = sqrt(5): bound = sqrt(6 / ((1 + 5) * fan_in)) = 1 / sqrt(25) = 0.2.
    assert layer.retain_A.shape == (4, 25) and layer.retain_A.abs().max() <= 0.2
    assert layer.retain_A.abs().max() > 0.15  # 100 uniform draws reach close to the bound
    assert torch.equal(layer.retain_B, torch.zeros(7, 4))
    assert layer.forget_A is None and layer.forget_B is None and layer.scaling == {"retain": 2.0, "forget": 0.0}
    x = torch.randn(3, 25)
    assert torch.equal(layer(x), layer.base_layer(x))  # B = 0: the wrapped layer starts as the base
    assert DualLoRALinear(nn.Linear(4, 4).to(torch.bfloat16), 2, 2, 2).retain_A.dtype == torch.float32
    assert DualLoRALinear(nn.Linear(4, 4).to(D), 2, 2, 2).retain_A.dtype == D


def _ours_and_peft(proj: nn.Module, fan_in_fan_out: bool = False):
    """``proj`` wrapped by DualLoRALinear (retain rank 4, no forget side) and by PEFT LoRA (rank 4, alpha 8), with the
    same A and a nonzero B (so every gradient path is exercised): (ours, PEFT's layer)."""
    from peft import LoraConfig, inject_adapter_in_model

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = proj

    base = Tiny().to(D)
    ours = DualLoRALinear(copy.deepcopy(base.proj), retain_rank=4, forget_rank=0, alpha=8)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["proj"], fan_in_fan_out=fan_in_fan_out)
    lora = inject_adapter_in_model(config, base).proj
    with torch.no_grad():
        lora.lora_B["default"].weight.normal_()
        ours.retain_A.copy_(lora.lora_A["default"].weight)
        ours.retain_B.copy_(lora.lora_B["default"].weight)
    return ours, lora


def _assert_same_outputs_and_grads(ours, lora, x: torch.Tensor, out_features: int) -> None:
    w = torch.randn(*x.shape[:-1], out_features, dtype=D)
    outs, grads = [], []
    for layer, A, B in ((ours, ours.retain_A, ours.retain_B),
                        (lora, lora.lora_A["default"].weight, lora.lora_B["default"].weight)):
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        outs.append(y)
        grads.append(torch.autograd.grad((y * w).sum(), (xi, A, B)))
    assert (outs[0] - outs[1]).abs().max() <= 1e-12
    for g_ours, g_peft in zip(*grads):
        assert (g_ours - g_peft).abs().max() <= 1e-12


def test_matches_peft_lora_with_forget_rank_zero():
    torch.manual_seed(0)
    ours, lora = _ours_and_peft(nn.Linear(8, 6))
    _assert_same_outputs_and_grads(ours, lora, torch.randn(3, 5, 8, dtype=D), 6)


def test_conv1d_matches_peft_lora_fan_in_fan_out():
    """GPT-2's Conv1D (weight [in, out], y = x W + b) wrapped: output, gradients and the merged weight in Conv1D's
    layout equal PEFT LoRA with fan_in_fan_out=True (PEFT's merge writes W + (s B A)^T into the Conv1D)."""
    from transformers.pytorch_utils import Conv1D

    from trl_ext.generation.weights import affine_of

    torch.manual_seed(0)
    proj = Conv1D(6, 8)  # nf = 6 outputs, nx = 8 inputs: weight (8, 6)
    with torch.no_grad():
        proj.weight.normal_()
        proj.bias.normal_()
    bias = proj.bias.detach().to(D).clone()
    ours, lora = _ours_and_peft(proj, fan_in_fan_out=True)
    assert (ours.in_features, ours.out_features, ours.retain_A.shape, ours.retain_B.shape) == (8, 6, (4, 8), (6, 4))
    x = torch.randn(3, 5, 8, dtype=D)
    _assert_same_outputs_and_grads(ours, lora, x, 6)
    merged = ours.weight
    assert merged.shape == (8, 6)  # Conv1D's own layout
    assert (x[0] @ merged + ours.bias - ours(x[0])).abs().max() <= 1e-12  # y = x W_merged + b
    lora.merge()
    assert (merged - lora.base_layer.weight).abs().max() <= 1e-12
    # generation.weights.affine_of reads the wrapped layer as the affine map x -> x W^T + b, W^T [in, out]
    w_t, b = affine_of(ours, 8, merged)
    assert (w_t - merged).abs().max() <= 1e-12 and (b - bias).abs().max() <= 1e-12


def test_autocast_bf16_keeps_float32_grads():
    torch.manual_seed(0)
    layer = DualLoRALinear(nn.Linear(8, 8), 2, 2, 4)
    with torch.no_grad():
        layer.retain_B.normal_()
    x = torch.randn(2, 3, 8)
    ref = torch.autograd.grad(layer(x).sum(), layer.retain_A)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    g = torch.autograd.grad(y.float().sum(), layer.retain_A)[0]
    assert g.dtype == torch.float32 and (g - ref).abs().max() <= 0.05 * ref.abs().max()


def test_apply_dual_lora_layers_groups_and_tied_head():
    model = tiny_llama(layers=3)
    n_base = sum(p.numel() for p in model.parameters())
    layout = apply_dual_lora(model, 2, 3, 4.0, layer_stride=2, include_lm_head=True)
    assert layout.layers == [0, 2] and layout.layer_end == 3
    for i, layer in enumerate(model.model.layers):
        wrapped = {n.split(".")[-1] for n, m in layer.named_modules() if isinstance(m, DualLoRALinear)}
        assert wrapped == (set(ALL_LLAMA_PROJ) if i in (0, 2) else set())
    assert len(dual_lora_modules(model)) == 2 * 7 + 1
    # Tied LM head: the wrapped base weight is still the embedding, and frozen.
    assert model.lm_head.base_layer.weight is model.model.embed_tokens.weight
    assert not model.model.embed_tokens.weight.requires_grad
    # Parameter groups: disjoint, and together exactly the trainable parameters.
    r, f = retain_params(model), forget_params(model)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert len(r) == len(f) == 2 * 15 and not {id(p) for p in r} & {id(p) for p in f}
    assert {id(p) for p in r} | {id(p) for p in f} == trainable
    # Base parameters are unchanged in number (the tied weight is counted once).
    assert sum(p.numel() for p in model.parameters() if not p.requires_grad) == n_base
    model(torch.randint(0, 32, (2, 5))).logits.sum().backward()
    assert model.model.embed_tokens.weight.grad is None
    with pytest.raises(ValueError, match="already has dual adapters"):
        apply_dual_lora(model, 2, 3, 4.0)


def test_tied_head_survives_save_pretrained_and_tie_weights(tmp_path):
    from safetensors.torch import load_file

    model = tiny_llama()
    apply_dual_lora(model, 2, 3, 4.0, include_lm_head=True)
    randomize_adapters(model)
    model.save_pretrained(tmp_path)  # the shared (tied) tensor is written once, under the embedding's name
    saved = load_file(tmp_path / "model.safetensors")
    assert "lm_head.base_layer.weight" not in saved and "model.embed_tokens.weight" in saved
    model.tie_weights()
    assert model.lm_head.base_layer.weight is model.model.embed_tokens.weight
    rebuilt = tiny_llama()
    apply_dual_lora(rebuilt, 2, 3, 4.0, include_lm_head=True)
    missing, unexpected = rebuilt.load_state_dict(saved, strict=False)
    assert (missing, unexpected) == (["lm_head.base_layer.weight"], [])
    ids = torch.randint(0, 32, (2, 5))
    assert torch.equal(rebuilt(ids).logits, model(ids).logits)


@pytest.mark.parametrize("kwargs, match", [
    ({"layer_start": 2}, "bad layer range"), ({"layer_end": 3}, "bad layer range"),
    ({"layer_stride": 0}, "bad layer range"), ({"targets": ("q_proj", "w_proj")}, "'w_proj'"),
    ({"targets": ()}, "non-empty"),
])
def test_apply_dual_lora_rejects(kwargs, match):
    model = tiny_llama()
    with pytest.raises(ValueError, match=match):
        apply_dual_lora(model, 2, 2, 2.0, **kwargs)
    assert all(p.requires_grad for p in model.parameters())  # nothing changed
    assert not any(isinstance(m, DualLoRALinear) for m in model.modules())


def test_layout_round_trip_and_rebuild(tmp_path):
    model = tiny_llama()
    layout = apply_dual_lora(model, 1, 4, 16.0, layer_start=1, targets=("q_proj", "down_proj"))
    assert layout == DualLoRALayout(1, 4, 16.0, ("q_proj", "down_proj"), 1, 2, 1, False)
    assert DualLoRALayout.from_json(layout.to_json()) == layout
    assert save_layout(tmp_path, layout, "exclusive") == tmp_path / LAYOUT_FILENAME
    assert load_layout(tmp_path) == (layout, "exclusive")
    randomize_adapters(model)
    rebuilt = tiny_llama()
    apply_layout(rebuilt, load_layout(tmp_path)[0])
    rebuilt.load_state_dict(model.state_dict())  # strict: same parameter names and shapes
    ids = torch.randint(0, 32, (2, 6))
    assert torch.equal(rebuilt(ids).logits, model(ids).logits)
    with pytest.raises(ValueError, match="missing"):
        DualLoRALayout.from_dict({k: v for k, v in layout.to_dict().items() if k != "alpha"})
    with pytest.raises(ValueError, match="unknown"):
        DualLoRALayout.from_dict({**layout.to_dict(), "dropout": 0.1})
    with pytest.raises(ConfigError):
        save_layout(tmp_path, layout, "classic")


def test_scales_ablate_the_model_exactly():
    model = tiny_llama()
    base = copy.deepcopy(model)
    apply_dual_lora(model, 2, 3, 4.0, include_lm_head=True)
    randomize_adapters(model)
    ids = torch.randint(0, 32, (3, 7))
    with adapters_disabled(model):
        assert torch.equal(model(ids).logits, base(ids).logits)
    only = {}  # the same model built without the other side, sharing this side's weights
    for mode, ranks in (("retain_only", (2, 0)), ("forget_only", (0, 3))):
        single = copy.deepcopy(base)
        apply_dual_lora(single, *ranks, 4.0, include_lm_head=True)
        missing, unexpected = single.load_state_dict(model.state_dict(), strict=False)
        assert not missing and unexpected
        only[mode] = single(ids).logits
    for mode in ("retain_only", "forget_only"):
        with scales(model, *ABLATION_SCALES[mode]):
            assert torch.equal(model(ids).logits, only[mode])
    assert not torch.equal(only["retain_only"], base(ids).logits)


def test_scales_context_restores_on_exception():
    model = tiny_llama()
    apply_dual_lora(model, 1, 1, 1.0)
    set_scales(model, 0.5, 2.0)
    with pytest.raises(KeyError):
        with scales(model, 1, 0):
            assert {(m.retain_scale, m.forget_scale) for m in dual_lora_modules(model)} == {(1.0, 0.0)}
            raise KeyError("eval failed")
    assert {(m.retain_scale, m.forget_scale) for m in dual_lora_modules(model)} == {(0.5, 2.0)}
    with pytest.raises(ValueError, match="finite"):
        set_scales(model, math.nan, 1.0)
    with pytest.raises(ValueError, match="no DualLoRALinear or DualMLPAdapter"):
        set_scales(nn.Linear(2, 2), 1, 1)


def test_lm_head_adapter_trains_through_trl_fused_head():
    """TRL's fused LM head reads lm_head.weight directly: it must see (and train) the adapters."""
    from trl.trainer.utils import add_fused_lm_head

    model = tiny_llama()
    apply_dual_lora(model, 2, 3, 4.0, include_lm_head=True)
    randomize_adapters(model)
    add_fused_lm_head(model)
    ids = torch.randint(0, 32, (3, 6))
    head = [model.lm_head.retain_A, model.lm_head.retain_B, model.lm_head.forget_A, model.lm_head.forget_B]
    fused = model(input_ids=ids, labels=ids, fused_lm_head=True).log_probs
    plain = model(input_ids=ids).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    # The fused kernel computes in float32, hence the tolerance; without the adapters the gap would be O(1).
    assert fused.dtype == torch.float32 and (fused - plain).abs().max() <= 1e-5
    g_fused, g_plain = torch.autograd.grad(fused.sum(), head), torch.autograd.grad(plain.sum(), head)
    assert max((a - b).abs().max().item() for a, b in zip(g_fused, g_plain)) <= 1e-5
    assert all(g.abs().max() > 0 for g in g_fused)
    with routing_mask(model, torch.tensor([True, False, True]), "shared"):
        with pytest.raises(RuntimeError, match="merged weight cannot route"):
            model(input_ids=ids, labels=ids, fused_lm_head=True)


def test_dual_mlp_adapter_forward_by_hand():
    """y = mlp(x) + s_r down_r(silu(gate_r x) * up_r x) + s_f down_f(...), with hand-set weights."""
    from trl_ext.routing.mlp import DualMLPAdapter

    base = nn.Linear(2, 2, bias=False).to(D)
    with torch.no_grad():
        base.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 2.0]]))
    ad = DualMLPAdapter(base, 2, 1, 1)
    assert torch.equal(ad.retain_down, torch.zeros(2, 1, dtype=D)) and not base.weight.requires_grad
    with torch.no_grad():
        ad.retain_gate.copy_(torch.tensor([[1.0, 1.0]])); ad.retain_up.copy_(torch.tensor([[2.0, 0.0]]))
        ad.retain_down.copy_(torch.tensor([[1.0], [0.0]]))
        ad.forget_gate.copy_(torch.tensor([[0.0, 1.0]])); ad.forget_up.copy_(torch.tensor([[0.0, 1.0]]))
        ad.forget_down.copy_(torch.tensor([[0.0], [3.0]]))
    x = torch.tensor([[1.0, 2.0]], dtype=D)
    silu = lambda v: v / (1 + math.exp(-v))  # noqa: E731
    r = silu(3.0) * 2.0  # gate_r x = 3, up_r x = 2
    f = silu(2.0) * 2.0  # gate_f x = 2, up_f x = 2
    expect = torch.tensor([[1.0 + r, 4.0 + 3 * f]], dtype=D)
    torch.testing.assert_close(ad(x), expect, rtol=0, atol=1e-12)
    ad.retain_scale, ad.forget_scale = 1.0, 0.0
    torch.testing.assert_close(ad(x), torch.tensor([[1.0 + r, 4.0]], dtype=D), rtol=0, atol=1e-12)
    assert [n for n, _ in ad.adapter_named_parameters()] == [
        "retain_gate", "retain_up", "retain_down", "forget_gate", "forget_up", "forget_down"]


def test_layouts_written_before_mlp_adapters_read_as_lora():
    old = {"retain_rank": 2, "forget_rank": 2, "alpha": 16.0, "targets": ["q_proj"], "layer_start": 0,
           "layer_end": 4, "layer_stride": 1, "include_lm_head": False}
    assert DualLoRALayout.from_dict(old).adapter_type == "lora"
    with pytest.raises(ValueError, match="unknown"):
        DualLoRALayout.from_dict({**old, "nope": 1})
