"""Stop sequences of the fast sampler (environment turns end at the closing answer tag): a stopped row is the
unstopped row's sample cut right after the first occurrence of a stop sequence, with the same log-probs."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from trl_ext.env.episodes import answer_stop_sequences
from trl_ext.generation.fast import FastSampler
from trl_ext.interfaces import SamplingParams
from trl_ext.models import load_tokenizer, prepare_tokenizer


def _first_stop(ids: list[int], stops) -> int | None:
    for end in range(1, len(ids) + 1):
        if any(tuple(ids[max(0, end - len(s)) : end]) == s for s in stops):
            return end
    return None


def test_stop_sequences_cut_the_same_sample(builtin_path):
    tok = prepare_tokenizer(load_tokenizer(builtin_path))
    model = AutoModelForCausalLM.from_pretrained(builtin_path).eval()
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ["Ben was a quiet owl", "Lily felt", "The sun"]] * 8
    period, he = tok.convert_tokens_to_ids("."), tok.convert_tokens_to_ids("he")
    stops = ((period, he), (tok.convert_tokens_to_ids("sad"),))
    base = dict(max_new_tokens=48, temperature=1.0, top_k=0, top_p=1.0, eos_token_ids=(tok.eos_token_id,),
                pad_token_id=tok.pad_token_id)  # fmt: skip
    sampler = FastSampler(model)
    free = sampler.sample(prompts, SamplingParams(**base), torch.Generator().manual_seed(3))
    cut = sampler.sample(prompts, SamplingParams(**base, stop_sequences=stops), torch.Generator().manual_seed(3))
    stopped = 0
    for ids, lps, ids_cut, lps_cut in zip(free.completion_ids, free.logprobs, cut.completion_ids, cut.logprobs):
        end = _first_stop(ids, stops)
        stopped += end is not None and end < len(ids)
        assert ids_cut == ids[: end or len(ids)] and lps_cut == lps[: len(ids_cut)]
    assert stopped >= 3  # the stops really cut some rows short


def test_answer_stop_sequences_are_the_closing_tag(builtin_path):
    from trl_ext.models import model_source

    tok = prepare_tokenizer(load_tokenizer(model_source("builtin_env")))
    (seq,) = answer_stop_sequences(tok)  # WordPiece: the same tokens with or without the leading space
    assert tok.decode(list(seq)).replace(" ", "") == "</answer>"
