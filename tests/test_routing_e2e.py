"""End-to-end: train.py with gradient routing on the builtin model for a few steps; checks the routing eval
records, the adapter layout saved with the checkpoint, train.log and the logged routing labels."""

import json
import os
import sys
from pathlib import Path

import pytest
import zygote

ROOT = Path(__file__).resolve().parents[1]
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # every linear of a block


@pytest.mark.slow
def test_train_with_routing_on_builtin(builtin_path, tmp_path):
    flags = [
        "--reward", "sentence_length_5_with_happy", "--model", "builtin", "--lr", "1e-3", "--max_steps", "4",
        "--batch_size", "8", "--num_generations", "4", "--max_completion_length", "16", "--logging_steps", "2",
        "--save_steps", "4", "--eval_rewards", "sentence_length_5,happy_count", "--gradient_routing",
        "--routing_mode", "shared", "--lora_config", "r2", "--eval_routing_steps", "2", "--eval_routing_prompts", "8",
        "--no_wandb", "--output_dir", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = zygote.run([sys.executable, "train.py", *flags], cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]

    name = ("sentence_length_5_with_happy_builtin_lr1e-3_b0.02_bs8_ng4_dual_r2f2_st4_s42_gradient_routingtrue"
            "_max_completion_length16_routing_modeshared")
    run_dir = tmp_path / name
    assert [p.name for p in tmp_path.iterdir()] == [name]

    # The routing eval: every 2 steps (2, 4; the last step is one of them), three modes, every metric.
    records = [json.loads(line) for line in (run_dir / "routing_eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    keys = {"reward/sentence_length_5_with_happy", "reward/sentence_length_5", "reward/happy_count", "rh_rate",
            "unique_frac", "mean_jaccard"}
    for r in records:
        assert r["rh_detector"] == "happy" and r["n_prompts"] == 8
        assert set(r["modes"]) == {"both", "retain_only", "forget_only"}
        for m in r["modes"].values():
            assert set(m) == keys
            # the reward is sentence_length_5 + 0.25 * min(happy_count, 2): with happy_count's mean m_h and the
            # cap, reward <= sl5 + 0.25 * m_h; rates and fractions lie in [0, 1]
            assert m["reward/sentence_length_5_with_happy"] <= m["reward/sentence_length_5"] + 0.25 * m[
                "reward/happy_count"] + 1e-9
            assert all(0.0 <= m[k] <= 1.0 for k in ("rh_rate", "unique_frac", "mean_jaccard"))
    log = (run_dir / "train.log").read_text()
    for step in (2, 4):
        for mode in ("both", "retain_only", "forget_only"):
            assert f"[Routing eval @ step {step}] {mode}: " in log

    # The checkpoint carries its adapter layout (preset r2: alpha = rank, as small-rl).
    ckpt = run_dir / "checkpoint-4"
    layout = json.loads((ckpt / "dual_lora_layout.json").read_text())
    assert layout == {"retain_rank": 2, "forget_rank": 2, "alpha": 2.0, "targets": LLAMA_TARGETS,
                      "layer_start": 0, "layer_end": 4, "layer_stride": 1, "include_lm_head": False,
                      "adapter_type": "lora", "routing_mode": "shared"}
    state = json.loads((ckpt / "trainer_state.json").read_text())
    labels = [h for h in state["log_history"] if "routing/n_samples" in h]
    # one generation batch of 8 per step; without eligibility/noise knobs every detected sample is routed
    assert [h["step"] for h in labels] == [2, 4]
    assert all(h["routing/n_samples"] == 8 and h["routing/n_bad"] == h["routing/n_detected"] for h in labels)
    assert all(h["rh_rate"] == pytest.approx(h["routing/n_detected"] / 8, abs=1e-12) for h in labels)
    evals = [h for h in state["log_history"] if "routing_eval/retain_only/rh_rate" in h]
    assert [h["step"] for h in evals] == [2, 4]
    assert evals[-1]["routing_eval/retain_only/rh_rate"] == records[-1]["modes"]["retain_only"]["rh_rate"]

    from trl_ext.routing.checkpoint import load_dual_lora_checkpoint
    from trl_ext.routing.adapters import retain_params

    model = load_dual_lora_checkpoint(ckpt)
    assert max(p.abs().max().item() for p in retain_params(model)) > 0  # trained adapters came back
    assert json.loads((run_dir / "run_summary.json").read_text())["steps"] == 4
