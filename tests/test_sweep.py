"""sweep.py: planning (dry run names and count, validation before launch), resources and slots, the run
loop (failure isolation, resumability, locks, summary) with a fake train script, and the acceptance run:
a 2x2 grid of real train.py runs on the builtin model with one run that fails on purpose."""

import csv
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import zygote

import trl_ext.sweep as sw
from trl_ext.registry import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def _dry(capsys, *argv) -> tuple[int, list[str]]:
    rc = sw.main([*argv, "--dry_run"])
    out = capsys.readouterr().out
    return rc, [line.split(": ", 1)[1].split(" [")[0] for line in out.splitlines() if line.startswith("run ")]


def test_dry_run_names_and_count(capsys, tmp_path):
    rc, dirs = _dry(capsys, "--reward", "happy_binary", "--grid", "seed=1,2", "beta=0.01,0.02",
                    "--fixed", "max_steps=200", "lr=3e-4", f"output_dir={tmp_path}")  # fmt: skip
    assert rc == 0
    # Naming rule: {reward}_{model}_lr{lr}_b{beta}_bs{batch}_ng{gen}_{adapter}_st{steps}_s{seed}.
    expected = [tmp_path / f"happy_binary_builtin_lr3e-4_b{b}_bs32_ng16_full_st200_s{s}"
                for s in ("1", "2") for b in ("0.01", "0.02")]  # fmt: skip
    assert dirs == [str(p) for p in expected]
    assert list(tmp_path.iterdir()) == []  # nothing launched, nothing written


def test_names_differ_by_a_fixed_value(capsys, tmp_path):
    base = ["--reward", "happy_binary", "--grid", "seed=1,2", "--fixed", f"output_dir={tmp_path}"]
    _, short = _dry(capsys, *base, "max_completion_length=8")
    _, long = _dry(capsys, *base, "max_completion_length=16")
    assert len(short) == len(long) == 2 and not set(short) & set(long)
    assert [Path(d).name for d in short] == [
        f"happy_binary_builtin_lr1e-5_b0.02_bs32_ng16_full_st2000_s{s}_max_completion_length8" for s in (1, 2)
    ]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--grid", "seed=1,x"], "run 2 (seed=x): argument --seed: invalid int value: 'x'"),
        (["--grid", "nope=1,2"], "unknown train.py flag --nope"),
        (["--grid", "lr=1e-4,2e-4", "--fixed", "learning_rate=3e-4"], "learning_rate given both"),
        (["--grid", "seed=1,1"], "repeats a value"),
        (["--grid", "beta=0.02,0.020"], "map to one directory"),
        (["--grid", "seed=1,2", "--fixed", "batch_size=30"], "run 1 (seed=1)"),
        (["--fixed", "seed"], "KEY=VALUE"),
        (["--per_gpu", "2"], "--per_gpu needs a visible GPU"),
    ],
)
def test_bad_sweeps_exit_2_before_launch(capsys, monkeypatch, argv, needle):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(sw, "execute", lambda *a, **k: pytest.fail("launched despite a bad plan"))
    assert sw.main(["--reward", "happy_binary", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("sweep.py: error: ") and needle in err, err


def test_missing_reward_is_train_py_s_error(capsys):
    assert sw.main(["--grid", "seed=1,2", "--dry_run"]) == 2
    assert capsys.readouterr().err.startswith("sweep.py: error: run 1 (seed=1): --reward is required")


def test_resources_gpu_and_cpu():
    gpu = sw.resolve_resources(sw.SweepArgs(per_gpu=3), {"CUDA_VISIBLE_DEVICES": "2,3"}, cpus=16)
    assert (gpu.gpus, gpu.capacity, gpu.threads) == (["2", "3"], 6, 16 // 6)
    assert sw.visible_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,1"}) == ["0"]  # CUDA stops at an invalid id
    cpu = {"CUDA_VISIBLE_DEVICES": ""}
    default = sw.resolve_resources(sw.SweepArgs(), cpu, cpus=2)
    assert (default.gpus, default.per_slot, default.threads) == ([], 2, 1)  # one slot per core
    assert sw.resolve_resources(sw.SweepArgs(parallel=1), cpu, cpus=2).threads == 2
    assert sw.resolve_resources(sw.SweepArgs(parallel=4), cpu, cpus=2).threads == 1
    with pytest.raises(ConfigError, match="--parallel is for machines without GPU"):
        sw.resolve_resources(sw.SweepArgs(parallel=2), {"CUDA_VISIBLE_DEVICES": "0"}, cpus=2)


def test_slots_least_loaded_gpu_first():
    slots = sw.Slots(sw.Resources(["0", "1"], 2, 1, None))
    assert [slots.acquire() for _ in range(5)] == ["0", "1", "0", "1", None]
    slots.release("1")
    assert slots.acquire() == "1"
    slots.release("0")
    slots.release("0")
    slots.release("1")
    assert slots.acquire() == "0"  # loads 0 vs 1: the least loaded


def test_child_env_and_mps(tmp_path):
    res = sw.Resources(["3"], 2, 4, None)
    env = sw.child_env({"PATH": "/bin"}, res, "3")
    assert (env["CUDA_VISIBLE_DEVICES"], env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"]) == ("3", "4", "4")
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["PATH"] == "/bin"
    assert sw.child_env({"OMP_WAIT_POLICY": "ACTIVE"}, res, "3")["OMP_WAIT_POLICY"] == "ACTIVE"
    assert "CUDA_VISIBLE_DEVICES" not in sw.child_env({}, sw.Resources([], 2, 1, None), "cpu")
    assert sw.mps_pipe({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}) is None
    (tmp_path / "control").touch()
    assert sw.mps_pipe({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}) == str(tmp_path)


def test_sweep_file_linked_grids_and_overrides(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("reward: happy_binary\ngrid:\n  - {num_generations: [4], batch_size: [8, 16]}\n"
                    "  - {num_generations: [8], batch_size: [16]}\nfixed: {max_steps: 5}\n")  # fmt: skip
    spec = sw.build_spec(sw.SweepArgs(config=str(path), grid=["seed=1,2"], fixed=[f"output_dir={tmp_path}"]))
    runs = sw.plan_runs(spec)
    assert len(runs) == (2 + 1) * 2
    assert [(r.values["num_generations"], r.values["per_device_train_batch_size"]) for r in runs[::2]] == [
        ("4", "8"), ("4", "16"), ("8", "16")]  # fmt: skip
    # A command-line key replaces the file's, wherever the file put it.
    spec = sw.build_spec(sw.SweepArgs(config=str(path), fixed=["num_generations=4", "max_steps=7"]))
    assert spec.grids == [{"per_device_train_batch_size": ["8", "16"]}, {"per_device_train_batch_size": ["16"]}]
    assert spec.fixed == {"reward": "happy_binary", "max_steps": "7", "num_generations": "4"}


def test_shipped_sweep_files():
    counts = {"seed004_beta_seed": 3 * 2, "search_group1_batch_rollout": 3 * 3, "search_group2_lr": 4,
              "search_group3_kl": 6, "search_group4_turns_temperature": 3 * 3}  # fmt: skip
    study = {p.stem for p in (ROOT / "sweeps").glob("offpolicy_*.yaml")}  # tests/test_offpolicy_study.py
    assert len(study) == 2 * 5 + 1  # math and search, and search's GPU replication
    assert sorted(p.stem for p in (ROOT / "sweeps").glob("*.yaml") if p.stem not in study) == sorted(counts)
    for stem, n in counts.items():
        assert len(sw.plan_runs(sw.build_spec(sw.SweepArgs(config=str(ROOT / "sweeps" / f"{stem}.yaml"))))) == n


def test_sweep_file_needs_flags(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("needs: [seed, no_such_flag]\nreward: happy_binary\n")
    with pytest.raises(ConfigError, match="needs train.py flags this version does not have: --no_such_flag$"):
        sw.build_spec(sw.SweepArgs(config=str(path)))


# --------------------------------------------------------------------------- the run loop, fake children
FAKE = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
    d = Path(args["--dir"])
    d.mkdir(parents=True)  # fails if the sweep did not move an unfinished directory aside
    (d / "times").write_text(str(time.time()))
    print("threads", os.environ["OMP_NUM_THREADS"], flush=True)
    if args["--mode"] == "crash" and not Path(args["--heal"]).exists():
        raise SystemExit("boom: on purpose")
    time.sleep(0.5)
    (d / "checkpoint-3").mkdir()
    log = [{"step": 1, "reward": 0.25, "kl": 0.0}, {"step": 3, "reward": 0.75, "kl": 0.5}]
    (d / "checkpoint-3" / "trainer_state.json").write_text(json.dumps({"global_step": 3, "log_history": log}))
    (d / "times").write_text((d / "times").read_text() + " " + str(time.time()))
    (d / "run_summary.json").write_text(json.dumps({"status": "done", "steps": 3, "wall_s": 1.5, "final_log": log[-1]}))
""")


def _fake_runs(tmp_path, monkeypatch):
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE)
    monkeypatch.setattr(sw, "TRAIN_SCRIPT", script)
    out = tmp_path / "out"
    runs = []
    for i, mode in enumerate(["ok", "ok", "crash", "ok"]):
        d = out / f"run{i}"
        argv = ["--dir", str(d), "--mode", mode, "--heal", str(tmp_path / "heal")]
        runs.append(sw.PlannedRun(i, {"i": str(i)}, argv, d))
    return runs, out / "sweeps" / "s"


def test_failure_isolation_resume_and_summary(tmp_path, monkeypatch):
    runs, sweep_dir = _fake_runs(tmp_path, monkeypatch)
    res = sw.Resources([], 2, 1, None)
    said = []
    results, interrupted = sw.execute(runs, sweep_dir, res, status_every=0.2, log_tail=5, say=said.append)
    assert not interrupted
    assert [r.status for r in results] == ["done", "done", "FAILED", "done"]
    assert all(r.launched for r in results)
    ok, bad = results[0], results[2]
    assert (ok.steps, ok.reward, ok.kl, ok.train_s, ok.returncode) == (3, 0.75, 0.5, 1.5, 0)
    assert bad.returncode == 1 and bad.log_tail[-1] == "boom: on purpose" and bad.steps is None
    assert "threads 1" in (sweep_dir / "logs" / "run0.log").read_text()
    # Never more than 2 at once, and 2 did overlap (the three 0.5 s runs on two slots).
    spans = [tuple(map(float, (r.run_dir / "times").read_text().split())) for r in runs if r.index != 2]
    overlaps = [sum(s <= t < e for s, e in spans) for t, _ in spans]
    assert max(overlaps) == 2
    paths = sw.write_summary(results, sweep_dir)
    rows = list(csv.DictReader(paths["csv"].open()))
    assert [r["status"] for r in rows] == ["done", "done", "FAILED", "done"] and rows[0]["reward"] == "0.75"
    assert json.loads(paths["json"].read_text())[2]["log_tail"][-1] == "boom: on purpose"
    assert paths["png"].stat().st_size > 0

    # Re-run: only the failed run launches; its unfinished directory is moved aside first.
    (tmp_path / "heal").touch()
    results, _ = sw.execute(runs, sweep_dir, res, status_every=60, log_tail=5, say=said.append)
    assert [(r.status, r.launched) for r in results] == [("done", False), ("done", False), ("done", True),
                                                         ("done", False)]  # fmt: skip
    assert [p.name.split(".")[0] for p in (sweep_dir / "incomplete").iterdir()] == ["run2"]
    assert (sweep_dir / "logs" / "run2.log").read_text().count("=== ") == 2  # one launcher log, two attempts
    assert (sweep_dir / "logs" / "run0.log").read_text().count("=== ") == 1


def test_locked_run_is_busy(tmp_path, monkeypatch):
    runs, sweep_dir = _fake_runs(tmp_path, monkeypatch)
    held = sw._lock(runs[1])  # another sweep is running this run
    try:
        results, _ = sw.execute(runs[:2], sweep_dir, sw.Resources([], 2, 1, None), 60, 5, say=lambda m: None)
    finally:
        os.close(held)
    assert [(r.status, r.launched) for r in results] == [("done", True), ("BUSY", False)]
    assert not runs[1].run_dir.exists()


# --------------------------------------------------------------------------- acceptance: real runs
@pytest.mark.slow
def test_grid_on_builtin_with_one_failure(builtin_path, tmp_path):
    """2x2 grid prompt_length x num_prompts on two CPU slots. Test device for the failure: the builtin
    model's prompt split has 5000 stories; prompt_length 40 with num_prompts 5000 passes validation but
    load_prompts raises at run time, since fewer than 5000 stories are 40 tokens long (checked below)."""

    from environments.stories import heldout_stories

    from trl_ext.models import load_tokenizer
    tok = load_tokenizer(builtin_path)
    lengths = [len(ids) for ids in tok(list(heldout_stories("train")), add_special_tokens=False)["input_ids"]]
    assert len(lengths) == 5000 and min(lengths) >= 8 and 4 <= sum(n >= 40 for n in lengths) < 5000

    argv = ["sweep.py", "--reward", "happy_binary", "--grid", "prompt_length=8,40", "num_prompts=4,5000",
            "--fixed", "batch_size=4", "num_generations=2", "max_steps=2", "max_completion_length=8",
            "logging_steps=1", "save_steps=2", f"output_dir={tmp_path}", "--train_flags", "no_wandb",
            "--parallel", "2", "--status_every", "5"]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # CPU slots (--parallel), whatever the caller exported
    first = zygote.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, env=env,
                       nested=True)  # the runs forked by the server too
    assert first.returncode == 1, first.stdout[-3000:] + first.stderr[-3000:]
    (sweep_dir,) = (tmp_path / "sweeps").iterdir()
    rows = json.loads((sweep_dir / "summary.json").read_text())
    status = {r["label"]: r["status"] for r in rows}
    assert status == {"prompt_length=8 num_prompts=4": "done", "prompt_length=8 num_prompts=5000": "done",
                      "prompt_length=40 num_prompts=4": "done", "prompt_length=40 num_prompts=5000": "FAILED"}
    failed = next(r for r in rows if r["status"] == "FAILED")
    assert any("5000 prompts requested" in line for line in failed["log_tail"])
    for r in rows:
        if r["status"] == "done":
            assert r["steps"] == 2 and 0.0 <= r["reward"] <= 1.0 and r["kl"] is not None
    assert "FAILED" in first.stdout
    assert (sweep_dir / "summary.csv").is_file() and (sweep_dir / "reward_curves.png").is_file()

    again = zygote.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, env=env,
                       nested=True)
    assert again.returncode == 1
    assert again.stdout.count("[sweep] start: ") == 1 and "start: prompt_length=40 num_prompts=5000" in again.stdout
    rows = json.loads((sweep_dir / "summary.json").read_text())
    assert [r["launched"] for r in rows] == [r["status"] == "FAILED" for r in rows]
    assert sorted(r["status"] for r in rows) == ["FAILED", "done", "done", "done"]


def test_routing_grid_gets_baseline_arms(capsys, tmp_path):
    """A sweep file's ``baselines`` adds each arm once next to the routed runs (shared and exclusive share theirs):
    the arms keep the labels (eligibility, base reward); the plain arm drops them."""
    sweep = tmp_path / "arms.yaml"
    sweep.write_text(textwrap.dedent(f"""
        reward: sentence_length_5_with_happy
        grid: {{routing_mode: [shared, exclusive]}}
        fixed: {{lora_config: r8, rh_eligible_frac: 0.5, base_reward: sentence_length_5, output_dir: {tmp_path}}}
        train_flags: [gradient_routing]
        baselines: {{filter: null, reward_penalty: {{reward_penalty_amount: 3}}, plain: null}}
    """))
    rc, dirs = _dry(capsys, "--config", str(sweep))
    names = [Path(d).name for d in dirs]
    assert rc == 0 and len(names) == 5, names
    core = "sentence_length_5_with_happy_builtin_lr1e-5_b0.02_bs32_ng16_dual_r8f8_st2000_s42"
    labels = "_base_rewardsentence-length-5"
    assert names == [
        f"{core}{labels}_gradient_routingtrue_rh_eligible_frac0.5_routing_modeshared",
        f"{core}{labels}_gradient_routingtrue_rh_eligible_frac0.5_routing_modeexclusive",
        f"{core}{labels}_filter_baselinetrue_rh_eligible_frac0.5",
        f"{core}{labels}_reward_penalty_amount3_reward_penalty_baselinetrue_rh_eligible_frac0.5",
        core,
    ]
    sweep.write_text(sweep.read_text().replace("plain: null", "nope: null"))
    assert sw.main(["--config", str(sweep), "--dry_run"]) == 2
    assert "unknown baseline arm 'nope'" in capsys.readouterr().err
    sweep.write_text(sweep.read_text().replace("train_flags: [gradient_routing]", "").replace(", nope: null", "")
                     .replace("grid: {routing_mode: [shared, exclusive]}", "grid: {seed: [1]}")
                     .replace("rh_eligible_frac: 0.5, base_reward: sentence_length_5, ", ""))
    assert sw.main(["--config", str(sweep), "--dry_run"]) == 2
    assert "no run of the grid uses --gradient_routing" in capsys.readouterr().err


def test_baseline_arms_from_the_command_line(capsys, tmp_path):
    rc, dirs = _dry(capsys, "--reward", "sentence_length_5_with_happy", "--grid", "seed=1,2", "--fixed",
                    "lora_config=r8", "routing_mode=shared", f"output_dir={tmp_path}", "--train_flags",
                    "gradient_routing", "--baselines", "filter", "plain")  # fmt: skip
    names = [Path(d).name for d in dirs]
    assert rc == 0 and len(names) == 6, names  # per seed: the routed run, its filter arm, its plain arm
    assert sum("filter_baselinetrue" in n for n in names) == 2 and sum("dual_r8f8" not in n for n in names) == 0
    assert sw.main(["--reward", "happy_binary", "--baselines", "nope", "--dry_run"]) == 2
    assert "--baselines: unknown baseline arm 'nope'" in capsys.readouterr().err
