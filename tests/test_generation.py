"""The fast generation backend on real models: its log-probs against one full forward pass, its samples against
transformers' generate, the trainer plumbing, the flags, and a GRPO run that learns the quickstart."""

import copy
import json
import math
import os
import sys
from pathlib import Path

import pytest
import zygote
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from trl_ext.generation.fast import FastSampler
from trl_ext.interfaces import SamplingParams
from trl_ext.routing.adapters import apply_dual_lora
from reference import trainer_logprobs

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22], [40, 41, 42, 43, 44], [60]]  # unequal: left padding
EOS = 1


def assert_logprobs_match(model, prompts, params, seed=0, tol=1e-5):
    out = FastSampler(model).sample(prompts, params, torch.Generator().manual_seed(seed))
    ref = trainer_logprobs(model, prompts, out.completion_ids, params.temperature)
    n = 0
    for lp, r, c in zip(out.logprobs, ref, out.completion_ids, strict=True):
        assert len(lp) == len(c) >= 1 and (c[-1] in params.eos_token_ids or len(c) == params.max_new_tokens)
        assert all(t not in params.eos_token_ids for t in c[:-1])
        assert max(abs(a - b) for a, b in zip(lp, r, strict=True)) < tol
        n += len(lp)
    return n


@pytest.fixture(scope="module")
def builtin(builtin_path):
    return AutoModelForCausalLM.from_pretrained(builtin_path).eval()


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (1.0, 20, 1.0), (1.0, 0, 0.9)])
def test_logprobs_equal_full_forward_on_builtin(builtin, temperature, top_k, top_p):
    """float32, temperature 1: within 1e-5 of one full forward pass (itself ~7e-6 from the float64 values)."""
    params = SamplingParams(40, temperature, top_k, top_p, (EOS,), EOS)
    assert assert_logprobs_match(builtin, PROMPTS * 4, params) > 200


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 20, 1.0), (1.3, 0, 0.9)])
def test_logprobs_equal_full_forward_in_float64(builtin, temperature, top_k, top_p):
    """The same computation as the trainer's forward at any temperature: in float64 they agree to 1e-10. (In float32
    a temperature below 1 scales the rounding of the logits by 1/T: two float32 forwards then differ by ~1.5e-5.)"""
    model = copy.deepcopy(builtin).double()
    params = SamplingParams(40, temperature, top_k, top_p, (EOS,), EOS)
    assert assert_logprobs_match(model, PROMPTS * 4, params, tol=1e-10) > 200


def test_logprobs_equal_full_forward_through_adapters(builtin_path):
    """PEFT LoRA and the project's dual LoRA are read as their merged weights (B made non-zero so they matter). Checked
    in float64 (1e-10): in float32, W + s B A rounds differently from the trainer's unmerged x W + s (x A) B, at the
    1e-5 level of the float32 tests above."""
    params = SamplingParams(24, 1.0, 0, 1.0, (EOS,), EOS)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(builtin_path),
                          LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))  # fmt: skip
    dual = AutoModelForCausalLM.from_pretrained(builtin_path)
    apply_dual_lora(dual, 4, 2, 8.0, include_lm_head=True)
    for model in (peft, dual):
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:  # the adapters (base weights are frozen)
                    p.add_(0.05 * torch.randn_like(p))
        assert assert_logprobs_match(model.double().eval(), PROMPTS * 2, params, tol=1e-10) > 50


def test_logprobs_equal_full_forward_on_qwen2_with_biases():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, eos_token_id=EOS, pad_token_id=EOS, tie_word_embeddings=False)  # fmt: skip
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.bias.normal_()  # Qwen2 has q/k/v biases: make them matter
    assert model.model.layers[0].self_attn.k_proj.bias is not None
    assert assert_logprobs_match(model, PROMPTS * 2, SamplingParams(12, 1.0, 0, 1.0, (EOS,), EOS)) > 40


def test_unsupported_model_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(ValueError, match="does not implement model_type 'gpt2'.*use --generation_backend trl"):
        FastSampler(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32)))


# ---------------------------------------------------------------- distribution against transformers' generate

DIST_PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27], [40, 41, 42, 43, 44, 45, 46, 47],
                [60, 61, 62, 63, 64, 65, 66, 67]]  # fmt: skip
DIST_ROWS = [p for p in DIST_PROMPTS for _ in range(256)]
DIST_TOKENS = 24


def hf_samples(model, temperature, top_k, top_p, seed):
    torch.manual_seed(seed)
    config = GenerationConfig(max_new_tokens=DIST_TOKENS, do_sample=True, pad_token_id=EOS, eos_token_id=[EOS],
                              temperature=temperature, top_k=top_k, top_p=top_p, disable_compile=True)  # fmt: skip
    ids = torch.tensor(DIST_ROWS)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    rows = out[:, ids.size(1) :].tolist()
    return [row[: row.index(EOS) + 1] if EOS in row else row for row in rows]


def fast_samples(model, temperature, top_k, top_p, seed):
    params = SamplingParams(DIST_TOKENS, temperature, top_k, top_p, (EOS,), EOS)
    return FastSampler(model).sample(DIST_ROWS, params, torch.Generator().manual_seed(seed)).completion_ids


def sample_stats(model, completions):
    """(mean, standard error) over sequences of (a) the mean per-token log-prob under the model at temperature 1,
    (b) the completion length."""
    per_seq = trainer_logprobs(model, DIST_ROWS, completions, 1.0)
    lp = torch.tensor([sum(x) / len(x) for x in per_seq], dtype=torch.float64)
    length = torch.tensor([len(c) for c in completions], dtype=torch.float64)
    return [(t.mean().item(), t.std().item() / math.sqrt(len(t))) for t in (lp, length)]


def z_scores(a, b):
    return [(x[0] - y[0]) / math.sqrt(x[1] ** 2 + y[1] ** 2) for x, y in zip(a, b, strict=True)]


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 20, 0.9)])
def test_samples_match_transformers_generate(builtin, temperature, top_k, top_p):
    """1024 completions of 24 tokens from each sampler (same prompts and seed): the two-sample z statistic of the mean
    per-token log-prob and of the mean length must stay within |z| < 4 (tolerance of this test). Negative control at
    temperature 1: sampling at temperature 1.1 instead moves the log-prob statistic by |z| > 4 (measured z ~ 5)."""
    hf = sample_stats(builtin, hf_samples(builtin, temperature, top_k, top_p, 0))
    fast = sample_stats(builtin, fast_samples(builtin, temperature, top_k, top_p, 0))
    z = z_scores(hf, fast)
    assert all(abs(v) < 4 for v in z), (hf, fast, z)
    if temperature == 1.0:
        wrong = sample_stats(builtin, fast_samples(builtin, 1.1, top_k, top_p, 0))
        assert abs(z_scores(hf, wrong)[0]) > 4, (hf, wrong)


# ---------------------------------------------------------------- trainer plumbing and flags


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--generation_backend", "nope"], "--generation_backend must be one of trl, fast"),
        (["--generation_backend", "fast", "--repetition_penalty", "1.2"], "--repetition_penalty 1.2 is not implemented"),
        (["--generation_backend", "fast", "--min_p", "0.1"], "--min_p 0.1 is not implemented"),
        (["--generation_backend", "fast", "--generation_kwargs", '{"num_beams": 2}'], "--generation_kwargs"),
        (["--generation_backend", "fast", "--cache_implementation", "static"], "--cache_implementation"),
        (["--generation_backend", "fast", "--temperature", "0"], "needs --temperature > 0"),
    ],
)  # fmt: skip
def test_bad_flags_exit_2(train_cli_error, argv, needle):
    assert needle in train_cli_error("--reward", "happy_binary", *argv)


def test_trainer_batch_carries_logprobs_equal_to_the_trainers(builtin_path, tmp_path):
    from environments.stories import load_prompts
    from trl_ext.config import train_config
    from trl_ext.models import load_tokenizer, prepare_tokenizer
    from trl_ext.trainer import ExtGRPOTrainer

    tok = prepare_tokenizer(load_tokenizer(builtin_path))
    prompts = load_prompts("builtin", tok, 8, "train", 16, 0)
    args = train_config(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_steps=1,
                        max_completion_length=24, temperature=0.9, top_k=30, report_to=[], use_cpu=True,
                        generation_backend="fast")  # fmt: skip
    trainer = ExtGRPOTrainer(model=str(builtin_path), reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                             train_dataset=prompts, processing_class=tok, args=args)  # fmt: skip
    batch = trainer._generate_and_score_completions([prompts[i] for i in range(8)])
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        lp = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, batch["completion_ids"].size(1))[0]
    keep = batch["completion_mask"].bool()
    assert keep.sum() > 50
    assert (lp - batch["sampling_per_token_logps"])[keep].abs().max().item() < 1e-5


@pytest.mark.slow
def test_grpo_with_fast_backend_learns_the_quickstart(builtin_path, tmp_path):
    """happy_binary on the builtin model: the mean reward of the last 5 steps exceeds the first 5 steps' by > 0.2."""
    flags = ["--reward", "happy_binary", "--model", "builtin", "--lr", "1e-3", "--max_steps", "20", "--batch_size",
             "16", "--num_generations", "8", "--max_completion_length", "32", "--logging_steps", "5", "--save_steps",
             "20", "--no_wandb", "--output_dir", str(tmp_path), "--generation_backend", "fast", "--run_name", "fast"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = zygote.run([sys.executable, "train.py", *flags], cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads((tmp_path / "fast" / "checkpoint-20" / "trainer_state.json").read_text())
    rewards = {h["step"]: h["reward"] for h in state["log_history"] if "reward" in h}
    assert sorted(rewards) == [5, 10, 15, 20]
    assert rewards[20] > rewards[5] + 0.2, rewards
