"""The bubblewrap sandbox (``bwrap``: Linux namespaces, no daemon; Debian's ``bubblewrap`` package).

Each run: new user, PID, network, IPC and UTS namespaces (``--unshare-all``: no network at all), the host's filesystem
read-only, a private ``/tmp``, the workspace the only writable directory, a new session, and the run killed when its
parent (the trainer) dies. Limits are resource limits set by ``prlimit`` (util-linux) on the sandbox and everything it
starts: CPU time (SIGXCPU, then SIGKILL a second later), address space, file size, processes. Processes are counted
per user: run as root, each run gets a user of its own (`UID_BASE` + a counter, the workspace handed to it), so its
process limit is its own; run as another user, the limit is that user's current processes plus `Limits.processes`.
Past `Limits.wall_s` the session is killed; the sandbox's PID namespace takes every process of the run with it.

Run as root, the sandboxed code is that unprivileged user: the workspace's parent directories must be traversable by
other users, and the interpreter and packages its code uses readable by them (a virtual environment under ``/root``,
mode 700, is not: the run then reports "Permission denied").
"""

from __future__ import annotations

import functools
import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

from trl_ext.sandbox.base import Limits, Result, supervise, workspace_dir

UID_BASE = 200000
"""Users of the runs started by root: ``UID_BASE`` .. ``UID_BASE + UID_RANGE - 1``, one per run at a time."""
UID_RANGE = 50000
INSTALL = ("bubblewrap is not installed (Debian / Ubuntu: apt-get install bubblewrap; Fedora: dnf install "
           "bubblewrap; or --sandbox docker)")  # fmt: skip


def _namespace_args(workspace: str) -> list[str]:
    return ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--ro-bind", "/", "/", "--tmpfs", "/tmp",
            "--proc", "/proc", "--dev", "/dev", "--bind", workspace, workspace, "--chdir", workspace,
            "--setenv", "HOME", workspace, "--"]  # fmt: skip


@functools.cache
def unavailable() -> str | None:
    """Why bubblewrap cannot sandbox a run here, or None (a probe run, as a run goes: as another user when root)."""
    if shutil.which("bwrap") is None or shutil.which("prlimit") is None:
        return INSTALL if shutil.which("bwrap") is None else "prlimit (util-linux) is not installed"
    user = {"user": UID_BASE + UID_RANGE, "group": UID_BASE + UID_RANGE, "extra_groups": []} if os.getuid() == 0 else {}
    with tempfile.TemporaryDirectory() as workspace:
        if user:
            os.chmod(workspace, 0o755)
        probe = subprocess.run(_namespace_args(workspace) + ["true"], capture_output=True, text=True, timeout=30,
                               **user)  # fmt: skip
    if probe.returncode != 0:
        return (f"bubblewrap cannot create its namespaces here ({probe.stderr.strip()[:200]}): allow unprivileged user "
                "namespaces (sysctl kernel.unprivileged_userns_clone=1, or on Ubuntu "
                "kernel.apparmor_restrict_unprivileged_userns=0), or use --sandbox docker")  # fmt: skip
    return None


def backend() -> BubblewrapSandbox:
    return BubblewrapSandbox()


def _processes_of(uid: int) -> int:
    """Processes (and threads) of user ``uid`` now, as RLIMIT_NPROC counts them."""
    count = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                continue
    return count


class BubblewrapSandbox:
    """Runs commands under bubblewrap (module docstring); safe to call from several threads at once."""

    name = "bwrap"

    def __init__(self) -> None:
        self._uids = itertools.count()
        self._lock = threading.Lock()

    def _user(self, workspace: Path) -> tuple[dict, int]:
        """(Popen's user arguments, the uid RLIMIT_NPROC counts) of a run: root hands the workspace to a user of the
        run's own; another user runs as itself."""
        if os.getuid() != 0:
            return {}, os.getuid()
        with self._lock:
            uid = UID_BASE + next(self._uids) % UID_RANGE
        for root, dirs, files in os.walk(workspace):
            for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
                os.chown(name, uid, uid, follow_symlinks=False)
        return {"user": uid, "group": uid, "extra_groups": []}, uid

    def run(self, argv: list[str], workspace: Path, limits: Limits) -> Result:
        workspace = workspace_dir(workspace)
        user, uid = self._user(workspace)
        nproc = limits.processes if user else _processes_of(uid) + limits.processes
        rlimits = ["prlimit", f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}", f"--as={limits.memory_mb << 20}",
                   f"--fsize={limits.file_mb << 20}", f"--nproc={nproc}", "--core=0", "--"]  # fmt: skip
        proc = subprocess.Popen([*rlimits, *_namespace_args(str(workspace)), *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True,
                                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"},
                                **user)  # fmt: skip
        return supervise(proc, limits, lambda: os.killpg(proc.pid, signal.SIGKILL))  # its PID namespace goes with it
