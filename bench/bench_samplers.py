"""The off-policy generator's two samplers side by side: seconds per generation batch of the transformers sampler
(``--generation_backend trl``, ``trl_ext.generation.hf_sampler``) and the fast sampler (``--generation_backend
fast``), same model, prompts, settings and seed, alternating for ``--rounds`` rounds; prints min / median / max and
the per-round ratio. The EOS id given to the samplers is outside the vocabulary, so every row decodes ``--tokens``
tokens.

    uv run python bench/bench_samplers.py                       # builtin model, CPU, 1 thread (the generator's)
    uv run python bench/bench_samplers.py --model output/tiny-gpt2   # transformers sampler only (fast refuses it)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads starve on shared cores

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from environments.stories import load_prompts  # noqa: E402
from trl_ext.generation.backends import SAMPLERS  # noqa: E402
from trl_ext.interfaces import SamplingParams  # noqa: E402
from trl_ext.models import load_tokenizer, model_source, prepare_tokenizer  # noqa: E402


def spread(values: list[float], fmt: str = ".3f") -> str:
    return f"median {statistics.median(values):{fmt}} (min {min(values):{fmt}}, max {max(values):{fmt}})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the CPU generator thread's default: 1)")
    ap.add_argument("--backends", nargs="+", default=list(SAMPLERS), choices=list(SAMPLERS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    source = model_source(a.model)
    tok = prepare_tokenizer(load_tokenizer(source))
    model = AutoModelForCausalLM.from_pretrained(source).to(a.device).eval()
    prompts = tok(list(load_prompts("builtin", tok, 8, "train", a.batch, 0)["prompt"]), add_special_tokens=False)
    never = model.config.vocab_size + 7  # an id no logit has: EOS is never sampled, every row runs to --tokens
    params = SamplingParams(a.tokens, 1.0, 0, 1.0, (never,), tok.pad_token_id)
    samplers = {name: SAMPLERS[name](model) for name in a.backends}
    for sampler in samplers.values():  # warm-up (CUDA graphs, allocator)
        sampler.sample(prompts["input_ids"], params, torch.Generator(a.device).manual_seed(0))
    times: dict[str, list[float]] = {name: [] for name in samplers}
    load_before = os.getloadavg()
    for r in range(a.rounds):
        for name in (list(samplers) if r % 2 == 0 else list(reversed(samplers))):
            if a.device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = samplers[name].sample(prompts["input_ids"], params, torch.Generator(a.device).manual_seed(r))
            if a.device == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
            assert all(len(c) == a.tokens for c in out.completion_ids)
        print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.3f} s" for n, v in times.items()), flush=True)
    print(f"{a.model}, {a.device}, batch {a.batch} x {a.tokens} tokens, {a.threads} thread(s), {a.rounds} rounds")
    for name, v in times.items():
        print(f"  {name}: {spread(v)} s per batch")
    if len(times) == 2:
        ratios = [x / y for x, y in zip(times["trl"], times["fast"], strict=True)]
        print(f"  trl / fast time ratio: {spread(ratios, '.2f')}")
    print(f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after, on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
