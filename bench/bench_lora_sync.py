"""LoRA versions sent to vLLM as adapters (``--vllm_lora_sync adapter``: the base weights once, then each version's
PEFT adapter) against the whole merged model every version (``merged``), side by side: train.py at k = 0 from one
process, LoRA rank 16, alternating arms, ``--rounds`` rounds.

Per run, over steps 2.. (step 1 includes the start-up, and for 'adapter' the base weights): the bytes of a publish
(``vllm/publish_bytes``; step 1's are kept apart), the median ``vllm/publish_seconds`` and ``step_time``. With
``--placement server`` (one policy server per model, started with LoRA enabled at max rank 16, shared by both arms)
also the server's own time per version taken (``/v1/trl_ext/info``: delta ``load_seconds`` / delta
``checkpoint_loads + adapter_loads`` over the run; its log's per-load lines give the adapters alone apart from the
base's reload). ``--placement inprocess``: TRL's colocate engine, one per run (the merged arm's in-place reload
logs its bytes and seconds since commit eeac100; the in-process results of bench/results predate it and hold none).
The model is bench/train_memory.py's random 154.9M-parameter Llama (``llama``) or a random Qwen2ForCausalLM of
Qwen2.5-0.5B's shape with the builtin model's small vocabulary and an
untied head (``qwen05``). Prints min / median / max, the ratio adapter / merged per round, the load average and the
CPU model, and writes them to ``--out`` (JSON).

    .venv/bin/python bench/bench_lora_sync.py --model llama --placement server   # lora_sync-llama-server.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
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

from bench_serve import free_port  # noqa: E402
from bench_vllm import cpu_model, spread  # noqa: E402

ARMS = ("merged", "adapter")
RANK = 16
QWEN05 = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
          "intermediate_size": 4864, "tie_word_embeddings": False, "rope_theta": 1e6,
          "max_position_embeddings": 32768}  # fmt: skip
"""Qwen2.5-0.5B's shape (its config.json), the vocabulary aside."""
METRICS = ("bytes", "publish_s", "take_s", "step_s")


def random_qwen05(out: Path) -> int:
    """A random float32 Qwen2 of `QWEN05` with the builtin model's tokenizer, saved to ``out``; its parameter count."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from trl_ext.models.builtin import ensure_builtin

    tok = AutoTokenizer.from_pretrained(ensure_builtin())
    cfg = Qwen2Config(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                      bos_token_id=None, **QWEN05)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).float()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    tok.save_pretrained(f"{out}-tokenizer")  # no config.json beside it: `start_lora_server`
    n = sum(p.numel() for p in model.parameters())
    print(f"random Qwen2 (Qwen2.5-0.5B's shape): {n:,} parameters (vocab {len(tok)}) at {out}", flush=True)
    return n


def start_lora_server(source: str, weights: str, port: int, tokenizer: str | None = None):
    """layout.py's policy server for ``source`` on cores 0-1 with LoRA enabled for rank-`RANK` adapters at k = 0
    (bench_serve.start_server with ``lora``), healthy. ``tokenizer``: a directory holding the tokenizer alone, for a
    Qwen2 with a foreign tokenizer (transformers 5's AutoTokenizer, which vLLM uses, swaps the saved class for
    Qwen2Tokenizer beside a qwen2 config.json: trl_ext.models.load_tokenizer; train.py refuses the mismatch)."""
    from trl_ext.serve.client import Replica
    from trl_ext.serve.plan import LayoutArgs, ServerSpec, server_command, server_env
    from trl_ext.vllm.engine import lora_settings

    args = LayoutArgs(port=port, enforce_eager=True, max_model_len=512)
    spec = ServerSpec("policy", 0, source, port, [0, 1])
    log = open(Path(weights) / "server.log", "w")
    env = server_env(spec, False, weights, dict(os.environ))
    cmd = server_command(spec, args, False, 0, "files", lora=lora_settings(RANK, 0))
    cmd += ["--tokenizer", tokenizer] * bool(tokenizer)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600
    while not Replica(f"http://127.0.0.1:{port}").healthy():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start: {weights}/server.log")
        time.sleep(1)
    return proc


def run(argv: list[str], out: Path, env: dict) -> dict:
    """One train.py run's publish bytes (step 1 and the median of steps 2..), median publish seconds and step time
    of steps 2.. (None where not logged); its output directory removed afterwards."""
    proc = subprocess.run([sys.executable, "train.py", *argv, "--output_dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, env=env)  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"{' '.join(argv)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    state = json.loads(next(run_dir.glob("checkpoint-*/trainer_state.json")).read_text())
    shutil.rmtree(out)
    logs = [r for r in state["log_history"] if "step_time" in r]

    def med(key: str, later: bool = True) -> float | None:
        values = [r[key] for r in logs if key in r and (r["step"] >= 2) == later]
        return statistics.median(values) if values else None

    return {"bytes": med("vllm/publish_bytes"), "bytes_step1": med("vllm/publish_bytes", False),
            "publish_s": med("vllm/publish_seconds"), "step_s": med("step_time"),
            "base_sends": max((r.get("vllm/base_sends", 0) for r in logs), default=0)}  # fmt: skip


def server_loads(text: str) -> dict:
    """The per-load seconds a server's log ``text`` reports: adapters taken, checkpoints loaded."""
    return {"adapter": [float(s) for s in re.findall(r"trl_ext: adapter \S+ taken in ([\d.]+) s", text)],
            "checkpoint": [float(s) for s in re.findall(r"checkpoint loaded in ([\d.]+) s", text)]}  # fmt: skip


def fmt(x) -> str:
    return "-" if x is None else f"{x:.4g}"


def summary(rows: list[dict], key: str) -> dict | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return spread(values) if values else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["llama", "qwen05"], default="llama")
    ap.add_argument("--placement", choices=["server", "inprocess"], default="server")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    out_path = Path(a.out or f"bench/results/lora_sync-{a.model}-{a.placement}.json")

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    tmp = Path(tempfile.mkdtemp(prefix="trl_ext_bench_lora_", dir=shm))  # the model and the servers' checkpoints
    outs = Path(tempfile.mkdtemp(prefix="trl_ext_bench_lora_runs_"))  # the runs' own checkpoints, on disk
    source = str(tmp / a.model)
    if a.model == "llama":
        from train_memory import random_llama

        params = random_llama(Path(source))
    else:
        params = random_qwen05(Path(source))
    weights = tmp / "weights"
    weights.mkdir()
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "WANDB_MODE": "disabled"}
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    base = ["--reward", "happy_binary", "--model", source, "--prompts", "builtin", "--max_steps", str(a.steps),
            "--save_steps", str(a.steps), "--batch_size", "8", "--num_generations", "4", "--max_completion_length",
            "16", "--use_vllm", "--lr", "1e-4", "--logging_steps", "1", "--no_wandb", "--lora_rank", str(RANK),
            "--lora_alpha", str(2 * RANK), "--gradient_checkpointing", "False", "--bf16", "False"]  # fmt: skip
    server = replica = None
    rows: dict[str, list[dict]] = {n: [] for n in ARMS}
    load_before = os.getloadavg()[0]
    try:
        if a.placement == "server":
            from trl_ext.serve.client import Replica

            port = free_port()
            tokenizer = f"{source}-tokenizer" if a.model == "qwen05" else None
            server = start_lora_server(source, str(weights), port, tokenizer)
            replica = Replica(f"http://127.0.0.1:{port}")
            print(f"server up: max_lora_rank {replica.info()['max_lora_rank']}", flush=True)
            env["TRL_EXT_WEIGHTS_DIR"] = str(weights)
            base += ["--vllm_mode", "server", "--vllm_server_base_url", replica.url]
        else:
            base += ["--vllm_mode", "colocate", "--vllm_enforce_eager"]
        log = weights / "server.log"
        for r in range(1, a.rounds + 1):
            for arm in ARMS if r % 2 else tuple(reversed(ARMS)):
                before, offset = (replica.info(), log.stat().st_size) if replica else (None, 0)
                row = run(base + ["--vllm_lora_sync", arm], outs / f"{arm}{r}", env)
                if replica:
                    after = replica.info()
                    taken = sum(after[k] - before[k] for k in ("checkpoint_loads", "adapter_loads"))
                    row["take_s"] = (after["load_seconds"] - before["load_seconds"]) / taken
                    row["takes"] = {k: after[k] - before[k] for k in ("checkpoint_loads", "adapter_loads")}
                    with log.open() as f:
                        f.seek(offset)
                        row["loads_s"] = server_loads(f.read())
                    if arm == "adapter" and row["loads_s"]["adapter"]:
                        row["adapter_take_s"] = statistics.median(row["loads_s"]["adapter"])
                rows[arm].append(row)
            print(f"round {r}: " + "; ".join(
                f"{n} " + ", ".join(f"{k} {fmt(rows[n][-1].get(k))}" for k in METRICS + ("bytes_step1",))
                for n in ARMS), flush=True)  # fmt: skip
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(outs, ignore_errors=True)
    ratios = {}
    for key in METRICS:
        pairs = [(x[key], y[key]) for x, y in zip(rows["adapter"], rows["merged"])
                 if x.get(key) is not None and y.get(key)]  # fmt: skip
        ratios[key] = spread([x / y for x, y in pairs]) if pairs else None
    result = {
        "model": a.model, "parameters": params, "placement": a.placement, "lora_rank": RANK, "steps": a.steps,
        "rounds": a.rounds, "trainer_processes": 1, "max_async_level": 0,
        **{key: {n: summary(rows[n], key) for n in ARMS} for key in METRICS + ("bytes_step1",)},
        "adapter_take_s_alone": summary(rows["adapter"], "adapter_take_s"),
        "ratio_adapter_to_merged": ratios, "runs": rows,
        "load_average": [load_before, os.getloadavg()[0]], "cpu": cpu_model(), "cpus": os.cpu_count(),
    }  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
