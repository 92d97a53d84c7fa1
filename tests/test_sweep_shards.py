"""sweep.py beyond one machine: --shard K/N slices (a partition of the plan, stable order, malformed values exit 2,
the Slurm job-array form), shard summaries and their merge (--summarize), and --procs_per_run N (torchrun command,
resources, plan-time refusal and _procsN names as train.py gives them, and a real 2-run grid of 2-process runs)."""

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import zygote

import trl_ext.sweep as sw
from trl_ext.launch import processes
from trl_ext.registry import ConfigError
from trl_ext.sweep_plan import parse_shard, shard_runs

ROOT = Path(__file__).resolve().parents[1]
GRID = ["--reward", "happy_binary", "--grid", "seed=1,2,3", "beta=0.01,0.02,0.03", "--fixed", "max_steps=2"]


def _plan(tmp_path, *extra, procs=1):
    args = sw.SweepArgs(reward="happy_binary", grid=["seed=1,2,3", "beta=0.01,0.02,0.03"],
                        fixed=["max_steps=2", f"output_dir={tmp_path}", *extra])  # fmt: skip
    return sw.plan_runs(sw.build_spec(args), procs)


def test_shards_partition_the_plan_in_its_order(tmp_path):
    runs = _plan(tmp_path)
    again = _plan(tmp_path)
    assert [r.name for r in runs] == [r.name for r in again]  # the same command plans the same order
    # The grid's order: flags as given, the last one varying fastest.
    assert [(r.values["seed"], r.values["beta"]) for r in runs[:4]] == [("1", "0.01"), ("1", "0.02"), ("1", "0.03"),
                                                                       ("2", "0.01")]  # fmt: skip
    for n in (1, 2, 3, 4, 9, 11):
        shards = [shard_runs(runs, k, n) for k in range(1, n + 1)]
        names = [r.name for s in shards for r in s]
        assert sorted(names) == sorted(r.name for r in runs) and len(set(names)) == len(runs)  # exactly one shard
        assert all([r.index for r in s] == sorted(r.index for r in s) for s in shards)  # plan order kept
        assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert [r.index for r in shard_runs(runs, 2, 4)] == [1, 5]


@pytest.mark.parametrize("text", ["0/2", "3/2", "a/b", "1/0", "2", "1/2/3", "", "-1/2", " 1/2", "1/ 2", "1.0/2"])
def test_malformed_shard_exits_2(capsys, monkeypatch, text):
    monkeypatch.setattr(sw, "plan_runs", lambda *a, **k: pytest.fail("planned despite a bad --shard"))
    assert sw.main([*GRID, f"--shard={text}", "--dry_run"]) == 2  # "=": argparse takes "-1/2" as a value
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("sweep.py: error: --shard expects K/N with 1 <= K <= N"), err


def test_shard_from_a_slurm_job_array():
    def env(task, lo, hi, count, step=None):
        e = {"SLURM_ARRAY_TASK_ID": str(task), "SLURM_ARRAY_TASK_MIN": str(lo), "SLURM_ARRAY_TASK_MAX": str(hi),
             "SLURM_ARRAY_TASK_COUNT": str(count)}  # fmt: skip
        return e | ({"SLURM_ARRAY_TASK_STEP": str(step)} if step else {})

    assert parse_shard("env", env(2, 0, 3, 4)) == (3, 4)  # --array=0-3
    assert parse_shard("env", env(1, 1, 4, 4)) == (1, 4)  # --array=1-4
    assert parse_shard("env", env(6, 0, 6, 4, step=2)) == (4, 4)  # --array=0-6:2
    assert parse_shard("3/5", {}) == (3, 5)
    with pytest.raises(ConfigError, match="a job array that is a range"):
        parse_shard("env", env(5, 1, 6, 3))  # --array=1,5,6
    with pytest.raises(ConfigError, match="SLURM_ARRAY_TASK_ID, SLURM_ARRAY_TASK_MIN.* is not set"):
        parse_shard("env", {"SLURM_ARRAY_TASK_COUNT": "4"})


def test_dry_run_shows_the_slice(capsys, tmp_path):
    assert sw.main([*GRID, f"output_dir={tmp_path}", "--shard", "2/4", "--dry_run"]) == 0
    out = capsys.readouterr().out
    assert "sweep: 9 run(s); shard 2/4: 2 of them" in out
    shown = [line.split(":")[0] for line in out.splitlines() if line.startswith("run ")]
    assert shown == ["run 2/9", "run 6/9"]
    assert list(tmp_path.iterdir()) == []
    # Every shard names the same sweep directory (the whole grid's).
    dirs = set()
    for k in (1, 2, 3):
        sw.main([*GRID, f"output_dir={tmp_path}", "--shard", f"{k}/3", "--dry_run"])
        dirs |= {line for line in capsys.readouterr().out.splitlines() if line.startswith("sweep dir:")}
    assert len(dirs) == 1


# --------------------------------------------------------------------------- shard summaries and their merge
FAKE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
    d = Path(args["--dir"])
    d.mkdir(parents=True)
    if args["--mode"] == "crash" and not Path(args["--heal"]).exists():
        raise SystemExit("boom: on purpose")
    log = [{"step": 2, "reward": float(args["--reward"]), "kl": 0.5}]
    (d / "run_summary.json").write_text(json.dumps({"status": "done", "steps": 2, "wall_s": 1.0, "final_log": log[-1]}))
""")


def test_shards_write_their_own_files_and_summarize_merges(tmp_path, monkeypatch):
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE)
    monkeypatch.setattr(sw, "TRAIN_SCRIPT", script)
    out, heal = tmp_path / "out", tmp_path / "heal"
    runs = [sw.PlannedRun(i, {"i": str(i)}, ["--dir", str(out / f"run{i}"), "--mode", "crash" if i == 1 else "ok",
                                             "--heal", str(heal), "--reward", str(i / 10)], out / f"run{i}")
            for i in range(5)]  # fmt: skip
    sweep_dir = out / "sweeps" / "s"
    res = sw.Resources([], 2, 1, None)
    for k in (1, 2):  # shards 1/3 and 2/3 ran (two machines, one filesystem); shard 3/3 has not started
        results, _ = sw.execute(shard_runs(runs, k, 3), sweep_dir, res, 60, 5, say=lambda m: None, shard=(k, 3))
        sw.write_summary(results, sweep_dir, shard=(k, 3))
    assert sorted(p.name for p in sweep_dir.glob("summary*")) == [
        "summary.shard1of3.csv", "summary.shard1of3.json", "summary.shard2of3.csv", "summary.shard2of3.json"]
    (out / "run2").mkdir()  # shard 3/3 started run 2 and has written no summary yet
    merged = sw.merge_results(runs, sweep_dir)
    assert [(r.name, r.status, r.shard) for r in merged] == [
        ("run0", "done", "1/3"), ("run1", "FAILED", "2/3"), ("run2", "UNFINISHED", None), ("run3", "done", "1/3"),
        ("run4", "done", "2/3")]  # fmt: skip
    assert merged[1].log_tail[-1] == "boom: on purpose" and merged[4].reward == 0.4 and merged[3].steps == 2

    # Shard 2/3 runs again (its failed run is fixed) and the run of shard 3/3 finishes outside any summary.
    heal.touch()
    results, _ = sw.execute(shard_runs(runs, 2, 3), sweep_dir, res, 60, 5, say=lambda m: None, shard=(2, 3))
    sw.write_summary(results, sweep_dir, shard=(2, 3))
    (out / "run2" / "run_summary.json").write_text(
        json.dumps({"status": "done", "steps": 2, "wall_s": 1.0, "final_log": {"reward": 0.2, "kl": 0.0}}))
    merged = sw.merge_results(runs, sweep_dir)
    assert [r.status for r in merged] == ["done"] * 5 and merged[2].reward == 0.2
    paths = sw.write_summary(merged, sweep_dir)
    assert paths["json"].name == "summary.json" and len(json.loads(paths["json"].read_text())) == 5


def test_summarize_command(capsys, tmp_path):
    argv = ["--reward", "happy_binary", "--grid", "seed=1,2", "--fixed", "max_steps=2", f"output_dir={tmp_path}"]
    assert sw.main([*argv, "--summarize"]) == 2
    assert "no sweep directory" in capsys.readouterr().err
    assert sw.main([*argv, "--dry_run"]) == 0
    out = capsys.readouterr().out
    sweep_dir = Path(out.split("sweep dir: ")[1].split("\n")[0])
    run1 = Path(out.split("run 1/2: ")[1].split("\n")[0])
    sweep_dir.mkdir(parents=True)
    run1.mkdir()
    (run1 / "run_summary.json").write_text(
        json.dumps({"status": "done", "steps": 2, "wall_s": 1.0, "final_log": {"reward": 0.75, "kl": 0.1}}))
    assert sw.main([*argv, "--summarize"]) == 1  # run 2 has not run: not every run is done
    rows = json.loads((sweep_dir / "summary.json").read_text())
    assert [(r["status"], r["reward"]) for r in rows] == [("done", 0.75), ("NOT_STARTED", None)]
    assert (sweep_dir / "summary.csv").is_file()
    capsys.readouterr()
    assert sw.main([*argv, "--summarize", "--shard", "1/2"]) == 2
    assert "--summarize merges every shard's runs" in capsys.readouterr().err


# --------------------------------------------------------------------------- several processes per run
def test_train_command():
    py, script = sys.executable, str(sw.TRAIN_SCRIPT)
    assert sw.train_command(["--seed", "1"]) == [py, script, "--seed", "1"]
    assert sw.train_command(["--seed", "1"], 2, 29555) == [
        py, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29555", script, "--seed", "1"]
    with pytest.raises(ValueError, match="--master_port"):
        sw.train_command([], 2)
    port = sw.free_port(set())
    assert 1024 <= port < 65536 and sw.free_port({port}) != port


def test_resources_count_processes():
    cpu = {"CUDA_VISIBLE_DEVICES": ""}
    res = sw.resolve_resources(sw.SweepArgs(procs_per_run=2), cpu, cpus=4)
    assert (res.per_slot, res.threads, res.capacity, res.devices) == (2, 1, 2, ["cpu"])  # 2 runs x 2 processes
    assert sw.resolve_resources(sw.SweepArgs(procs_per_run=2, parallel=1), cpu, cpus=4).threads == 2
    assert sw.resolve_resources(sw.SweepArgs(procs_per_run=4), cpu, cpus=2).per_slot == 1
    assert "2 processes per run (torchrun), 1 torch thread(s) per process" in res.describe()
    gpu = sw.resolve_resources(sw.SweepArgs(procs_per_run=2), {"CUDA_VISIBLE_DEVICES": "0,1,2"}, cpus=8)
    assert (gpu.devices, gpu.capacity, gpu.threads) == (["0,1"], 1, 4) and "1 GPU(s) idle" in gpu.describe()
    four = sw.resolve_resources(sw.SweepArgs(procs_per_run=2, per_gpu=2), {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 8)
    slots = sw.Slots(four)
    assert [slots.acquire() for _ in range(5)] == ["0,1", "2,3", "0,1", "2,3", None]
    assert sw.child_env({}, four, "2,3")["CUDA_VISIBLE_DEVICES"] == "2,3"
    with pytest.raises(ConfigError, match="--procs_per_run 2 gives each run 2 GPUs .*1 visible"):
        sw.resolve_resources(sw.SweepArgs(procs_per_run=2), {"CUDA_VISIBLE_DEVICES": "0"}, cpus=8)
    with pytest.raises(ConfigError, match="--procs_per_run must be >= 1"):
        sw.resolve_resources(sw.SweepArgs(procs_per_run=0), cpu, cpus=8)


def test_multi_process_plan_names_and_restores(tmp_path):
    one, two = _plan(tmp_path), _plan(tmp_path, procs=2)
    assert [r.name + "_procs2" for r in one] == [r.name for r in two]
    assert processes.launched_processes({}) == (1, None)  # the planning patch is gone
    with pytest.raises(ConfigError, match=r"--rebuild_builtin: rebuilding the builtin model \(every process would "
                                          r"rebuild it\) runs on one process for now; this launch has 2 processes "
                                          r"\(--procs_per_run=2\)"):
        _plan(tmp_path, "rebuild_builtin=true", procs=2)
    assert processes.launched_processes({}) == (1, None)
    assert len(_plan(tmp_path, "rebuild_builtin=true")) == 9  # allowed on one process
    assert sw.resumable(1) and sw.resumable(2) == all(f != "resume_from_checkpoint" for f, *_ in processes.CFG_FLAGS)


def test_refused_multi_process_grid_exits_2_before_any_run(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(sw, "execute", lambda *a, **k: pytest.fail("launched despite a refused run"))
    argv = ["--reward", "happy_binary", "--grid", "rebuild_builtin=false,true", "--fixed", f"output_dir={tmp_path}"]
    assert sw.main([*argv, "--procs_per_run", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sweep.py: error: run 2 (rebuild_builtin=true): --rebuild_builtin: rebuilding the builtin "
                          "model (every process would rebuild it) runs on one process for now; this launch has 2 "
                          "processes (--procs_per_run=2)"), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_two_process_runs_end_to_end(builtin_path, tmp_path):
    """A 2-run grid, each run 2 CPU processes under torchrun: both finish into the _procs2 directories the sweep
    planned (so resume/skip find them), with one train.log naming 2 processes; a second sweep skips both."""
    argv = ["sweep.py", "--reward", "happy_binary", "--grid", "seed=1,2", "--fixed", "max_steps=2", "batch_size=4",
            "num_generations=2", "max_completion_length=8", f"output_dir={tmp_path}", "--train_flags", "no_wandb",
            "--procs_per_run", "2", "--status_every", "10"]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    first = zygote.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, env=env,
                       nested=True)  # the runs forked by the server too
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    (sweep_dir,) = (tmp_path / "sweeps").iterdir()
    rows = json.loads((sweep_dir / "summary.json").read_text())
    assert [r["status"] for r in rows] == ["done", "done"] and all(r["steps"] == 2 for r in rows)
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.endswith("_procs2"))
    assert names == sorted(r["name"] for r in rows) and len(names) == 2
    for name in names:
        assert json.loads((tmp_path / name / "run_summary.json").read_text())["status"] == "done"
        assert "processes: 2 (gloo backend, DDP)" in (tmp_path / name / "train.log").read_text()
        assert "torch.distributed.run --nproc_per_node 2 --master_port" in (sweep_dir / "logs" / f"{name}.log").read_text()
    again = zygote.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, env=env,
                       nested=True)
    assert again.returncode == 0 and again.stdout.count("skip (done earlier)") == 2 and "[sweep] start" not in again.stdout


def test_multi_process_plan_counts_the_processes_in_trls_batch_checks(tmp_path):
    """8 completions per process x 2 processes = 16 = one group: what torchrun runs, the plan accepts; the same batch
    on one process is TRL's refusal; the patched world size is gone afterwards."""
    from trl_ext.config import ExtGRPOConfig

    args = sw.SweepArgs(reward="happy_binary", grid=["seed=1"], fixed=["batch_size=8", f"output_dir={tmp_path}"])
    assert len(sw.plan_runs(sw.build_spec(args), 2)) == 1
    with pytest.raises(ConfigError, match="divisible by num_generations"):
        sw.plan_runs(sw.build_spec(args), 1)
    assert "world_size" not in vars(ExtGRPOConfig)
