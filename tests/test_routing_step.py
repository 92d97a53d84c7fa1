"""Routed gradient steps and routing labels (trl_ext/routing/step.py), float64 on a tiny Llama and a tiny GPT-2
(transformers' Conv1D layers, weight [in, out])."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.pytorch_utils import Conv1D

from trl_ext.registry import ConfigError
from trl_ext.routing.adapters import apply_dual_lora, forget_params, retain_params
from trl_ext.routing.step import (
    LORA_PRESETS, resolve_adapter_ranks, rh_eligible_mask, routing_labels, routing_mask, select_rows,
    single_pass_backward, two_pass_backward,
)

D = torch.float64
N = 6
PATTERNS = {  # is_bad per sample
    "mixed": [False, True, False, False, True, False],
    "all_good": [False] * N,
    "all_bad": [True] * N,
}


ADAPTERS = ["lora", "mlp", "gpt2_lora", "gpt2_mlp"]  # gpt2_*: the adapters of a GPT-2 (Conv1D) model


def make_model(adapter="lora", **ckpt) -> LlamaForCausalLM | GPT2LMHeadModel:
    torch.manual_seed(0)
    if adapter.startswith("gpt2_"):
        cfg = GPT2Config(n_embd=16, n_inner=32, n_layer=2, n_head=2, vocab_size=32, n_positions=32, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(cfg).to(D)
        adapter = adapter.removeprefix("gpt2_")
    else:
        cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, vocab_size=32, max_position_embeddings=32, tie_word_embeddings=True)
        model = LlamaForCausalLM(cfg).to(D)
    if adapter == "mlp":
        from trl_ext.routing.mlp import apply_dual_mlp

        apply_dual_mlp(model, 2, 3)
    else:
        apply_dual_lora(model, 2, 3, 4.0, include_lm_head=True)
    with torch.no_grad():  # nonzero B everywhere: gradients also flow through other layers' adapters
        for p in retain_params(model) + forget_params(model):
            p.normal_(0, 0.3)
    if ckpt:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=ckpt)
        model.enable_input_require_grads()
    return model.train()


def make_batch(seed: int = 2) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(N, 7, dtype=D)
    mask[1, 4:] = 0
    mask[4, 2:] = 0
    return {"input_ids": torch.randint(0, 32, (N, 8), generator=g), "advantages": torch.randn(N, generator=g, dtype=D),
            "completion_mask": mask, "num_items_in_batch": mask.sum(), "prompts": [f"p{i}" for i in range(N)]}


# TRL 1.16's loss types (GRPOConfig.loss_type's help lists them; test_every_trl_loss_type_is_covered) and each one's
# reduction of the masked per-token loss, written from GRPOTrainer._compute_loss (max_completion_length: MAX_LEN).
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "sapo", "cispo", "luspo", "vespo")
MAX_LEN = 7


def reduce_loss(loss_type: str, per_token: torch.Tensor, batch: dict) -> torch.Tensor:
    m = batch["completion_mask"]
    x = per_token * m
    if loss_type in ("grpo", "sapo"):
        return (x.sum(-1) / m.sum(-1).clamp(min=1)).mean()
    if loss_type == "luspo":
        return x.sum(-1).mean()
    if loss_type == "dr_grpo":
        return x.sum() / (x.size(0) * MAX_LEN)
    if loss_type == "bnpo":
        return x.sum() / m.sum().clamp(min=1)
    assert loss_type in ("dapo", "cispo", "vespo")
    return x.sum() / batch["num_items_in_batch"].clamp(min=1)


def make_loss_fn(model, fused_head=False, loss_type="grpo", weights=None):
    """A TRL-shaped loss: per-token loss, reduced as ``loss_type`` reduces it; ``weights`` (one per sample) scale the
    per-token loss before the reduction, the batch's normalising constants unchanged (the routed gradients'
    definition)."""

    def loss_fn(batch):
        ids = batch["input_ids"]
        if fused_head:  # TRL 1.16's path: lm_head.weight read directly, log-probs in float32
            logp = model(input_ids=ids, labels=ids, fused_lm_head=True).log_probs.to(D)
        else:
            logp = model(ids).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())
        per_token = -ratio * batch["advantages"][:, None] + 0.1 * logp**2
        if weights is not None:
            per_token = per_token * weights[:, None]
        return reduce_loss(loss_type, per_token, batch)

    return loss_fn


def grads(params):
    assert all(p.grad is not None for p in params)
    return [p.grad.clone() for p in params]


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def routed(step, loss_fn, batch, is_bad, model, mode, loss_type="grpo", **kwargs):
    """``step`` called as the trainer calls it (the two-pass step takes the loss type)."""
    if step is two_pass_backward:
        kwargs["loss_type"] = loss_type
    return step(loss_fn, batch, is_bad, model, mode, **kwargs)


def run(step, pattern, mode, model=None, adapter="lora", loss_type="grpo"):
    model = make_model(adapter) if model is None else model
    loss = routed(step, make_loss_fn(model, loss_type=loss_type), make_batch(), torch.tensor(PATTERNS[pattern]), model,
                  mode, loss_type)  # fmt: skip
    return loss, grads(retain_params(model)), grads(forget_params(model))


def definition_grads(mode, pattern, adapter="lora", loss_type="grpo"):
    """Routed gradients from their definition: one pass of the loss over the whole batch, each adapter's gradient
    taken from its samples' terms alone (the others' per-token loss weighted 0, the normalisers the whole batch's)."""
    model, is_bad = make_model(adapter), torch.tensor(PATTERNS[pattern])
    batch, params = make_batch(), retain_params(model) + forget_params(model)
    k = len(retain_params(model))

    def grad(weights):
        return torch.autograd.grad(make_loss_fn(model, loss_type=loss_type, weights=weights)(batch), params)

    full, good, bad = grad(None), grad((~is_bad).to(D)), grad(is_bad.to(D))
    return full, good[:k], full[k:] if mode == "shared" else bad[k:]


@pytest.mark.parametrize("keep_rows", [False, True])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_pass_losses_are_their_share_of_the_full_batch_loss(loss_type, keep_rows):
    """Each pass's loss times its share (`routing.loss_share`) equals the full-batch loss with the other samples'
    terms weighted 0, for every loss type, over a subset of rows and over all rows with the others' mask zeroed."""
    from trl_ext.routing.loss_share import pass_share

    model, batch = make_model(), make_batch()
    rows = torch.tensor(PATTERNS["mixed"])
    for side in (rows, ~rows):
        want = make_loss_fn(model, loss_type=loss_type, weights=side.to(D))(batch)
        if keep_rows:
            sub = {**batch, "completion_mask": batch["completion_mask"] * side.to(D)[:, None]}
        else:
            sub = select_rows(batch, side.nonzero().flatten(), N)
        got = make_loss_fn(model, loss_type=loss_type)(sub) * pass_share(loss_type, side, batch["completion_mask"],
                                                                           keep_rows)  # fmt: skip
        assert abs(got.item() - want.item()) <= 1e-12, (got.item(), want.item())


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_two_pass_shared_equals_full_batch_gradient(pattern):
    full, retain_def, _ = definition_grads("shared", pattern)
    loss, r, f = run(two_pass_backward, pattern, "shared")
    k = len(r)
    assert max_diff(f, full[k:]) <= 1e-10  # the forget adapter learns from the full batch
    assert max_diff(r, retain_def) <= 1e-10  # the retain adapter from the good samples' share only
    model = make_model()
    assert abs(loss.item() - make_loss_fn(model)(make_batch()).item()) <= 1e-12


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("mode", ["shared", "exclusive"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_single_pass_equals_two_pass(mode, pattern, adapter):
    _, retain_def, forget_def = definition_grads(mode, pattern, adapter)
    loss2, r2, f2 = run(two_pass_backward, pattern, mode, adapter=adapter)
    loss1, r1, f1 = run(single_pass_backward, pattern, mode, adapter=adapter)
    assert max_diff(r1, r2) <= 1e-10 and max_diff(f1, f2) <= 1e-10
    assert max_diff(r1, retain_def) <= 1e-10 and max_diff(f1, forget_def) <= 1e-10
    assert abs(loss1.item() - loss2.item()) <= 1e-12


@pytest.mark.parametrize("mode", ["shared", "exclusive"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_routes_as_its_definition(loss_type, mode):
    """Both routed steps, every TRL loss type: the gradients of one pass over the whole batch with each adapter's
    gradient taken from its samples alone (float64), and the full-batch loss."""
    _, retain_def, forget_def = definition_grads(mode, "mixed", loss_type=loss_type)
    for step in (two_pass_backward, single_pass_backward):
        loss, r, f = run(step, "mixed", mode, loss_type=loss_type)
        assert max_diff(r, retain_def) <= 1e-10 and max_diff(f, forget_def) <= 1e-10, step.__name__
        assert abs(loss.item() - make_loss_fn(make_model(), loss_type=loss_type)(make_batch()).item()) <= 1e-12


def test_every_trl_loss_type_is_covered():
    """The loss types TRL's GRPOConfig lists are the ones tested here and the ones `routing.loss_share` splits."""
    import dataclasses
    import re

    from trl import GRPOConfig

    from trl_ext.routing.loss_share import LOSS_TYPES as SPLIT

    (field,) = (f for f in dataclasses.fields(GRPOConfig) if f.name == "loss_type")
    listed = set(re.findall(r"'(\w+)'", re.search(r"Supported values are (.*?)\.", field.metadata["help"])[1]))
    assert listed == set(LOSS_TYPES) and listed <= set(SPLIT)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo"])  # one of each kind of share
@pytest.mark.parametrize("mode", ["shared", "exclusive"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_two_pass_keep_rows_equals_subsets(mode, pattern, loss_type):
    """Several processes' two-pass step (``keep_rows``: every pass on all rows, the other side's completion mask
    zeroed) gives the subset passes' gradients; with both sides forced (another process has the side this one lacks)
    the empty side's pass adds exactly 0 and the loss is called twice on full-size batches."""
    _, r_ref, f_ref = run(two_pass_backward, pattern, mode, loss_type=loss_type)
    model = make_model()
    loss_fn, sizes = make_loss_fn(model, loss_type=loss_type), []

    def counted(batch):
        sizes.append(int(batch["input_ids"].shape[0]))
        return loss_fn(batch)

    two_pass_backward(counted, make_batch(), torch.tensor(PATTERNS[pattern]), model, mode, sides=(True, True),
                      keep_rows=True, loss_type=loss_type)  # fmt: skip
    assert sizes == [N, N]
    r, f = grads(retain_params(model)), grads(forget_params(model))
    assert max_diff(r, r_ref) <= 1e-12 and max_diff(f, f_ref) <= 1e-12
    with pytest.raises(ValueError, match="sides needs keep_rows"):
        two_pass_backward(counted, make_batch(), torch.tensor(PATTERNS[pattern]), model, mode, sides=(True, True),
                          loss_type=loss_type)


def test_gpt2_adapters_wrap_its_conv1d_layers():
    from trl_ext.routing.adapters import DualLoRALinear

    model = make_model("gpt2_lora")
    wrapped = {n for n, m in model.named_modules() if isinstance(m, DualLoRALinear)}
    blocks = {f"transformer.h.{i}.{p}" for i in range(2) for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                    "mlp.c_proj")}
    assert wrapped == blocks | {"lm_head"}
    assert all(isinstance(model.get_submodule(n).base_layer, Conv1D) for n in blocks)
    assert model.transformer.h[0].attn.c_attn.retain_A.shape == (2, 16)  # A: (r, in); c_attn is 16 -> 48
    assert model.transformer.h[0].attn.c_attn.retain_B.shape == (48, 2)


@pytest.mark.parametrize("step", [two_pass_backward, single_pass_backward])
def test_routed_away_side_gets_exactly_zero(step):
    _, r, _ = run(step, "all_bad", "shared")
    assert all(torch.equal(g, torch.zeros_like(g)) for g in r)
    _, r, f = run(step, "all_good", "exclusive")
    assert all(torch.equal(g, torch.zeros_like(g)) for g in f)
    assert all(g.abs().max() > 0 for g in r)


@pytest.mark.parametrize("step", [two_pass_backward, single_pass_backward])
def test_accumulates_onto_existing_gradients(step):
    once = run(step, "mixed", "exclusive")
    model = make_model()
    for p in retain_params(model) + forget_params(model):
        p.grad = torch.ones_like(p)
    _, r, f = run(step, "mixed", "exclusive", model=model)
    assert max_diff(r, [g + 1 for g in once[1]]) <= 1e-12 and max_diff(f, [g + 1 for g in once[2]]) <= 1e-12


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_single_pass_under_gradient_checkpointing(use_reentrant):
    _, r2, f2 = run(two_pass_backward, "mixed", "exclusive")
    _, r1, f1 = run(single_pass_backward, "mixed", "exclusive", model=make_model(use_reentrant=use_reentrant))
    assert max_diff(r1, r2) <= 1e-10 and max_diff(f1, f2) <= 1e-10


def test_two_pass_through_trl_fused_head_routes_the_lm_head_adapter():
    """The lm_head adapter under TRL's fused head (merged weight): two passes route it like one pass."""
    from trl.trainer.utils import add_fused_lm_head

    _, r1, f1 = run(single_pass_backward, "mixed", "exclusive")
    model = make_model()
    add_fused_lm_head(model)
    two_pass_backward(make_loss_fn(model, fused_head=True), make_batch(), torch.tensor(PATTERNS["mixed"]), model,
                      "exclusive", loss_type="grpo")
    r2, f2 = grads(retain_params(model)), grads(forget_params(model))
    scale = max(g.abs().max().item() for g in r1 + f1)
    assert max(max_diff(r1, r2), max_diff(f1, f2)) <= 1e-5 * scale  # float32 kernel
    assert model.lm_head.retain_A.grad.abs().max() > 0


def test_routing_mask_guards():
    model = make_model()
    ids = make_batch()["input_ids"]
    with routing_mask(model, torch.ones(N, dtype=torch.bool), "shared"):
        with pytest.raises(RuntimeError, match="covers 6 samples"):
            model(ids[:4])
        with pytest.raises(RuntimeError, match="already active"):
            with routing_mask(model, torch.ones(N, dtype=torch.bool), "shared"):
                pass
    assert model.lm_head.retain_grad_mask is None  # cleared on exit
    with pytest.raises(ConfigError, match="unknown routing mode"):
        single_pass_backward(make_loss_fn(model), make_batch(), torch.zeros(N, dtype=torch.bool), model, "classic")
    with pytest.raises(ValueError, match="1-D bool"):
        two_pass_backward(make_loss_fn(model), make_batch(), torch.zeros(N), model, "shared", loss_type="grpo")


def test_select_rows():
    batch = make_batch()
    out = select_rows(batch, torch.tensor([4, 1]), N)
    assert torch.equal(out["input_ids"], batch["input_ids"][[4, 1]])
    assert out["prompts"] == ["p4", "p1"] and out["num_items_in_batch"] is batch["num_items_in_batch"]
    with pytest.raises(ValueError, match="first dim 6, expected 5"):
        select_rows(batch, torch.tensor([0]), 5)
    with pytest.raises(ValueError, match="cannot be split"):
        select_rows({"x": {1, 2}}, torch.tensor([0]), 2)


IS_RH = [True] * 10 + [False] * 10  # 20 samples, the first 10 detected
ALL = torch.ones(20, dtype=torch.bool)


def labels(eligible=ALL, recall=1.0, fpr=0.0, is_rh=IS_RH, seed=3, step=7, process=0):
    return routing_labels(is_rh, eligible, recall, fpr, seed=seed, step=step, process=process)


def test_routing_labels_exact_counts():
    is_bad, stats = labels()
    assert is_bad.tolist() == IS_RH
    assert stats == {"n_samples": 20, "n_eligible": 20, "n_detected": 10, "n_detected_eligible": 10,
                     "n_false_positive": 0, "n_flagged": 10, "n_bad": 10}
    assert not labels(recall=0.0)[0].any()
    for frac, k in ((0.3, 3), (0.25, 3), (0.24, 2)):  # k = floor(frac * 10 + 1/2), only detected samples
        is_bad, stats = labels(recall=frac)
        assert stats["n_bad"] == k and not is_bad[10:].any()


def test_ineligible_samples_are_never_flagged():
    eligible = rh_eligible_mask(20, 0.5, seed=3, step=7)
    assert int(eligible.sum()) == 10 and int(rh_eligible_mask(100, 0.29, seed=0, step=0).sum()) == 29
    is_bad, stats = labels(eligible=eligible, is_rh=[True] * 20)  # all detected: exactly the eligible are bad
    assert torch.equal(is_bad, eligible) and stats["n_detected_eligible"] == stats["n_bad"] == 10
    # false positives come from eligible unflagged samples only: with all 10 eligible ones detected, none
    is_bad, stats = labels(eligible=torch.tensor([True] * 10 + [False] * 10), fpr=1.0)
    assert is_bad.tolist() == IS_RH and stats["n_false_positive"] == 0
    assert not labels(eligible=torch.zeros(20, dtype=torch.bool), fpr=1.0)[0].any()


def test_false_positives_flip_good_to_flagged_only():
    is_bad, stats = labels(fpr=0.25)  # 10 negatives -> floor(2.5 + 0.5) = 3 flagged, all 10 detections kept
    assert stats["n_false_positive"] == 3 and stats["n_flagged"] == stats["n_bad"] == 13
    assert is_bad[:10].all() and int(is_bad[10:].sum()) == 3
    assert torch.equal(labels(fpr=1.0)[0], ALL)
    # recall applies after the false positives (small-rl HEAD: recall wrapper on the false-positive one)
    is_bad, stats = labels(fpr=0.2, recall=0.5)  # 10 + 2 flagged -> 6 kept
    assert stats["n_flagged"] == 12 and stats["n_bad"] == 6
    # good -> flagged only: a flagged set never loses a detected sample to the false-positive draw
    for seed in range(20):
        assert labels(fpr=0.5, seed=seed)[0][:10].all()


def test_routing_labels_seeded_by_seed_step_and_process():
    a, b = labels(recall=0.5, fpr=0.3), labels(recall=0.5, fpr=0.3)
    assert torch.equal(a[0], b[0]) and a[1] == b[1]
    for other in ({"step": 8}, {"seed": 4}, {"process": 1}):
        assert not torch.equal(labels(recall=0.5, fpr=0.3, **other)[0], a[0])
    ranks = [rh_eligible_mask(40, 0.5, seed=3, step=7, process=p) for p in range(4)]
    assert all(int(m.sum()) == 20 for m in ranks) and len({tuple(m.tolist()) for m in ranks}) == 4


def test_routing_labels_reject_bad_inputs():
    for kwargs in ({"recall": 1.5}, {"fpr": -0.1}, {"fpr": float("nan")}, {"recall": True}):
        with pytest.raises(ConfigError, match=r"in \[0, 1\]"):
            labels(**kwargs)
    with pytest.raises(ConfigError, match=r"in \[0, 1\]"):
        rh_eligible_mask(4, 1.5, seed=0, step=0)
    with pytest.raises(ValueError, match="Python bools"):
        labels(is_rh=[1, 0])
    with pytest.raises(ValueError, match="2 entries for 20"):
        labels(eligible=torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="no samples"):
        labels(is_rh=[], eligible=torch.ones(0, dtype=torch.bool))


# small-rl's LORA_PRESETS (train.py, 63d8fc8 and HEAD 6f6e986): (retain, forget, alpha) -> per-side scaling.
SMALL_RL_SCALING = {**{f"r{n}": (1.0, 1.0) for n in (1, 2, 4, 8, 16, 32, 64)},
                    "r32f16": (1.0, 2.0), "r32f8": (1.0, 4.0), "r32f4": (1.0, 8.0), "r32f2": (1.0, 16.0),
                    "r32f1": (1.0, 32.0)}


@pytest.mark.parametrize("preset", sorted(LORA_PRESETS))
def test_every_preset_scaling(preset):
    from torch import nn

    from trl_ext.routing.adapters import DualLoRALinear
    from trl_ext.routing.step import resolve_dual_lora_alpha

    r, f = resolve_adapter_ranks(preset, None, None, routing=True)
    layer = DualLoRALinear(nn.Linear(4, 4), r, f, resolve_dual_lora_alpha(preset, 16.0, explicit=False))
    assert (layer.scaling["retain"], layer.scaling["forget"]) == SMALL_RL_SCALING[preset]
    # an explicit --lora_alpha overrides the preset's: alpha 16 -> 16/r, 16/f
    layer = DualLoRALinear(nn.Linear(4, 4), r, f, resolve_dual_lora_alpha(preset, 16.0, explicit=True))
    assert (layer.scaling["retain"], layer.scaling["forget"]) == (16 / r, 16 / f)


def test_preset_alpha_through_the_cli():
    import trl_ext.cli_train as cli

    base = ["--reward", "sentence_length_5_with_happy", "--gradient_routing", "--routing_mode", "shared"]
    for preset, (r, f, alpha) in LORA_PRESETS.items():
        plan = cli.build_plan([*base, "--lora_config", preset])
        assert plan.cfg.dual_lora_alpha == alpha and plan.cfg.adapter_ranks == (r, f)
        assert plan.run_dir.name.count(f"_dual_r{r}f{f}_st") == 1  # the preset's own alpha: no alpha tag
    explicit = cli.build_plan([*base, "--lora_config", "r8", "--lora_alpha", "16"])
    assert explicit.cfg.dual_lora_alpha == 16.0 and "_dual_r8f8_a16_" in explicit.run_dir.name
    ranks = cli.build_plan([*base, "--retain_rank", "8", "--forget_rank", "8"])  # explicit ranks: default alpha
    assert ranks.cfg.dual_lora_alpha == 16.0 and ranks.run.lora_alpha == 16.0 and not ranks.run.lora_alpha_explicit
    peft = cli.build_plan(["--reward", "happy_binary", "--lora_rank", "8"])
    assert peft.run.lora_alpha == 16.0 and "lora_alpha" not in peft.run_dir.name


def test_resolve_adapter_ranks():
    assert resolve_adapter_ranks("r8", None, None, routing=True) == (8, 8)
    assert resolve_adapter_ranks("r32f4", None, None, routing=True) == (32, 4)
    assert {LORA_PRESETS[f"r{n}"] for n in (1, 2, 4, 8, 16, 32)} == {(n, n, n) for n in (1, 2, 4, 8, 16, 32)}
    assert [LORA_PRESETS[f"r32f{n}"] for n in (16, 4, 1)] == [(32, 16, 32), (32, 4, 32), (32, 1, 32)]
    assert resolve_adapter_ranks(None, 16, 2, routing=True) == (16, 2)
    assert resolve_adapter_ranks(None, 8, 0, routing=False) == (8, 0)
    bad = [
        (("r7", None, None, True), "unknown --lora_config 'r7'; presets: r1, r2"),
        (("r8", 8, None, True), "not both"),
        ((None, 8, None, True), "both --retain_rank and --forget_rank"),
        ((None, -1, 4, True), "retain rank must be an integer >= 0"),
        ((None, 4, 2.0, True), "forget rank must be an integer"),
        ((None, 8, 0, True), "routing needs both adapters"),
        ((None, 0, 8, True), "routing needs both adapters"),
        ((None, 0, 0, False), "both 0"),
    ]
    for (preset, r, f, routing), match in bad:
        with pytest.raises(ConfigError, match=match):
            resolve_adapter_ranks(preset, r, f, routing=routing)
