"""The command that starts a script on several CPU processes of this machine: torchrun (``torch.distributed.run``,
what ``accelerate launch`` runs on CPU) with a free rendezvous port."""

from __future__ import annotations

import socket
import sys


def free_port() -> int:
    """A TCP port free on this machine now (the OS picks it), for torchrun's ``--master_port``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(script_and_args: list[str], nproc: int = 2) -> list[str]:
    """``python -m torch.distributed.run --nproc_per_node N --master_port P script args...`` for this interpreter."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
            str(free_port()), *script_and_args]  # fmt: skip
