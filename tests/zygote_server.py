"""The fork server of tests/zygote.py: ``python tests/zygote_server.py SOCKET`` imports the entry points' modules
once, prints "ready", then forks one child per request (a script run as ``__main__`` with the caller's streams,
directory and environment) until its stdin closes, telling each caller its child's pid and then its exit code."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

import zygote
from zygote import HEADER, PRELOAD, ROOT, _threads

def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


_SERVING: tuple[str, dict[str, str]] | None = None
"""In the server and its children: (the server's socket, its environment)."""


def _nest() -> None:
    """In a child started with ``nested``: sweep.py's runs (``trl_ext.sweep``'s ``subprocess.Popen``) go through the
    server that forked this child (`zygote.launch`), each still a process of its own with the sweep's environment."""
    import types

    import trl_ext.sweep as sweep

    zygote._Server.instance = zygote._Server.client(*_SERVING)
    sweep.subprocess = types.SimpleNamespace(**{**vars(subprocess), "Popen": zygote.launch})


def _child(conn: socket.socket, fds: list[int], request: dict, closing: list[int]) -> None:
    """In the forked child: take the caller's streams, directory and environment, run the script, exit."""
    import atexit
    import runpy
    import signal
    import traceback

    code = 1
    try:
        for fd in closing:
            os.close(fd)
        conn.close()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        if request["new_session"]:
            os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if _threads(request["env"]) is not None:
            import torch

            torch.set_num_threads(int(_threads(request["env"])))
        if request.get("nested"):
            _nest()
        script = os.path.abspath(request["argv"][0])
        sys.argv = request["argv"]
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - the child reports as the interpreter would, then exits
        traceback.print_exc()
        code = 1
    finally:
        try:
            threading._shutdown()  # as the interpreter at exit: join the non-daemon threads, then atexit
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(path: str) -> None:
    """Import the entry points' modules, print "ready", then fork one child per request until stdin closes."""
    import importlib
    import selectors
    import signal

    global _SERVING
    _SERVING = (path, dict(os.environ))
    sys.path[0] = str(ROOT)  # not tests/: a child's path is a plain ``python script``'s
    for name in PRELOAD:
        importlib.import_module(name)
    from environments.stories import SPLITS, heldout_stories

    for split in SPLITS:  # the builtin prompts' stories (pure Python, cached): made once, not in every child
        heldout_stories(split)
    import gc

    gc.freeze()  # what is imported stays: a child's full collections (the Trainer's, ~0.3 s each) skip it
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    for f in (listener, wake_r, sys.stdin):
        sel.register(f, selectors.EVENT_READ)
    waiting: dict[int, socket.socket] = {}
    print("ready", flush=True)
    try:
        _loop(sel, listener, wake_r, wake_w, waiting)
    finally:  # the test process ended: leave nothing behind in the temporary directory
        listener.close()
        os.unlink(path)
        os.rmdir(os.path.dirname(path))


def _loop(sel, listener: socket.socket, wake_r: int, wake_w: int, waiting: dict[int, socket.socket]) -> None:
    """Serve until stdin closes: fork a child per request, tell each caller its child's pid and then its exit code."""
    while True:
        for key, _ in sel.select():
            if key.fileobj is sys.stdin:  # the test process ended
                return
            if key.fileobj is wake_r:
                os.read(wake_r, 4096)
            else:
                conn, _ = listener.accept()
                header, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
                request = json.loads(_recv_exact(conn, HEADER.unpack(header)[0]))
                pid = os.fork()
                if pid == 0:
                    server_fds = [listener.fileno(), wake_r, wake_w, *(c.fileno() for c in waiting.values())]
                    _child(conn, fds, request, server_fds)
                for fd in fds:
                    os.close(fd)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                waiting[pid] = conn
        while waiting:  # reap every finished child, tell its caller
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:  # the caller gave up waiting
                    pass
                conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
