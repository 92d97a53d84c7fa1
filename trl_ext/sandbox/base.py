"""Running an agent's code in a sandbox: the limits, the result, the backend interface and the one place that picks a
backend (`choose`).

A run gets a workspace directory (the only place it may write), no network, and limits on CPU time, memory, processes,
output and wall-clock time; a run past a limit is stopped with every process it started, and the result says which
limit stopped it, so an episode can hand it to the agent as the tool's output and go on. Backends (`BACKENDS`):
bubblewrap (Linux namespaces; ``trl_ext.sandbox.bwrap``) and Docker (``trl_ext.sandbox.docker``, MLGym's choice). No
backend available is a `ConfigError` naming how to install one: never a run without a sandbox.
"""

from __future__ import annotations

import importlib
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from trl_ext.registry import ConfigError


@dataclass(frozen=True)
class Limits:
    """What one run may use (MLGym runs each command with a timeout; the others are this sandbox's)."""

    cpu_s: int = 60
    """CPU seconds of each process (RLIMIT_CPU); past it the process is killed."""
    memory_mb: int = 2048
    """Address space of each process in MiB (RLIMIT_AS): an allocation past it fails (Python: MemoryError)."""
    processes: int = 64
    """Processes and threads the run may have at once (RLIMIT_NPROC, or Docker's --pids-limit)."""
    wall_s: float = 120.0
    """Wall-clock seconds; past them the run is killed with every process it started."""
    output_bytes: int = 65536
    """Bytes kept of each of stdout and stderr (the rest is cut, and the result says so)."""
    file_mb: int = 256
    """Largest file the run may write, in MiB (RLIMIT_FSIZE)."""

    def __post_init__(self) -> None:
        for name in ("cpu_s", "memory_mb", "processes", "wall_s", "output_bytes", "file_mb"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"sandbox limit {name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class Result:
    """What a run did: its exit code (a negative signal number when killed), its output (cut to
    ``Limits.output_bytes``), which limit stopped it (None: it ended by itself) and its wall time."""

    returncode: int
    stdout: str
    stderr: str
    stopped: str | None
    """``"wall-clock timeout"``, ``"CPU time limit"``, or None."""
    wall_s: float

    def report(self) -> str:
        """The result as a tool's output for the agent: the output, then how the run ended."""
        end = f"stopped: {self.stopped}" if self.stopped else f"exit code {self.returncode}"
        return "\n".join(part for part in (self.stdout.rstrip(), self.stderr.rstrip(), f"[{end}]") if part)


@runtime_checkable
class Sandbox(Protocol):
    """A backend: runs ``argv`` in ``workspace`` under ``limits``."""

    name: str

    def run(self, argv: list[str], workspace: Path, limits: Limits) -> Result: ...


BACKENDS = {"bwrap": "trl_ext.sandbox.bwrap", "docker": "trl_ext.sandbox.docker"}
"""Backend name -> its module (loaded when asked for: `choose`), in the order ``"auto"`` tries them."""


def unavailable(name: str) -> str | None:
    """Why backend ``name`` cannot run here (with how to get it), or None."""
    if name not in BACKENDS:
        raise ConfigError(f"unknown sandbox {name!r}; one of: {', '.join(BACKENDS)}, auto")
    return importlib.import_module(BACKENDS[name]).unavailable()


def choose(name: str = "auto", **options) -> Sandbox:
    """The sandbox backend ``name`` (``"auto"``: the first of `BACKENDS` available), built with ``options``; a
    `ConfigError` naming how to install one when none is available (checked at parse time, before any model loads)."""
    names = list(BACKENDS) if name == "auto" else [name]
    reasons = {}
    for n in names:
        if (why := unavailable(n)) is None:
            return importlib.import_module(BACKENDS[n]).backend(**options)
        reasons[n] = why
    detail = "; ".join(f"{n}: {why}" for n, why in reasons.items())
    raise ConfigError(f"no sandbox to run the agent's code in ({detail}). An agent's code never runs unsandboxed")


def supervise(proc: subprocess.Popen, limits: Limits, kill: Callable[[], None]) -> Result:
    """Wait for a backend's ``proc`` up to ``limits.wall_s`` (then ``kill()`` the run with every process it
    started) and read how it ended: SIGXCPU (its exit status 128 + 24 through bwrap or Docker) is the CPU limit."""
    start = time.monotonic()
    stopped = None
    try:
        out, err = proc.communicate(timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
        kill()
        out, err = proc.communicate()
        stopped = "wall-clock timeout"
    code = proc.returncode
    if stopped is None and code in (128 + signal.SIGXCPU, -signal.SIGXCPU):
        stopped = "CPU time limit"
    return Result(code, cut(out, limits.output_bytes), cut(err, limits.output_bytes), stopped,
                  time.monotonic() - start)


def workspace_dir(workspace) -> Path:
    """``workspace`` resolved; it must be a directory."""
    path = Path(workspace).resolve()
    if not path.is_dir():
        raise FileNotFoundError(f"sandbox workspace {path} is not a directory")
    return path


def cut(data: bytes, limit: int) -> str:
    """``data`` as text, cut to ``limit`` bytes with a note of how much was dropped."""
    text = data[:limit].decode(errors="replace")
    return text + (f"\n[... {len(data) - limit} more bytes cut]" if len(data) > limit else "")
