"""Run-directory bookkeeping: tee of stdout/stderr to train.log, the resolved config, the run name."""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import threading
from pathlib import Path

import yaml


class Tee:
    """Duplicate file descriptors 1 and 2 into ``path`` as well as the terminal.

    Works at the descriptor level, so C extensions, subprocesses and logging handlers that captured
    ``sys.stderr`` before the tee started are all recorded.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.path, "ab", buffering=0)
        self._saved = {fd: os.dup(fd) for fd in (1, 2)}
        self._threads = []
        self._closed = False
        for fd in (1, 2):
            read_end, write_end = os.pipe()
            sys.stdout.flush() if fd == 1 else sys.stderr.flush()
            os.dup2(write_end, fd)
            os.close(write_end)
            t = threading.Thread(target=self._pump, args=(read_end, self._saved[fd]), daemon=True)
            t.start()
            self._threads.append(t)
        atexit.register(self.close)

    def _pump(self, read_end: int, terminal_fd: int) -> None:
        try:
            while chunk := os.read(read_end, 65536):
                os.write(terminal_fd, chunk)
                self._log.write(chunk)
        except (OSError, ValueError):  # closed under us: a child process (e.g. wandb's service) kept the pipe
            pass
        finally:
            os.close(read_end)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)  # closes the pipe's last write end: the pump sees EOF
        for t in self._threads:
            t.join(timeout=2)
        if any(t.is_alive() for t in self._threads):
            # A child process still holds the pipe's write end; the daemon pumps end with the process.
            return
        for saved in self._saved.values():
            os.close(saved)
        self._log.close()


def resolved_config(*dataclass_objs, extra: dict | None = None) -> dict:
    """Every resolved field of the given dataclasses (and ``extra``): run_config.yaml's content."""
    resolved: dict = {}
    for obj in dataclass_objs:
        d = obj.to_dict() if hasattr(obj, "to_dict") else dataclasses.asdict(obj)
        resolved[type(obj).__name__] = {k: _plain(v) for k, v in sorted(d.items())}
    if extra:
        resolved.update(extra)
    return resolved


def write_run_config(path: str | Path, *dataclass_objs, extra: dict | None = None) -> dict:
    """Write `resolved_config` as YAML."""
    resolved = resolved_config(*dataclass_objs, extra=extra)
    Path(path).write_text(yaml.safe_dump(resolved, sort_keys=False))
    return resolved


def _plain(v):
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    return str(v)
