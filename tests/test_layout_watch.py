"""layout.py's watcher (`trl_ext.serve.watch.run_layout`) on stand-in parts: a tiny HTTP server that answers
``/health`` (and dies on cue) for a vLLM server, and a script for the trainer. What a restart does is decided here:
which part is started again, with which command, how often, and when the run stops instead (docs/layout.md, Faults).
The same watcher over real vLLM servers and train.py: tests/test_serve_vllm.py and bench/layout_soak.py."""

from __future__ import annotations

import json
import socket
import sys
import textwrap
from pathlib import Path

import pytest

from trl_ext.registry import ConfigError
from trl_ext.runs.restarts import read_restarts
from trl_ext.serve.plan import Layout, LayoutArgs, ServerSpec
from trl_ext.serve.watch import resumed_flags, run_layout

SERVER = textwrap.dedent('''
    import http.server, os, sys, threading, time
    port, starts, deaths = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    import subprocess
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # vLLM's engine process
    with open(starts, "a") as f:
        f.write(f"{os.getpid()}:{engine.pid}\\n")
    n = len(open(starts).read().split())

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    if n <= deaths:  # the first `deaths` starts die 3 s after they start answering
        threading.Timer(3.0, lambda: os._exit(9)).start()
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
''')

TRAINER = textwrap.dedent('''
    import json, os, sys, time, urllib.request
    calls, plan, run_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    with open(calls, "a") as f:
        f.write(json.dumps(sys.argv[4:]) + "\\n")
    n = len(open(calls).read().splitlines())
    act = json.load(open(plan))[n - 1]
    if "wait_starts" in act:  # wait until the server has started this often and answers
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if len(open(act["starts"]).read().split()) >= act["wait_starts"]:
                    urllib.request.urlopen(act["url"] + "/health", timeout=1)
                    break
            except OSError:
                pass
            time.sleep(0.2)
        else:
            sys.exit(1)
    if act.get("wait_s"):
        time.sleep(act["wait_s"])
    if act.get("checkpoint"):
        ckpt = os.path.join(run_dir, f"checkpoint-{act['checkpoint']}")
        os.makedirs(ckpt, exist_ok=True)
        open(os.path.join(ckpt, "checkpoint_complete.json"), "w").write("{}")
    if act.get("summary"):
        open(os.path.join(run_dir, "run_summary.json"), "w").write(json.dumps({"status": act["summary"]}))
    sys.exit(act["exit"])
''')


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _layout(tmp_path: Path, plan: list[dict], deaths: int = 0, flags=("--max_steps", "4")):
    """A layout of one stand-in server (its first ``deaths`` starts die) and a stand-in trainer acting on ``plan``
    (one action per start); returns (layout, run_dir, calls file, starts file)."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "server.py").write_text(SERVER)
    (tmp_path / "trainer.py").write_text(TRAINER)
    port, run_dir = _port(), tmp_path / "run"
    run_dir.mkdir()
    starts, calls = tmp_path / "starts.txt", tmp_path / "calls.jsonl"
    url = f"http://127.0.0.1:{port}"
    for act in plan:
        act.setdefault("url", url)
        act.setdefault("starts", str(starts))
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    spec = ServerSpec("policy", 0, "stand-in", port, [0], url=url,
                      command=[sys.executable, str(tmp_path / "server.py"), str(port), str(starts), str(deaths)],
                      env=None)  # fmt: skip
    flags = list(flags)
    trainer = [sys.executable, str(tmp_path / "trainer.py"), str(calls), str(tmp_path / "plan.json"), str(run_dir),
               *flags]  # fmt: skip
    layout = Layout([spec], trainer, [0], str(tmp_path / "weights"), False, tmp_path / "logs", False, flags)
    return layout, run_dir, calls, starts


def _run(layout, run_dir, refuse: bool = False, **args) -> tuple[int, list[str], list]:
    """run_layout's exit code, what it said, and the flags of each resumed command it checked (``refuse``: the
    check raises, as train.py's would for a resume it refuses)."""
    said, checked = [], []

    def check(resumed):
        checked.append(resumed.flags)
        if refuse:
            raise ConfigError("the resumed run's start weights differ")
        return run_dir

    code = run_layout(layout, LayoutArgs(server_timeout=30, **args), run_dir, say=said.append, check=check)
    return code, said, checked


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by init, counts as dead)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _calls(calls: Path) -> list[list[str]]:
    return [json.loads(line) for line in calls.read_text().splitlines()]


def test_a_server_that_dies_during_training_is_restarted_on_its_port_and_the_run_goes_on(tmp_path):
    """The server dies once, 3 s after it first answered: the watcher starts the same command again (its second
    start), the trainer sees it answer on the same URL and finishes: exit 0, the restart said, in train.log and in
    restarts.jsonl. With restarts off (--max_server_restarts 0) the same death stops the run (exit 1)."""
    plan = [{"wait_starts": 2, "wait_s": 2.5, "exit": 0}]  # the watcher sees it healthy again
    layout, run_dir, calls, starts = _layout(tmp_path, plan, deaths=1)
    code, said, _ = _run(layout, run_dir, max_server_restarts=2)
    assert code == 0, said
    assert len(starts.read_text().split()) == 2
    (event,) = read_restarts(run_dir)
    assert event["part"] == f"policy server {layout.servers[0].url}" and event["restart"] == 1 and event["of"] == 2
    assert "exited with code 9 during training" in event["why"]
    assert "restarted the policy server" in (run_dir / "train.log").read_text()
    assert any("healthy again" in line for line in said) and any("restarting it (1 of 2" in line for line in said)
    assert "restart 1 of 2 =====" in (tmp_path / "logs" / f"policy0-{layout.servers[0].port}.log").read_text()
    first_engine = int(starts.read_text().split()[0].split(":")[1])
    assert not _alive(first_engine)  # the dead server's engine process was stopped before the restart

    layout, run_dir, calls, starts = _layout(tmp_path / "off", [{"wait_starts": 2, "exit": 0}], deaths=1)
    code, said, _ = _run(layout, run_dir, max_server_restarts=0)
    assert code == 1 and len(starts.read_text().split()) == 1 and read_restarts(run_dir) == []
    assert any("exited with code 9 during training" in line for line in said), said


def test_a_server_that_dies_more_often_than_allowed_stops_the_run(tmp_path):
    """Two deaths, one restart allowed: the second death stops the run as without restarts (exit 1, naming the
    server and the spent bound), the trainer stopped too."""
    layout, run_dir, calls, starts = _layout(tmp_path, [{"wait_starts": 9, "exit": 0}], deaths=2)
    (tmp_path / "run" / "checkpoint-2").mkdir()
    code, said, _ = _run(layout, run_dir, max_server_restarts=1)
    assert code == 1, said
    assert len(starts.read_text().split()) == 2 and len(read_restarts(run_dir)) == 1
    assert any("restart(s), --max_server_restarts, are spent" in line and "stopping the trainer" in line
               for line in said), said  # fmt: skip


def test_a_crashed_trainer_is_restarted_from_its_last_checkpoint(tmp_path):
    """The trainer crashes (exit 1) after checkpoint 2: the watcher checks the resumed command (train.py's checks)
    and starts it with --resume_from_checkpoint latest (the user's --overwrite_run and resume path dropped); the
    second start finishes (exit 0). The server is not restarted."""
    plan = [{"checkpoint": 2, "exit": 1}, {"checkpoint": 4, "exit": 0}]
    flags = ("--max_steps", "4", "--overwrite_run", "--resume_from_checkpoint", "/old/checkpoint-1")
    layout, run_dir, calls, starts = _layout(tmp_path, plan, flags=flags)
    code, said, checked = _run(layout, run_dir, max_trainer_restarts=1)
    assert code == 0, said
    first, second = _calls(calls)
    assert first == list(flags) and second == ["--max_steps", "4", "--resume_from_checkpoint", "latest"]
    assert checked == [second]
    (event,) = read_restarts(run_dir)
    assert event["part"] == "trainer" and "exited with code 1; resumed from checkpoint-2" in event["why"]
    assert len(starts.read_text().split()) == 1


def test_with_pushed_versions_the_policy_servers_restart_with_the_trainer(tmp_path):
    """Versions pushed (--vllm_weight_transfer gloo|nccl): a dead trainer may have left a push open, and a server
    holds no version across a restart anyway, so the policy servers start again with the trainer (a second start);
    with checkpoint files they are left running (`test_a_crashed_trainer_is_restarted_from_its_last_checkpoint`)."""
    plan = [{"checkpoint": 2, "exit": 1}, {"wait_starts": 2, "checkpoint": 4, "exit": 0}]
    layout, run_dir, calls, starts = _layout(tmp_path, plan)
    layout.pushed = True
    code, said, _ = _run(layout, run_dir, max_trainer_restarts=1)
    assert code == 0, said
    assert len(starts.read_text().split()) == 2 and len(_calls(calls)) == 2
    assert any("restarting the policy server" in line and "with the trainer" in line for line in said), said


@pytest.mark.parametrize("case", ["bound", "numeric_fault", "config_error", "no_checkpoint", "refused"])
def test_a_trainer_exit_that_a_restart_would_not_mend_stops_the_run(tmp_path, case):
    """Not restarted: past --max_trainer_restarts; a diverged run (run_summary.json: numeric_fault) or a
    configuration error (config_error) written by this start; a run without a complete checkpoint; a resumed
    command that train.py's checks refuse (exit 2). Each stops the run with the trainer's code (2 for the refusal)
    and says why."""
    first = {"checkpoint": 2, "exit": 1}
    if case in ("numeric_fault", "config_error"):
        first["summary"] = case
    if case == "no_checkpoint":
        del first["checkpoint"]
    plan = [first, {"checkpoint": 2, "exit": 1}, {"exit": 0}]
    layout, run_dir, calls, _ = _layout(tmp_path, plan)
    code, said, checked = _run(layout, run_dir, max_trainer_restarts=1 if case == "bound" else 3,
                               refuse=case == "refused")  # fmt: skip
    starts = len(_calls(calls))
    if case == "bound":
        assert code == 1 and starts == 2 and len(read_restarts(run_dir)) == 1
        assert any("--max_trainer_restarts 1 reached" in line for line in said), said
        return
    assert starts == 1 and read_restarts(run_dir) == [], said
    if case == "refused":
        assert code == 2 and checked and any("refuses the resumed run" in line for line in said), said
        return
    assert code == 1 and not checked
    why = {"numeric_fault": "run_summary.json: numeric_fault", "config_error": "run_summary.json: config_error",
           "no_checkpoint": "no complete checkpoint"}[case]  # fmt: skip
    assert any(why in line for line in said), said


def test_a_summary_left_by_an_earlier_start_does_not_stop_a_restart(tmp_path):
    """A numeric_fault summary written before this trainer started (an earlier attempt's) is not this exit's
    reason: the crash is restarted."""
    plan = [{"wait_s": 1.5, "checkpoint": 2, "exit": 1}, {"exit": 0}]
    layout, run_dir, calls, _ = _layout(tmp_path, plan)
    (run_dir / "run_summary.json").write_text(json.dumps({"status": "numeric_fault"}))
    code, said, _ = _run(layout, run_dir, max_trainer_restarts=1)
    assert code == 0 and len(_calls(calls)) == 2, said


def test_resumed_flags():
    assert resumed_flags(["--a", "1", "--resume_from_checkpoint=x", "--overwrite_run", "--b"]) == \
        ["--a", "1", "--b", "--resume_from_checkpoint", "latest"]  # fmt: skip


def test_restart_bounds_are_flags_checked_at_parse_time():
    with pytest.raises(ConfigError, match="--max_server_restarts must be >= 0"):
        LayoutArgs(max_server_restarts=-1)
    with pytest.raises(ConfigError, match="--max_trainer_restarts must be >= 0"):
        LayoutArgs(max_trainer_restarts=-1)

