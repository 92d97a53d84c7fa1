"""The sandbox an agent's code runs in (trl_ext/sandbox/): code that opens a socket, writes outside its workspace,
forks without bound, allocates past its memory, spins past its CPU time or sleeps past its wall-clock time is stopped
and reported as the tool's result; several runs go at once; no backend available is a ConfigError naming how to get
one. The bubblewrap backend runs for real (`.ci/run` installs Debian's bubblewrap); Docker only where a daemon runs."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from trl_ext.registry import ConfigError
from trl_ext.sandbox import base, bwrap, docker
from trl_ext.sandbox.base import Limits

PY = "/usr/bin/python3" if os.getuid() == 0 and Path("/usr/bin/python3").exists() else sys.executable
"""The interpreter the sandboxed code runs (as root the run is another user, who cannot read a venv under /root)."""
FAST = Limits(cpu_s=5, memory_mb=1024, processes=32, wall_s=20, output_bytes=4096)


@pytest.fixture(scope="module")
def sandbox():
    why = bwrap.unavailable()
    assert why is None, f"the bubblewrap sandbox cannot run here: {why}"  # not a skip: CI installs it
    return base.choose("bwrap")


@pytest.fixture
def tmp_path():
    """A workspace other users can reach (pytest's own tmp_path lies under a root-only directory)."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="trl_ext_sandbox_test_"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run(sandbox, tmp_path: Path, code: str, limits: Limits = FAST, script: str = "main.py"):
    (tmp_path / script).write_text(textwrap.dedent(code))
    return sandbox.run([PY, script], tmp_path, limits)


def test_the_workspace_is_writable_and_the_run_reports_its_output(sandbox, tmp_path):
    result = run(sandbox, tmp_path, "open('out.txt', 'w').write('ok'); print('done')")
    assert (result.returncode, result.stdout, result.stopped) == (0, "done\n", None)
    assert (tmp_path / "out.txt").read_text() == "ok"
    assert result.report() == "done\n[exit code 0]"


def test_no_network(sandbox, tmp_path):
    """A server listening on the host's loopback is out of reach (the sandbox has its own, empty network)."""
    import socket

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        result = run(sandbox, tmp_path, f"""
            import socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=3)
                print("connected")
            except OSError as e:
                print("refused", e.errno)
            """)
    finally:
        server.close()
    assert result.stdout.startswith("refused") and result.stopped is None, result.report()


def test_nothing_outside_the_workspace_is_writable(sandbox, tmp_path):
    import tempfile

    open_dir = Path(tempfile.mkdtemp(prefix="trl_ext_sandbox_outside_", dir="/var/tmp"))  # anyone may write there
    open_dir.chmod(0o777)
    outside = [open_dir / "sandbox_escape", Path(__file__).parent / "sandbox_escape", Path("/etc/sandbox_escape")]
    result = run(sandbox, tmp_path, f"""
        for path in {[str(p) for p in outside]!r}:
            try:
                open(path, "w").write("x")
                print("wrote", path)
            except OSError as e:
                print("denied", e.errno)
        """)
    errors = [int(line.split()[1]) for line in result.stdout.splitlines() if line.startswith("denied")]
    # EROFS (the host is read-only), EACCES, or ENOENT (a path under the host's /tmp: the sandbox's /tmp is its own)
    assert errors[0] == 30 and len(errors) == 3 and set(errors) <= {2, 13, 30}, result.report()
    assert not any(p.exists() for p in outside)
    open_dir.rmdir()


def test_forks_are_bounded_and_gone_after_the_run(sandbox, tmp_path):
    result = run(sandbox, tmp_path, """
        import os, time
        n = 0
        try:
            while n < 10000:
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
                n += 1
        except OSError as e:
            print("stopped after", n, "forks:", e.errno)
        """, script=(script := f"forks_{os.getpid()}.py"))
    forks = int(result.stdout.split()[2])
    assert result.stdout.startswith("stopped after") and forks < FAST.processes, result.report()
    time.sleep(0.5)
    alive = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p).endswith(script)]
    assert alive == []  # the sleeping children went with the sandbox's PID namespace


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def test_memory_past_the_limit_fails_the_allocation(sandbox, tmp_path):
    result = run(sandbox, tmp_path, "b = bytearray(2048 << 20)\nprint('allocated')", Limits(memory_mb=512))
    assert result.returncode != 0 and "MemoryError" in result.stderr and "allocated" not in result.stdout


def test_cpu_time_past_the_limit_stops_the_run(sandbox, tmp_path):
    result = run(sandbox, tmp_path, "while True: pass", Limits(cpu_s=1, wall_s=30))
    assert result.stopped == "CPU time limit" and result.wall_s < 10, result
    assert result.report().endswith("[stopped: CPU time limit]")


def test_wall_clock_past_the_limit_kills_the_run_and_its_children(sandbox, tmp_path):
    start, child = time.monotonic(), f"sleep {300 + os.getpid() % 1000 / 1000}"  # this test's own child
    result = run(sandbox, tmp_path, f"""
        import subprocess, time
        subprocess.Popen({child.split()!r})
        print("waiting", flush=True)
        time.sleep(300)
        """, Limits(wall_s=2))
    assert result.stopped == "wall-clock timeout" and time.monotonic() - start < 15
    assert result.stdout == "waiting\n"
    time.sleep(0.5)
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p) == child]


def test_output_is_cut_at_the_limit(sandbox, tmp_path):
    result = run(sandbox, tmp_path, "print('x' * 10000)", Limits(output_bytes=100))
    assert result.stdout.startswith("x" * 100) and "9901 more bytes cut" in result.stdout


def test_runs_go_in_parallel(sandbox, tmp_path):
    dirs = [tmp_path / f"ws{i}" for i in range(4)]
    for i, d in enumerate(dirs):
        d.mkdir()
        (d / "main.py").write_text(f"import time; time.sleep(1); open('id', 'w').write('{i}')")
    start = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda d: sandbox.run([PY, "main.py"], d, FAST), dirs))
    assert all(r.returncode == 0 for r in results) and time.monotonic() - start < 4 * 1 + 1
    assert [(d / "id").read_text() for d in dirs] == ["0", "1", "2", "3"]


def test_limits_must_be_positive():
    with pytest.raises(ConfigError, match="sandbox limit wall_s must be > 0"):
        Limits(wall_s=0)


def test_no_backend_is_a_config_error_naming_how_to_get_one(monkeypatch):
    with pytest.raises(ConfigError, match="unknown sandbox 'chroot'"):
        base.choose("chroot")
    monkeypatch.setattr(bwrap, "unavailable", lambda: bwrap.INSTALL)
    monkeypatch.setattr(docker, "unavailable", lambda: "the Docker daemon is not reachable (no socket)")
    with pytest.raises(ConfigError, match=r"no sandbox .*apt-get install bubblewrap.*Docker daemon.*never runs unsand"):
        base.choose("auto")


def test_docker_where_a_daemon_runs(tmp_path):
    why = docker.unavailable()
    if why is not None:
        with pytest.raises(ConfigError, match="docker: "):
            base.choose("docker")
        return
    result = base.choose("docker").run(["python", "-c", "print('in a container')"], tmp_path, FAST)
    assert result.stdout == "in a container\n"
