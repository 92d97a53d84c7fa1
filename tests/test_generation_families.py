"""The fast generation backend on every architecture it runs (``trl_ext.generation.families``): on a tiny random model
of each family (random norms and biases, so that every weight matters) the behaviour log-probs it records equal one
full transformers forward's ``log_softmax(logits / T)`` of the sampled tokens within float32 rounding (1e-5); the
sliding-window cases sample sequences longer than the window (4), and sampling with the window switched off in the
fast path misses the reference (the window really is exercised). Every other architecture, and every config the fast
path would compute differently, is refused with a reason that names the model_type and the way on."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from trl_ext.generation.fast import FastSampler, decoder_of, fast_backend_refusal
from trl_ext.interfaces import SamplingParams
from trl_ext.models.tiny import tiny_config
from reference import trainer_logprobs

VOCAB, EOS = 64, 1
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22], [40, 41, 42, 43, 44], [60]] * 2  # unequal: left padding
PARAMS = SamplingParams(20, 1.0, 0, 1.0, (EOS,), EOS)
WINDOW = 4
INIT_SCALE = 0.1
BOTH = ["full_attention", "sliding_attention"]

# (family, sliding_window, config overrides): each a transformers feature the fast path must reproduce
CASES = {
    "llama": ("llama", None, {"attention_bias": True, "mlp_bias": True}),
    "llama-yarn": ("llama", None, {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                       "original_max_position_embeddings": 16}}),  # cos, sin scaled
    "qwen2": ("qwen2", None, {}),
    "qwen2-window": ("qwen2", WINDOW, {"layer_types": BOTH}),
    "qwen3": ("qwen3", None, {}),
    "qwen3-window": ("qwen3", WINDOW, {"layer_types": BOTH[::-1]}),
    "mistral": ("mistral", None, {}),
    "mistral-window": ("mistral", WINDOW, {}),
    "phi3-partial-rope": ("phi3", None, {"partial_rotary_factor": 0.5}),
    "phi3-window": ("phi3", WINDOW, {}),
    "olmo2": ("olmo2", None, {}),
    "gemma2": ("gemma2", None, {"attn_logit_softcapping": 1.0, "final_logit_softcapping": 2.0}),
    "gemma2-window": ("gemma2", WINDOW, {}),
    "gemma3_text": ("gemma3_text", None, {"final_logit_softcapping": 2.0, "attn_logit_softcapping": 1.0}),
    "gemma3_text-window": ("gemma3_text", WINDOW, {"layer_types": BOTH[::-1]}),
}  # fmt: skip


def tiny_model(family: str, window: int | None, overrides: dict, seed: int = 0):
    """A seeded tiny ``family`` model in float32, eval mode, with random norm weights and biases (Gemma norms act as
    1 + w, Llama's as w: both moved off their initial value) and weights 5x transformers' init scale (log-probs
    spread over ~1 nat instead of ~0.2 around log 1/64)."""
    cfg = tiny_config(family, VOCAB, EOS, sliding_window=window)
    cfg.initializer_range = INIT_SCALE
    if family == "phi3" and window is not None:
        cfg.sliding_window = window  # Phi-3 takes the window as given (tiny_config sets it for the others)
    for key, value in overrides.items():
        if key == "partial_rotary_factor":
            cfg.rope_parameters["partial_rotary_factor"] = value
        else:
            setattr(cfg, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # RMSNorm weights and biases
                p.add_(0.3 * torch.randn_like(p))
    return model


def max_error(sampler, model, seed=0):
    """(largest |fast - full forward| log-prob gap, tokens compared, longest prompt + completion)."""
    out = sampler.sample(PROMPTS, PARAMS, torch.Generator().manual_seed(seed))
    ref = trainer_logprobs(model, PROMPTS, out.completion_ids, PARAMS.temperature)
    gaps = [abs(a - b) for lp, r in zip(out.logprobs, ref, strict=True) for a, b in zip(lp, r, strict=True)]
    longest = max(len(p) + len(c) for p, c in zip(PROMPTS, out.completion_ids, strict=True))
    return max(gaps), len(gaps), longest


@pytest.mark.parametrize("case", list(CASES))
def test_logprobs_equal_full_forward(case):
    family, window, overrides = CASES[case]
    model = tiny_model(family, window, overrides)
    assert fast_backend_refusal(model.config) is None
    sampler = FastSampler(model)
    gap, n, longest = max_error(sampler, model)
    assert n > 60 and gap < 1e-5, (case, gap)
    if window is not None:
        assert window in sampler.plan.windows and longest > 2 * window
        # negative control: the same sampler with its windows switched off samples another policy
        sampler.plan = dataclasses.replace(sampler.plan, windows=[None] * len(sampler.plan.windows))
        sampler._state = None
        assert max_error(sampler, model)[0] > 1e-3, case


def test_softcaps_matter():
    """Gemma 2's attention and final soft-caps (set small so that tanh bends): the fast path without them misses."""
    family, window, overrides = CASES["gemma2"]
    model = tiny_model(family, window, overrides)
    for field in ("attn_softcap", "final_softcap"):
        sampler = FastSampler(model)
        sampler.plan = dataclasses.replace(sampler.plan, **{field: None})
        assert max_error(sampler, model)[0] > 1e-3, field


def _refused(model_type: str, **fields):
    cfg = tiny_config(model_type, VOCAB, EOS)
    for key, value in fields.items():
        setattr(cfg, key, value)
    return cfg


@pytest.mark.parametrize(
    "cfg, needle",
    [
        (_refused("gpt2"), "does not implement model_type 'gpt2'"),
        (_refused("gpt_neox"), "does not implement model_type 'gpt_neox'"),
        (_refused("llama", hidden_act="relu"), "'llama' model: hidden_act 'relu'"),
        (_refused("gemma2", hidden_activation="gelu_new"), "'gemma2' model: hidden_activation 'gelu_new'"),
        (_refused("llama", attention_dropout=0.1), "'llama' model: dropout is configured (attention_dropout=0.1)"),
        (_refused("phi3", resid_pdrop=0.1), "'phi3' model: dropout is configured (resid_pdrop=0.1)"),
        (_refused("gemma3_text", use_bidirectional_attention=True), "'gemma3_text' model: use_bidirectional"),
        (_refused("qwen3", layer_types=["full_attention", "chunked_attention"]), "'qwen3' model: layer types chunked"),
        (_refused("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
         "'llama' model: rope_type dynamic"),
        (_refused("phi3", rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
         "'phi3' model: rope_type longrope"),
    ],
    ids=["gpt2", "gpt_neox", "act", "gemma-act", "dropout", "phi3-dropout", "bidirectional", "chunked", "dynamic-rope",
         "longrope"],
)  # fmt: skip
def test_refusals_name_the_model_type_and_the_way_on(cfg, needle):
    reason = fast_backend_refusal(cfg)
    assert reason is not None and needle in reason and reason.endswith("use --generation_backend trl"), reason
    assert "\n" not in reason


def test_module_dropouts_pass_with_disable_dropout():
    """Phi-3's resid_pdrop is an nn.Dropout (TRL's --disable_dropout zeroes it); attention_dropout is functional (it
    does not)."""
    phi3 = _refused("phi3", resid_pdrop=0.1)
    assert fast_backend_refusal(phi3, disable_dropout=True) is None
    attn = _refused("phi3", attention_dropout=0.1)
    assert "attention_dropout=0.1" in fast_backend_refusal(attn, disable_dropout=True)
    model = AutoModelForCausalLM.from_config(phi3)  # the modules decide when sampling: refused in training mode
    with pytest.raises(ValueError, match="dropout active"):
        FastSampler(model.train()).sample(PROMPTS, PARAMS)
    FastSampler(model.eval()).sample(PROMPTS, PARAMS)


@pytest.mark.parametrize("model_type", ["gpt2", "gpt_neox"])
def test_decoder_of_raises_the_same_reason(model_type):
    cfg = tiny_config(model_type, VOCAB, EOS)
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError) as err:
        decoder_of(model)
    assert str(err.value) == fast_backend_refusal(cfg)
    with pytest.raises(ValueError, match=f"model_type '{model_type}'"):
        FastSampler(model)
