"""GPU benchmark of the fast generation backend, with transformers' generate and vanilla TRL beside it on one GPU.

1. checks (the graph path has no CI): the fast sampler's log-probs against a float32 forward pass, the same seed
   giving the same sample, in-place weight changes reaching the captured graph;
2. generation only, ``--batch`` rows x 64 new tokens: transformers ``generate`` vs the fast sampler without and with
   CUDA graphs, on the builtin model (fp32), SimpleStories-1.25M's shape (vocab 4096) and a Qwen2.5-0.5B-shaped model
   (both randomly initialised offline, bf16; EOS never sampled, so every run makes all 64 tokens);
3. the whole GRPO step at bench_step.py's config (builtin, batch 32, 16 generations, 64 tokens, beta 0.02):
   vanilla trl.GRPOTrainer vs ExtGRPOTrainer with ``--generation_backend fast`` and with ``--max_async_level 1
   --generation_backend fast`` (generator thread on its own CUDA stream; needs trl; ``--no_step`` skips it).

Each comparison alternates its arms for ``--rounds`` rounds and prints min / median / max.

    python bench/bench_gpu.py            # on a machine with a CUDA GPU
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trl_ext.generation.fast import FastSampler  # noqa: E402
from trl_ext.interfaces import SamplingParams  # noqa: E402

NEW_TOKENS = 64


def spread(values: list[float], fmt: str = ".4f") -> str:
    return f"median {statistics.median(values):{fmt}} (min {min(values):{fmt}}, max {max(values):{fmt}})"


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def builtin_path() -> str:
    from trl_ext.models import model_source

    return model_source("builtin")


def shapes(builtin: str) -> dict[str, tuple[torch.nn.Module, int]]:
    """name -> (model on the GPU, an EOS id); the random models' EOS is never sampled (its logit is pushed down)."""
    out = {"builtin (fp32)": (LlamaForCausalLM.from_pretrained(builtin).cuda().eval(), 1)}
    torch.manual_seed(0)
    ss = LlamaConfig.from_pretrained(builtin)
    ss.vocab_size = 4096
    out["SimpleStories-1.25M shape (bf16)"] = (LlamaForCausalLM(ss).to("cuda", torch.bfloat16).eval(), 1)
    qwen = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)  # fmt: skip
    out["Qwen2.5-0.5B shape (bf16)"] = (Qwen2ForCausalLM(qwen).to("cuda", torch.bfloat16).eval(), 151643)
    for name, (model, eos) in out.items():
        if "builtin" not in name:
            with torch.no_grad():
                model.lm_head.weight[eos].fill_(0)  # tied: EOS logit exactly 0 ...
                model.model.norm.weight.mul_(30)  # ... among logits of spread ~30: EOS is never sampled
    return out


@torch.no_grad()
def check_sampler(model, eos: int) -> None:
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12][: 4 + i % 5] for i in range(64)]  # unequal lengths: left padding
    params = SamplingParams(32, 0.8, 20, 0.95, (eos,), eos)
    sampler = FastSampler(model)
    gen = torch.Generator("cuda")
    a = sampler.sample(prompts, params, gen.manual_seed(1))
    b = sampler.sample(prompts, params, gen.manual_seed(1))
    assert a.completion_ids == b.completion_ids, "same seed, different sample (graph replay)"
    def forward_logprobs(m):
        width, length = max(map(len, prompts)), max(map(len, a.completion_ids))
        ids = torch.full((len(prompts), width + length), eos, device="cuda")
        attn = torch.zeros_like(ids)
        for i, (p, c) in enumerate(zip(prompts, a.completion_ids, strict=True)):
            ids[i, width - len(p) : width + len(c)] = torch.tensor(p + c)
            attn[i, width - len(p) : width + len(c)] = 1
        logits = m(input_ids=ids, attention_mask=attn).logits[:, width - 1 : -1].float() / params.temperature
        return logits.log_softmax(-1).gather(2, ids[:, width:, None]).squeeze(2)

    def max_diff(lp, ref):
        return max(abs(x - ref[i, j].item()) for i, row in enumerate(lp) for j, x in enumerate(row))

    own = forward_logprobs(model)
    ref = forward_logprobs(copy.deepcopy(model).float())  # the same weights in float32
    own_rows = [own[i, : len(c)].tolist() for i, c in enumerate(a.completion_ids)]
    print(f"  check: max |log-prob - float32 forward| over {sum(map(len, a.logprobs))} tokens: fast sampler "
          f"{max_diff(a.logprobs, ref):.2e}, transformers forward in the model's dtype {max_diff(own_rows, ref):.2e}; "
          f"fast vs that forward {max_diff(a.logprobs, own):.2e}")
    first = model.model.layers[0].mlp.down_proj.weight
    saved = first.clone()
    first.mul_(3)  # in place: the captured graph must see it
    c = sampler.sample(prompts, params, gen.manual_seed(1))
    d = FastSampler(model).sample(prompts, params, gen.manual_seed(1))
    first.copy_(saved)
    assert c.completion_ids == d.completion_ids and c.completion_ids != a.completion_ids, "stale weights in graph"
    print("  check: same seed -> same sample; in-place weight change reaches the graph: ok")


@torch.no_grad()
def bench_generation(name: str, model, eos: int, batch: int, rounds: int) -> None:
    prompts = [[5 + (i % 7), 6, 7, 8, 9, 10, 11, 12] for i in range(batch)]
    params = SamplingParams(NEW_TOKENS, 1.0, 0, 1.0, (eos,), eos)
    ids = torch.tensor(prompts, device="cuda")
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              eos_token_id=[eos], pad_token_id=eos, disable_compile=True)  # fmt: skip
    arms = {
        "transformers.generate": lambda: model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                                        generation_config=config),
        "fast, no graphs": (lambda s=FastSampler(model, cuda_graphs=False): s.sample(prompts, params)),
        "fast, CUDA graphs": (lambda s=FastSampler(model): s.sample(prompts, params)),
    }  # fmt: skip
    for fn in arms.values():  # warm-up (graph capture, allocator)
        fn()
    times = {k: [] for k in arms}
    for _ in range(rounds):
        for k, fn in arms.items():
            times[k].append(timed(fn))
    print(f"{name}, {batch} rows x {NEW_TOKENS} tokens, s per generation:")
    for k, v in times.items():
        ratio = [a / b for a, b in zip(times["transformers.generate"], v, strict=True)]
        print(f"  {k:22s} {spread(v)}   speed-up over generate {spread(ratio, '.1f')}")


def bench_step(rounds: int, steps: int, warmup: int) -> None:
    import copy
    import functools

    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from environments.stories import load_prompts
    from trl_ext.config import ExtGRPOConfig, train_config
    from trl_ext.models import load_tokenizer, prepare_tokenizer
    from trl_ext.trainer import ExtGRPOTrainer

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self._t = [], None

        def on_step_begin(self, args, state, control, **kw):
            torch.cuda.synchronize()
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self._t)

    def happy_binary(completions, **kw):
        return [float("happy" in c.lower().split()) for c in completions]

    source = builtin_path()
    tok = prepare_tokenizer(load_tokenizer(source))
    vanilla_tok = copy.deepcopy(tok)
    vanilla_tok._tokenizer.post_processor = None
    dataset = load_prompts("builtin", tok, 8, "train", 512, 42)
    arms = {"vanilla TRL": (GRPOTrainer, GRPOConfig, vanilla_tok),
            "fast backend": (ExtGRPOTrainer, functools.partial(ExtGRPOConfig, generation_backend="fast"), tok),
            "async k=1": (ExtGRPOTrainer,
                          functools.partial(ExtGRPOConfig, max_async_level=1, generation_backend="fast"), tok)}
    medians = {k: [] for k in arms}
    with tempfile.TemporaryDirectory() as out:
        for _ in range(rounds):
            for name, (trainer_cls, config_cls, tokenizer) in arms.items():
                common = dict(output_dir=out, per_device_train_batch_size=32, num_generations=16,
                              max_completion_length=NEW_TOKENS, learning_rate=3e-4, beta=0.02, loss_type="grpo",
                              max_steps=steps + warmup, logging_steps=1000, save_strategy="no", report_to=[],
                              seed=42, bf16=False, activation_checkpointing=False, disable_tqdm=True)  # fmt: skip
                timer = StepTimer()
                torch.manual_seed(42)
                trainer = trainer_cls(model=source, reward_funcs=[happy_binary], args=config_cls(**common),
                                      train_dataset=dataset, processing_class=tokenizer, callbacks=[timer])  # fmt: skip
                trainer.train()
                medians[name].append(statistics.median(timer.times[warmup:]))
    print(f"whole GRPO step, builtin fp32, batch 32, 16 generations, {NEW_TOKENS} tokens, beta 0.02 "
          f"({rounds} rounds x {steps} steps), s/step:")
    for name, v in medians.items():
        print(f"  {name:14s} {spread(v)}")
    for name in ("fast backend", "async k=1"):
        ratio = [a / b for a, b in zip(medians["vanilla TRL"], medians[name], strict=True)]
        print(f"  speed-up vanilla / {name} {spread(ratio, '.2f')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 512])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no_step", action="store_true")
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    models = shapes(builtin_path())
    for name, (model, eos) in models.items():
        print(name, flush=True)
        check_sampler(model, eos)
    for name, (model, eos) in models.items():
        for batch in args.batch:
            bench_generation(name, model, eos, batch, args.rounds)
            sys.stdout.flush()
    del models
    if not args.no_step:
        bench_step(args.rounds, args.steps, args.warmup)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
