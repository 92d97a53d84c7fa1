"""Off-policy training (``--max_async_level 1``) on architectures the fast sampler does not support: the generator
samples with transformers' own forward (``--generation_backend trl``, the default), so GPT-2 (absolute positions)
and Phi-3 train end to end, and the generator's behaviour log-probs are the trainer's (ratio 1 at the first step)."""

from __future__ import annotations

import json

import pytest
import torch

import trl_ext.cli_train as cli
from trl_ext.models.tiny import build_tiny


@pytest.fixture(scope="module")
def tiny_dirs(builtin_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {family: str(build_tiny(family, root / family, tokenizer="builtin")) for family in ("gpt2", "phi3", "llama")}


def test_generator_logprobs_equal_the_trainers_on_gpt2_with_unequal_prompts(tiny_dirs, tmp_path):
    """The trainer's own forward (TRL's fused LM head, no position ids) over left-padded prompts of unequal length
    against the transformers sampler's behaviour log-probs, on GPT-2, whose absolute position embeddings make the
    numbering of padded positions matter."""
    from datasets import Dataset

    from trl_ext.config import train_config
    from trl_ext.interfaces import SamplingParams
    from trl_ext.models import load_tokenizer, prepare_tokenizer
    from trl_ext.generation.backends import make_sampler
    from trl_ext.offpolicy.worker import generation_copy
    from trl_ext.trainer import ExtGRPOTrainer

    tok = prepare_tokenizer(load_tokenizer(tiny_dirs["gpt2"]))
    texts = ["Ben was a quiet owl who", "Lily felt", "The sun", "One day a small red fox ran to the"]
    args = train_config(output_dir=str(tmp_path), beta=0.0, temperature=0.8, top_k=20, report_to=[], use_cpu=True,
                        disable_dropout=True)  # fmt: skip
    trainer = ExtGRPOTrainer(model=tiny_dirs["gpt2"], reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                             train_dataset=Dataset.from_dict({"prompt": texts}), processing_class=tok,
                             args=args)  # fmt: skip
    prompt_ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts] * 4
    assert len({len(p) for p in prompt_ids}) >= 3  # unequal lengths: left padding
    params = SamplingParams(24, 0.8, 20, 1.0, tuple(trainer.eos_token_ids), tok.pad_token_id)
    sampler = make_sampler("trl", generation_copy(trainer.model))  # what RolloutWorker builds for the default
    out = sampler.sample(prompt_ids, params, torch.Generator().manual_seed(0))
    width, plen = max(map(len, out.completion_ids)), max(map(len, prompt_ids))
    rows = [[tok.pad_token_id] * (plen - len(p)) + p for p in prompt_ids]
    completion = torch.tensor([c + [tok.pad_token_id] * (width - len(c)) for c in out.completion_ids])
    mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in out.completion_ids])
    ids = torch.cat([torch.tensor(rows), completion], 1)
    attn = torch.cat([torch.tensor([[0] * (plen - len(p)) + [1] * len(p) for p in prompt_ids]), mask], 1)
    with torch.no_grad():
        lp = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn, width)[0]
    behaviour = torch.tensor([x + [0.0] * (width - len(x)) for x in out.logprobs])
    log_ratio = (lp - behaviour)[mask.bool()]
    assert log_ratio.numel() > 100 and log_ratio.abs().max().item() < 1e-5


CASES = {
    "gpt2-full-strict": ("gpt2", ["--disable_dropout", "--strict_async_level"]),  # GPT-2's dropouts default to 0.1
    "gpt2-full-inflight": ("gpt2", ["--disable_dropout"]),
    "phi3-full-strict": ("phi3", ["--strict_async_level"]),
    "phi3-full-inflight": ("phi3", []),
    "llama-lora-inflight": ("llama", ["--lora_rank", "4"]),
    "llama-full-fast-strict": ("llama", ["--generation_backend", "fast", "--strict_async_level"]),  # chosen explicitly
}
ANNOUNCED = {"trl": "off-policy generator: transformers model forward with a DynamicCache",
             "fast": "off-policy generator: the fast sampler"}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_k1_trains_on_other_families(tiny_dirs, tmp_path, capsys, case):
    family, extra = CASES[case]
    argv = ["--reward", "sentence_length_10_smooth", "--model", tiny_dirs[family], "--prompts", "builtin",
            "--max_async_level", "1", *extra, "--max_completion_length", "16", "--batch_size", "8",
            "--num_generations", "4", "--max_steps", "2", "--logging_steps", "1", "--save_steps", "2", "--lr", "1e-3",
            "--no_wandb", "--output_dir", str(tmp_path), "--run_name", case]  # fmt: skip
    assert cli.main(argv) == 0
    run_dir = tmp_path / case
    out = capsys.readouterr().out  # train.py's stdout (train.log's tee works on descriptors, which pytest bypasses)
    backend = "fast" if "fast" in extra else "trl"
    assert out.count(ANNOUNCED[backend]) == 1 and out.count(f"(--generation_backend {backend})") == 1
    state = json.loads((run_dir / "checkpoint-2" / "trainer_state.json").read_text())
    logs = [h for h in state["log_history"] if "offpolicy/policy_lag_max" in h]
    assert [h["step"] for h in logs] == [1, 2]
    # step 1: the generator's weights are the trainer's, so the ratio is 1 up to float32 rounding
    assert logs[0]["offpolicy/abs_log_ratio_mean"] < 1e-5 and abs(logs[0]["offpolicy/ratio_max"] - 1) < 1e-4
    assert logs[0]["offpolicy/policy_lag_max"] == 0 and logs[1]["offpolicy/policy_lag_max"] <= 1
    assert logs[0]["grad_norm"] > 0  # the step trained: policy 1 differs from policy 0
    if "--strict_async_level" in extra:  # batch 2 is policy 0's, trained by policy 1: the ratio moved
        assert logs[1]["offpolicy/multi_version_seq_frac"] == 0 and logs[1]["offpolicy/policy_lag_max"] == 1
        assert logs[1]["offpolicy/abs_log_ratio_mean"] > 1e-4
