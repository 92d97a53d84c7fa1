"""The Docker sandbox (MLGym runs its agents' commands in a container): ``docker run`` with no network, a read-only
root filesystem but for the workspace (mounted at ``/workspace``) and a private ``/tmp``, the process, memory and CPU
limits of the run (``--pids-limit``, ``--memory``, ``--ulimit cpu``), as the caller's user; past `Limits.wall_s` the
container is killed. The image must hold the Python the agent's code needs (`IMAGE` by default, pulled beforehand)."""

from __future__ import annotations

import functools
import itertools
import os
import shutil
import subprocess
from pathlib import Path

from trl_ext.sandbox.base import Limits, Result, supervise, workspace_dir

IMAGE = "python:3.11-slim"
_names = itertools.count()


@functools.cache
def unavailable() -> str | None:
    """Why Docker cannot sandbox a run here, or None."""
    if shutil.which("docker") is None:
        return "docker is not installed (https://docs.docker.com/engine/install/)"
    info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                          timeout=30)  # fmt: skip
    if info.returncode != 0:
        return f"the Docker daemon is not reachable ({info.stderr.strip()[:200]})"
    return None


def backend(image: str = IMAGE) -> DockerSandbox:
    return DockerSandbox(image)


class DockerSandbox:
    """Runs commands in a fresh container each (module docstring)."""

    name = "docker"

    def __init__(self, image: str = IMAGE) -> None:
        self.image = image

    def run(self, argv: list[str], workspace: Path, limits: Limits) -> Result:
        workspace = workspace_dir(workspace)
        name = f"trl_ext_{os.getpid()}_{next(_names)}"
        cmd = ["docker", "run", "--rm", "--name", name, "--network", "none", "--read-only", "--tmpfs", "/tmp",
               "--pids-limit", str(limits.processes), "--memory", f"{limits.memory_mb}m",
               "--memory-swap", f"{limits.memory_mb}m", "--ulimit", f"cpu={limits.cpu_s}:{limits.cpu_s + 1}",
               "--ulimit", f"fsize={limits.file_mb << 20}", "--user", f"{os.getuid()}:{os.getgid()}",
               "-v", f"{workspace}:/workspace", "-w", "/workspace", "-e", "HOME=/workspace", self.image, *argv]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        return supervise(proc, limits, lambda: subprocess.run(["docker", "kill", name], capture_output=True,
                                                              timeout=60))  # fmt: skip
