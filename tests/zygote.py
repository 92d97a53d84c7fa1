"""A fork server for the tests' script runs (`run`, `Popen`): ``python train.py ...`` (and eval_run.py, sweep.py)
started as a real process of its own, with its own pid, exit code, signals, files and environment, without paying
the import of torch, transformers and TRL at every start (4-8 s of CPU on 2 cores).

One server per test process (started on first use) imports the entry points' modules once and then only forks: it
computes nothing, so no thread or OpenMP pool exists to be lost in a fork. Each child takes the caller's working
directory, environment and standard streams (passed over a Unix socket), runs the script as ``__main__`` and exits
as the interpreter would (non-daemon threads joined, atexit handlers run). A command the server cannot start the same
way goes to `subprocess` unchanged: another program, a pipe, or an environment that differs from the server's in a
variable some module reads once at import (``HF_*``, ``CUDA_*``, ``OMP_*``, ``PYTHON*``, ...).

The server is tests/zygote_server.py, run as a script: ``python tests/zygote_server.py SOCKET``.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVER = str(Path(__file__).with_name("zygote_server.py"))
PRELOAD = ("trl_ext.cli_train", "trl_ext.launch.processes", "trl_ext.trainer", "trl_ext.evaluate", "trl_ext.sweep")
IMPORT_TIME_ENV = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "DATASETS", "TORCH_", "PYTORCH", "CUDA",
                   "NCCL", "OMP_", "MKL_", "OPENBLAS", "KMP_", "GOMP", "PYTHON", "LD_", "ACCELERATE", "VLLM",
                   "TRL_EXT_SABOTAGE", "WANDB_")
"""Variables some module may read once, when imported: a run whose environment differs from the server's in one of
them starts as a plain subprocess (wandb's are here because wandb reads its settings when set up in a process).
The thread counts (`THREADS_ENV`) are the exception: the child applies them (``torch.set_num_threads``, which sets
OpenMP's and MKL's), as the libraries would at start."""
THREADS_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
HEADER = struct.Struct("!Q")


def _sensitive(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV) and k not in THREADS_ENV}


def _threads(env: dict[str, str]) -> str | None:
    """The thread count a child applies: OMP_NUM_THREADS or MKL_NUM_THREADS (``"mixed"`` when both differ)."""
    counts = {env[k] for k in THREADS_ENV if k in env}
    return None if not counts else counts.pop() if len(counts) == 1 else "mixed"


class _Server:
    """The server process of this test process, started once."""

    lock = threading.Lock()
    instance: _Server | None = None

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="zygote-")) / "socket"
        self.env = dict(os.environ)
        self.proc = subprocess.Popen([sys.executable, SERVER, str(self.path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=self.env, cwd=ROOT)  # fmt: skip
        self.ready = False

    @classmethod
    def client(cls, path: str, env: dict[str, str]) -> _Server:
        """The server this process was forked by (a `nested` child), as its runs' server."""
        server = cls.__new__(cls)
        server.path, server.env, server.proc, server.ready = Path(path), env, None, True
        return server

    @classmethod
    def get(cls) -> _Server:
        with cls.lock:
            if cls.instance is None or (cls.instance.proc is not None and cls.instance.proc.poll() is not None):
                cls.instance = cls()
            server = cls.instance
            if not server.ready:
                line = server.proc.stdout.readline()  # the server prints "ready" once its imports are done
                assert line.strip() == b"ready", f"the fork server did not start: {line!r}"
                server.ready = True
            return server

    def accepts(self, cmd, cwd, env: dict[str, str]) -> bool:
        """``[sys.executable, script.py, ...]`` of a script of this repository, in an environment the server's
        imports agree with."""
        if len(cmd) < 2 or cmd[0] != sys.executable or not cmd[1].endswith(".py"):
            return False
        script = Path(cwd or os.getcwd(), cmd[1]).resolve()
        return (script.is_relative_to(ROOT) and script.is_file() and _sensitive(env) == _sensitive(self.env)
                and _threads(env) != "mixed")  # fmt: skip


def _fd(stream, default: int) -> tuple[int, bool]:
    """(a file descriptor for ``stream``, whether it must be closed after the send)."""
    if stream is None:
        return default, False
    if stream == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_RDWR), True
    if isinstance(stream, int):
        return stream, False
    return stream.fileno(), False


class _Handle:
    """`kill` and `terminate` of a process handle, through its ``send_signal``."""

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)


class Popen(_Handle):
    """`subprocess.Popen` for ``[sys.executable, script, *args]`` through the fork server (a plain subprocess where
    it cannot): ``stdout`` and ``stderr`` may be None, DEVNULL, a file or (stderr) STDOUT; no pipes. With ``nested``
    the script's own runs (sweep.py's train.py processes and torchrun launches) are forked by the server too
    (``zygote_server._nest``)."""

    def __init__(self, cmd, cwd=None, env=None, stdout=None, stderr=None, stdin=subprocess.DEVNULL,
                 start_new_session=False, nested=False):  # fmt: skip
        cmd = [str(c) for c in cmd]
        env = dict(os.environ if env is None else env)
        self.args, self.returncode = cmd, None
        if subprocess.PIPE in (stdout, stderr, stdin) or not _Server.get().accepts(cmd, cwd, env):
            self._proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=stdout, stderr=stderr, stdin=stdin,
                                          start_new_session=start_new_session)  # fmt: skip
            self.pid = self._proc.pid
            return
        self._proc = None
        out, close_out = _fd(stdout, 1)
        err, close_err = (out, False) if stderr == subprocess.STDOUT else _fd(stderr, 2)
        inp, close_in = _fd(stdin, 0)
        body = json.dumps({"argv": cmd[1:], "cwd": str(cwd or os.getcwd()), "env": env,
                           "new_session": start_new_session, "nested": nested}).encode()  # fmt: skip
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(str(_Server.get().path))
        socket.send_fds(self._sock, [HEADER.pack(len(body))], [inp, out, err])
        self._sock.sendall(body)
        for fd, close in ((out, close_out), (err, close_err), (inp, close_in)):
            if close:
                os.close(fd)
        self._reader = self._sock.makefile("r")
        self.pid = json.loads(self._reader.readline())["pid"]

    def poll(self):
        if self._proc is not None:
            self.returncode = self._proc.poll()
        elif self.returncode is None:
            self._read_status(0)
        return self.returncode

    def wait(self, timeout=None):
        if self._proc is not None:
            self.returncode = self._proc.wait(timeout)
        elif self.returncode is None and not self._read_status(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def _read_status(self, timeout) -> bool:
        """Read the exit status the server sends when the child ends (waiting up to ``timeout``); whether it came."""
        import select

        if not select.select([self._sock], [], [], timeout)[0]:
            return False
        self.returncode = json.loads(self._reader.readline())["returncode"]
        self._reader.close()
        self._sock.close()
        return True

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


def run(cmd, cwd=None, env=None, capture_output=False, text=False, timeout=None, check=False, stdout=None,
        stderr=None, nested=False) -> subprocess.CompletedProcess:  # fmt: skip
    """`subprocess.run` for ``[sys.executable, script, *args]`` through the fork server (see `Popen`)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        if capture_output:
            stdout, stderr = out, err
        proc = Popen(cmd, cwd=cwd, env=env, stdout=stdout, stderr=stderr, nested=nested)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        captured = []
        for f in (out, err):
            f.seek(0)
            data = f.read()
            captured.append(data.decode(errors="replace") if text else data)
    result = subprocess.CompletedProcess(proc.args, code, *(captured if capture_output else (None, None)))
    if check:
        result.check_returncode()
    return result


class Ranks(_Handle):
    """``torchrun --nproc_per_node N script args`` on this machine as the test of a feature sees it, as a `Popen`-like
    handle: each rank forked by the server with the environment torchrun's static rendezvous gives its workers (RANK,
    LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_*, OMP_NUM_THREADS=1); when a rank fails the others are
    stopped and its exit code is the launch's, and a signal to the launch goes to every rank, as torchrun's agent
    does. Tests of the launcher itself (its failure handling, signals) run the real torchrun
    (`trl_ext.launch.command.torchrun_command`)."""

    def __init__(self, script_and_args, nproc: int = 2, cwd=None, env=None, stdout=None, stderr=None,
                 port: int | None = None) -> None:  # fmt: skip
        from trl_ext.launch.command import free_port

        self.args, self.returncode = [str(a) for a in script_and_args], None
        base, port = dict(os.environ if env is None else env), str(port or free_port())
        base.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several processes
        self.ranks = []
        for rank in range(nproc):
            rank_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                        "ROLE_NAME": "default", "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                        "ROLE_WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": port, "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                        "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "False"}  # fmt: skip
            self.ranks.append(Popen([sys.executable, *self.args], cwd=cwd, env=rank_env, stdout=stdout,
                                    stderr=stderr))  # fmt: skip
        self.pid = self.ranks[0].pid

    def poll(self):
        if self.returncode is None:
            codes = [r.poll() for r in self.ranks]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:  # stop the other ranks, as torchrun's agent does
                self._stop()
                self.returncode = failed[0]
            elif all(c == 0 for c in codes):
                self.returncode = 0
        return self.returncode

    def wait(self, timeout=None):
        import time

        deadline = None if timeout is None else time.time() + timeout
        while self.poll() is None:
            if deadline is not None and time.time() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.1)
        return self.returncode

    def _stop(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)
        for r in self.ranks:
            try:
                r.wait(30)
            except subprocess.TimeoutExpired:
                r.kill()
                r.wait()

    def send_signal(self, sig: int) -> None:
        for r in self.ranks:
            r.send_signal(sig)


def torchrun(script_and_args, nproc: int = 2, cwd=None, env=None, timeout=None) -> subprocess.CompletedProcess:
    """`Ranks` run to their end, their output captured together (`subprocess.run` of torchrun)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        launch = Ranks(script_and_args, nproc, cwd=cwd, env=env, stdout=out, stderr=err)
        try:
            code = launch.wait(timeout)
        except subprocess.TimeoutExpired:
            launch.kill()
            for r in launch.ranks:
                r.wait()
            raise
        captured = []
        for f in (out, err):
            f.seek(0)
            captured.append(f.read().decode(errors="replace"))
    return subprocess.CompletedProcess(script_and_args, code, *captured)


def launch(cmd, stdout=None, stderr=None, env=None, cwd=None, **kwargs):
    """`subprocess.Popen` in a `nested` child: ``python -m torch.distributed.run --nproc_per_node N --master_port P
    script args`` as forked `Ranks`; anything else as `Popen` (the server's fork where it can)."""
    cmd = [str(c) for c in cmd]
    if len(cmd) > 7 and cmd[1:4] == ["-m", "torch.distributed.run", "--nproc_per_node"] and cmd[5] == "--master_port":
        return Ranks(cmd[7:], int(cmd[4]), cwd=cwd, env=env, stdout=stdout, stderr=stderr, port=int(cmd[6]))
    return Popen(cmd, cwd=cwd, env=env, stdout=stdout, stderr=stderr, **kwargs)
