"""The off-policy generator thread's lifecycle (`GeneratorThread`): start, stop, its own CUDA stream, and its failure
surfaced in the trainer's thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import nullcontext

import torch

from trl_ext.offpolicy.store import Closed


class GeneratorThread:
    """Runs ``loop()`` on a daemon thread, with ``num_threads`` torch threads (None: unchanged) and, on a CUDA
    ``device()`` (read when the thread starts), a CUDA stream of its own (``stream``). `Closed` ends it quietly
    (a stop), any other exception is kept in ``error`` for `check`; ``on_exit()`` runs last either way. ``stop``
    set asks the loop to end (every wait of the generator checks it)."""

    def __init__(self, loop: Callable[[], None], device: Callable[[], torch.device], num_threads: int | None,
                 on_exit: Callable[[], None]) -> None:  # fmt: skip
        self.loop, self.device_of, self.num_threads, self.on_exit = loop, device, num_threads, on_exit
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.device: torch.device | None = None
        self.stream: torch.cuda.Stream | None = None  # the generator's CUDA stream (set by its thread)
        self._thread = threading.Thread(target=self._run, name="rollout-generator", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self) -> None:
        self._thread.join()

    def check(self, drained: Callable[[], bool]) -> None:
        """Re-raise the thread's failure in the caller's thread; RuntimeError if it has ended and ``drained()``
        (nothing it produced is left to take)."""
        if self.error is not None:
            raise RuntimeError("the rollout generator thread failed") from self.error
        if not self.is_alive() and drained():
            raise RuntimeError("the rollout generator thread is not running")

    def _run(self) -> None:
        try:
            if self.num_threads:
                torch.set_num_threads(self.num_threads)
            self.device = device = self.device_of()
            self.stream = stream = torch.cuda.Stream(device) if device.type == "cuda" else None
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                self.loop()
        except Closed:
            pass
        except BaseException as e:  # surfaced to the trainer by check()
            self.error = e
        finally:
            self.on_exit()
