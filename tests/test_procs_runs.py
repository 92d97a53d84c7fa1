"""Several processes as ONE run, through train.py (torchrun, 2 CPU processes, gloo): each feature verified there runs
to a checkpoint, writing its files once (the equivalence of the steps themselves: tests/test_procs.py)."""

from __future__ import annotations

import sys

import pytest
import zygote
from test_procs import PROMPTS, ROOT, torchrun


@pytest.mark.slow
def test_torchrun_distillation_fast_backend_rollouts(tmp_path):
    """`torchrun --nproc_per_node 2 train.py` with distillation on LoRA (and its --eval_baseline, sampled by the main
    process), the fast backend and saved rollouts: one run to a checkpoint; the distillation metrics are logged; each
    step's rollouts are ONE shard (written by the main process) holding both processes' rows with their global sample
    and group numbers. Token records (``--token_records_every 1``, runs/token_records.py: the main process gathers
    every process's rows and writes the shard alone): each step's token shard holds one row per completion token of
    all 8 samples, process 1's (samples 4-7) included, with the loss's and the teacher's values on every trained
    token; a gather of process 0's rows alone (sabotage row ``token_records_gathered``) leaves 4 samples."""
    from trl_ext.runs.rollouts import load_rollouts, load_token_records, shard_steps

    out = tmp_path / "out"
    proc = torchrun(["train.py", "--reward", "happy_binary", "--lora_rank", "4", "--teacher_tau", "0.1",
                     "--teacher_context", "A happy story.", "--eval_baseline", "--eval_baseline_prompts", "8",
                     "--generation_backend", "fast", "--save_rollouts", "--token_records_every", "1",
                     "--max_steps", "2", "--batch_size", "4", "--num_generations", "8", "--max_completion_length",
                     "8", "--save_steps", "2", "--logging_steps", "1", "--no_wandb", "--output_dir", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = out.iterdir()
    log = (run_dir / "train.log").read_text()
    assert log.count("$ train.py") == 1 and "advantages: distill (step 1)" in log
    assert "distill/teacher_logp_sum" in log and "= 8 completions per optimizer step (global)" in log
    assert log.count("eval_baseline student:") == 1 and (run_dir / "eval_baseline.json").is_file()  # main only
    assert (run_dir / "checkpoint-2" / "checkpoint_complete.json").is_file()
    assert {s: [p.name for p in paths] for s, paths in shard_steps(run_dir).items()} == {
        1: ["step-000001-rank0.parquet"], 2: ["step-000002-rank0.parquet"]}
    rows = load_rollouts(run_dir, 1)
    assert rows["sample"] == list(range(8)) and rows["group"] == [0] * 8  # one group of 8 over both processes
    assert all(v is not None and v < 0 for v in rows["teacher_logprob_sum"])
    assert abs(sum(rows["advantage"])) < 1e-4  # distillation's advantage sums to 0 over the (whole) group
    assert max(abs(a) for a in rows["advantage"]) > 1e-3
    assert rows["completion"][:4] != rows["completion"][4:]  # each process samples with its own seed (TRL's)
    for step in (1, 2):  # the token records: every token of both processes' samples, in one shard
        rows, tokens = load_rollouts(run_dir, step), load_token_records(run_dir, step).to_pandas()
        per_sample = tokens.groupby("sample").size()
        assert sorted(per_sample.index) == list(range(8)), (step, sorted(per_sample.index))  # process 1's: 4-7
        assert per_sample.tolist() == rows["completion_tokens"] and len(tokens) == sum(rows["completion_tokens"])
        trained = tokens[tokens["trained"]]
        assert len(trained) == len(tokens) and (trained["step"] == step).all()
        assert trained[["trainer_logprob", "behaviour_logprob", "teacher_logprob"]].notna().all().all()


@pytest.mark.slow
def test_torchrun_routed_run_to_a_checkpoint(tmp_path):
    """`torchrun --nproc_per_node 2 train.py` routed r4 on sentence_length_5_with_happy: one run to a checkpoint;
    the routing eval (run by every process and checked equal across them) is printed and saved once per eval; the
    labels are logged for the whole batch; the adapter-only checkpoint loads in eval_run.py."""
    import json

    out = tmp_path / "out"
    proc = torchrun(["train.py", "--reward", "sentence_length_5_with_happy", "--gradient_routing", "--routing_mode",
                     "exclusive", "--lora_config", "r4", "--save_adapter_only", "--eval_routing_steps", "2",
                     "--eval_routing_prompts", "8", "--max_steps", "2", "--batch_size", "4", "--num_generations", "4",
                     "--max_completion_length", "8", "--save_steps", "2", "--logging_steps", "1", "--no_wandb",
                     "--output_dir", str(out)])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = out.iterdir()
    log = (run_dir / "train.log").read_text()
    assert log.count("$ train.py") == 1 and "advantages: routing:retain-only (step 1)" in log
    assert log.count("'routing/n_samples': '8'") == 2  # the labels' counts are over both processes' completions
    records = [json.loads(line) for line in (run_dir / "routing_eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2] and set(records[0]["modes"]) == {"both", "retain_only", "forget_only"}
    ckpt = run_dir / "checkpoint-2"
    assert (ckpt / "dual_lora_layout.json").is_file() and not (ckpt / "model.safetensors").exists()
    ev = zygote.run([sys.executable, "eval_run.py", "--model_path", str(ckpt), "--n_samples", "4"],
                        capture_output=True, text=True, timeout=240, cwd=ROOT)  # fmt: skip
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert f"checkpoint: {ckpt} (dual_lora)" in ev.stdout and "retain_only" in ev.stdout


ECHO = '''
def echo(completions, answer, **kwargs):
    return [float(a) for a in answer]
'''


@pytest.mark.slow
@pytest.mark.parametrize("sharding", [[], ["--fsdp"]], ids=["ddp", "fsdp2"])
def test_torchrun_dataset_columns_and_eval_rewards(tmp_path, sharding):
    """`--dataset` JSONL on 2 processes, DDP or FSDP2: every completion's reward reads its own row's ``answer`` column
    (through TRL's keyword call), on both processes; the ``--eval_rewards`` mean in train.log is over the whole batch
    (it equals the reward mean, the same function of the rows), and the saved rows agree. TRL's eval loop on
    ``--eval_dataset`` (8 rows, answers 100..107) logs the mean over all of them, 103.5 (either process's half alone:
    101.5 or 105.5)."""
    import json
    import re

    from trl_ext.runs.rollouts import load_rollouts

    (tmp_path / "r.py").write_text(ECHO)
    config = tmp_path / "config.yaml"
    config.write_text('rewards:\n  echo: {fn: "r.py:echo"}\n  echo_eval: {fn: "r.py:echo"}\n')
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": 10 * i + 1}) + "\n" for i, p in enumerate(PROMPTS)))
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": p, "answer": 100 + i}) + "\n" for i, p in enumerate(PROMPTS * 2)))
    out = tmp_path / "out"
    proc = torchrun(["train.py", "--reward", "echo", "--eval_rewards", "echo_eval", "--config", str(config),
                     "--dataset", str(data), "--eval_dataset", str(held_out), "--eval_strategy", "steps",
                     "--eval_steps", "2", "--per_device_eval_batch_size", "4", "--save_rollouts", "--max_steps", "2",
                     "--batch_size", "4", "--num_generations", "4", "--max_completion_length", "8", "--logging_steps",
                     "1", "--no_wandb", "--output_dir", str(out), *sharding])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = out.iterdir()
    assert ("(gloo backend, FSDP2: " if sharding else "(gloo backend, DDP)") in (run_dir / "train.log").read_text()
    answer = {p.lower(): 10 * i + 1 for i, p in enumerate(PROMPTS)}
    for step in (1, 2):
        rows = load_rollouts(run_dir, step)
        assert len(rows) == 8 and rows["sample"] == list(range(8))
        assert rows["reward/echo"] == [answer[p.strip()] for p in rows["prompt"]]
        assert rows["eval_reward/echo_eval"] == rows["reward/echo"]
        assert len(set(rows["prompt"][:4])) == 1 and rows["prompt"][0] != rows["prompt"][4]  # one group per process
    log = (run_dir / "train.log").read_text()
    rewards = [float(v) for v in re.findall(r"'reward': '([0-9.]+)'", log)]
    evals = [float(v) for v in re.findall(r"'eval_rewards/echo_eval': '([0-9.]+)'", log)]
    assert len(rewards) == 2 and rewards == evals  # the mean over both processes' rows, not the main one's half
    assert [float(v) for v in re.findall(r"'eval_reward': '([0-9.]+)'", log)] == [103.5]


@pytest.mark.slow
def test_torchrun_environment_mixture_off_policy(tmp_path):
    """`--env frozenlake,arithmetic` (multi- and single-turn episodes in one batch) at k = 1 on 2 processes, each
    process's generator thread playing its slice's episodes: one run to a checkpoint; every saved step holds both
    processes' episodes with their environment and level, each group one environment; the episode metrics are
    logged over both processes (the shares sum to 1)."""
    import re

    from trl_ext.runs.rollouts import load_rollouts

    out = tmp_path / "out"
    proc = torchrun(["train.py", "--env", "frozenlake,arithmetic", "--model", "builtin_env", "--max_async_level", "1",
                     "--generation_backend", "fast", "--save_rollouts", "--max_steps", "2", "--batch_size", "4",
                     "--num_generations", "4", "--max_completion_length", "48", "--save_steps", "2",
                     "--logging_steps", "1", "--no_wandb", "--output_dir", str(out)])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = out.iterdir()
    for step in (1, 2):
        rows = load_rollouts(run_dir, step)
        assert rows["sample"] == list(range(8)) and set(rows["env"]) <= {"frozenlake", "arithmetic"}
        for g in (0, 1):  # a group plays one level of one environment
            assert len({(e, s) for e, s, k in zip(rows["env"], rows["env_seed"], rows["group"]) if k == g}) == 1
    log = (run_dir / "train.log").read_text()
    shares = [float(a) + float(b) for a, b in re.findall(
        r"'env/frozenlake/share': '([0-9.]+)'.*?'env/arithmetic/share': '([0-9.]+)'", log)]
    assert len(shares) == 2 and all(abs(x - 1) < 1e-6 for x in shares)
    assert (run_dir / "checkpoint-2" / "checkpoint_complete.json").is_file()


@pytest.mark.slow
def test_torchrun_sft_mode(tmp_path):
    """`--mode sft` on 2 processes: TRL's SFTTrainer under DDP, one run; 64 records at 8 per process make 4 steps
    per epoch (the global batch is 16); the main process alone validates, saves the merged model and the summary."""
    import json

    out = tmp_path / "out"
    proc = torchrun(["train.py", "--mode", "sft", "--env", "arithmetic", "--model", "builtin_env", "--sft_train_size",
                     "64", "--sft_test_size", "8", "--sft_epochs", "1", "--batch_size", "8", "--save_steps", "4",
                     "--logging_steps", "1", "--no_wandb", "--output_dir", str(out)])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = out.iterdir()
    log = (run_dir / "train.log").read_text()
    assert log.count("$ train.py") == 1 and log.count("validation before SFT") == 1
    assert "batch: 8 completions per process x 2 processes = 16" in log and run_dir.name.endswith("_procs2")
    state = json.loads((run_dir / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == state["max_steps"] == 4
    summary = json.loads((run_dir / "run_summary.json").read_text())
    assert summary["status"] == "done" and summary["records"] == 64 and (run_dir / "model" / "config.json").is_file()
