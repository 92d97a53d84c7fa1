"""The transformers sampler (``trl_ext.generation.hf_sampler``, the off-policy generator's ``--generation_backend
trl``) on tiny random models of every family ``trl_ext.models.tiny`` builds: behaviour log-probs against the trainer's
forward over the same left-padded rows (unequal prompt lengths, absolute positions), in-flight weight changes, EOS,
stop sequences, max_new_tokens, seeding, adapters, and the backend choice."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, BertConfig, BertLMHeadModel, LlamaConfig, LlamaForCausalLM

from trl_ext.generation.backends import SAMPLERS, make_sampler
from trl_ext.generation.fast import FastSampler
from trl_ext.generation.hf_sampler import HFSampler
from trl_ext.interfaces import SamplingParams
from trl_ext.models.tiny import FAMILIES, tiny_config
from trl_ext.routing.adapters import apply_dual_lora
from reference import trainer_logprobs

VOCAB, EOS = 64, 1
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22], [40, 41, 42, 43, 44], [60]]  # unequal: left padding


def tiny(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(family, VOCAB, EOS), dtype=torch.float32).eval()


def params(**over) -> SamplingParams:
    base = dict(max_new_tokens=16, temperature=1.0, top_k=0, top_p=1.0, eos_token_ids=(EOS,), pad_token_id=EOS)
    return SamplingParams(**{**base, **over})


def max_diff(a, b) -> float:
    return max(abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))


@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_equal_the_trainers_forward_on_every_family(family):
    """float32, unequal prompt lengths: within 1e-5 of the trainer's forward over the same left-padded rows."""
    model = tiny(family)
    out = HFSampler(model).sample(PROMPTS * 2, params(), torch.Generator().manual_seed(0))
    assert sum(map(len, out.completion_ids)) > 40
    assert max_diff(out.logprobs, trainer_logprobs(model, PROMPTS * 2, out.completion_ids, 1.0)) < 1e-5


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8)])
def test_gpt2_absolute_positions_are_the_trainers(temperature, top_k, top_p):
    """GPT-2 adds a learned embedding of the absolute position: the sampler scores positions 0..len-1 of the padded
    row (the trainer's), which generate's numbering (from each row's first real token) does not match."""
    model = tiny("gpt2")
    p = params(temperature=temperature, top_k=top_k, top_p=top_p)
    out = HFSampler(model).sample(PROMPTS * 2, p, torch.Generator().manual_seed(1))
    ref = trainer_logprobs(model, PROMPTS * 2, out.completion_ids, temperature)
    assert max_diff(out.logprobs, ref) < 1e-5
    shifted = trainer_logprobs(model, PROMPTS * 2, out.completion_ids, temperature, generate_positions=True)
    assert max_diff(out.logprobs, shifted) > 1e-2  # the numbering matters: this test can tell them apart
    if top_k:  # sampled among the top k only, scored by the full tempered softmax
        assert all(x < 0 for lp in out.logprobs for x in lp)


def test_adapters_peft_lora_and_dual_lora():
    """PEFT LoRA and the project's dual LoRA (B made non-zero): the sampler runs their own forward, as the trainer."""
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    peft = get_peft_model(tiny("llama"), lora)
    dual = tiny("llama")
    apply_dual_lora(dual, 4, 2, 8.0, include_lm_head=True)
    for model in (peft, dual):
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(0.05 * torch.randn_like(p))
        model.eval()
        out = HFSampler(model).sample(PROMPTS * 2, params(), torch.Generator().manual_seed(0))
        assert max_diff(out.logprobs, trainer_logprobs(model, PROMPTS * 2, out.completion_ids, 1.0)) < 1e-5


def test_same_samples_as_the_fast_sampler_on_llama():
    """Same sampling step and the same draws from the same seed: on a Llama both backends sample the same tokens with
    the same log-probs (to float error), so they sample one distribution."""
    model = tiny("llama")
    p = params(max_new_tokens=24, temperature=0.9, top_k=20)
    hf = HFSampler(model).sample(PROMPTS * 4, p, torch.Generator().manual_seed(5))
    fast = FastSampler(model, cuda_graphs=False).sample(PROMPTS * 4, p, torch.Generator().manual_seed(5))
    assert hf.completion_ids == fast.completion_ids
    assert max_diff(hf.logprobs, fast.logprobs) < 1e-5


def test_before_step_versions_and_in_flight_weights():
    """The hook runs before every forward (t = 0 the prefill) and may swap the weights: token t gets the version the
    hook returned, tokens before the swap are unchanged, tokens after it come from the new weights."""
    model, other = tiny("gpt2"), tiny("gpt2", seed=1)
    p = params(max_new_tokens=12, eos_token_ids=(VOCAB - 1,))  # rarely hit: long rows
    plain = HFSampler(model).sample(PROMPTS * 4, p, torch.Generator().manual_seed(2))
    swapped = copy.deepcopy(model)
    calls = []

    def hook(t):
        calls.append(t)
        if t == 4:
            swapped.load_state_dict(other.state_dict())
        return 3 + (t >= 4)

    out = HFSampler(swapped).sample(PROMPTS * 4, p, torch.Generator().manual_seed(2), hook)
    assert calls == list(range(max(map(len, out.completion_ids))))
    for v, c in zip(out.versions, out.completion_ids, strict=True):
        assert v == [3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 4][: len(c)]
    assert [c[:4] for c in out.completion_ids] == [c[:4] for c in plain.completion_ids]
    assert [lp[:4] for lp in out.logprobs] == [lp[:4] for lp in plain.logprobs]
    assert sum(c[4:] != d[4:] for c, d in zip(out.completion_ids, plain.completion_ids, strict=True)) >= 8


def test_eos_ends_a_row_and_max_new_tokens_caps():
    eos = tuple(range(0, 16))  # a quarter of the vocabulary ends a row
    out = HFSampler(tiny("phi3")).sample(PROMPTS * 8, params(eos_token_ids=eos, max_new_tokens=6),
                                         torch.Generator().manual_seed(0))  # fmt: skip
    for ids in out.completion_ids:
        assert 1 <= len(ids) <= 6 and all(t not in eos for t in ids[:-1])
        assert ids[-1] in eos or len(ids) == 6
    assert any(len(ids) < 6 for ids in out.completion_ids) and any(len(ids) == 6 for ids in out.completion_ids)


def _first_stop(ids, stops):
    for end in range(1, len(ids) + 1):
        if any(tuple(ids[max(0, end - len(s)) : end]) == s for s in stops):
            return end
    return None


def test_stop_sequences_end_a_row_like_eos():
    """A stopped row is the unstopped row's sample cut right after the first stop sequence, with the same log-probs."""
    sampler, stops = HFSampler(tiny("gpt_neox")), ((7, 8), (9,), (30, 31, 32))
    free = sampler.sample(PROMPTS * 8, params(max_new_tokens=30), torch.Generator().manual_seed(3))
    free_ids = [c for c in free.completion_ids]
    stops = stops + tuple({(c[4], c[5]) for c in free_ids if len(c) > 6 and EOS not in c[:6]})  # some certain hits
    cut = sampler.sample(PROMPTS * 8, params(max_new_tokens=30, stop_sequences=stops), torch.Generator().manual_seed(3))
    stopped = 0
    for ids, lps, ids_cut, lps_cut in zip(free.completion_ids, free.logprobs, cut.completion_ids, cut.logprobs):
        end = _first_stop(ids, stops)
        stopped += end is not None and end < len(ids)
        assert ids_cut == ids[: end or len(ids)] and lps_cut == lps[: len(ids_cut)]
    assert stopped >= 5


def test_seeded():
    sampler = HFSampler(tiny("olmo2"))
    a, b, c = (sampler.sample(PROMPTS * 4, params(), torch.Generator().manual_seed(s)) for s in (7, 7, 8))
    assert a.completion_ids == b.completion_ids and a.logprobs == b.logprobs
    assert a.completion_ids != c.completion_ids


def test_refuses_active_dropout_and_empty_prompts():
    model = tiny("gpt2").train()  # GPT-2's default dropouts are 0.1
    with pytest.raises(ValueError, match="dropout"):
        HFSampler(model).sample(PROMPTS, params())
    with pytest.raises(ValueError, match="at least one token"):
        HFSampler(model.eval()).sample([[5], []], params())


def test_backends_are_chosen_explicitly():
    """``trl`` -> HFSampler, ``fast`` -> FastSampler; the fast sampler refuses a model it does not implement (here a
    BERT decoder) rather than falling back."""
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))  # fmt: skip
    assert set(SAMPLERS) == {"trl", "fast"}
    assert type(make_sampler("trl", llama)) is HFSampler and type(make_sampler("fast", llama)) is FastSampler
    assert type(make_sampler("trl", tiny("gpt2"))) is HFSampler
    bert = BertLMHeadModel(BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=32, is_decoder=True))  # fmt: skip
    with pytest.raises(ValueError, match="fast generation backend"):
        make_sampler("fast", bert)
    with pytest.raises(ValueError, match="unknown generation backend"):
        make_sampler("vllm", llama)


def test_generator_cache_flag_is_refused_at_parse_time(train_cli_error):
    """``--cache_implementation`` configures transformers.generate; the generator's sampler would ignore it."""
    err = train_cli_error("--reward", "happy_binary", "--max_async_level", "1", "--cache_implementation", "static")
    assert "--cache_implementation 'static' is not used by the off-policy generator" in err
