"""The off-policy generator's weight gate (`WeightGate`): which policy versions may sample a batch, and when the
trainer may write a new version into the weights the generator samples (its model copy, or an engine's servers).

Shaped like the policy server's ``trl_ext.serve.endpoint.VersionGate``: the generator `hold`s the weights while it
reads them (a whole batch in strict mode, one decoding step in flight) and `release`s them; a publish asks to write
with `begin_write` and ends with `end_write`. The schedule (``trl_ext.offpolicy.worker``'s module docstring, after
prime-rl's ``max_async_level`` / ``strict_async_level``, with in-flight updates as in PipelineRL and AReaL): batch n
is sampled by policies >= ``max(n - k, s)`` (`required_version`), only that one in strict mode. `write_decision`
says whether a version is written now, waits for the batch or step in progress, or goes as the store's snapshot.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class WeightGate:
    """The generator's hold on its weights and the trainer's writes into them. ``stop`` set: the generator stops;
    ``alive()``: whether its thread runs; ``has_job(index)``: whether batch ``index`` is submitted (`JobQueue.has`)."""

    def __init__(self, max_async_level: int, strict: bool, start_step: int, stop: threading.Event,
                 alive: Callable[[], bool], has_job: Callable[[int], bool]) -> None:  # fmt: skip
        self.k, self.strict, self.start_step = max_async_level, strict, start_step
        self.stop, self.alive, self.has_job = stop, alive, has_job
        self.cond = threading.Condition()
        self.busy = False  # the generator reads the weights (`hold` .. `release`)
        self.writing = False  # a publish writes them (`begin_write` .. `end_write`)
        self.writer_waiting = False  # a publish waits for its decision
        self.next_index = start_step  # the batch the generator samples next

    def required_version(self, index: int) -> int:
        """Oldest policy allowed to sample batch ``index`` (the only one in strict mode)."""
        return max(index - self.k, self.start_step)

    def write_decision(self, version: int) -> str:
        """"write" (into the generator's weights now), "snapshot" or "wait" (for the generator's batch or step)."""
        if self.stop.is_set() or not self.alive():
            return "write"  # nothing samples any more
        if not self.strict:
            return "wait" if self.busy else "write"  # the decoding step in progress
        if not self.busy and self.required_version(self.next_index) >= version:
            return "write"  # every batch of an older policy is sampled
        if (self.next_index == version and self.required_version(version + 1) >= version
                and self.has_job(version)):  # fmt: skip
            return "wait"  # k = 1: the batch the trainer takes next is the last of the older policy
        return "snapshot"

    # ------------------------------------------------------------------ trainer thread
    def begin_write(self, version: int) -> bool:
        """Wait for `write_decision` on ``version``. True: write now (the generator stays off its weights until
        `end_write`); False: the version goes as a snapshot. A publish waiting here goes before the generator's next
        decoding step in flight (`hold`)."""
        decision = ["wait"]

        def decided() -> bool:
            decision[0] = self.write_decision(version)
            return decision[0] != "wait"

        with self.cond:
            self.writer_waiting = True
            try:
                self.cond.wait_for(decided)
                direct = self.writing = decision[0] == "write"
            finally:
                self.writer_waiting = False
                self.cond.notify_all()
        return direct

    def end_write(self, written: Callable[[], None] | None = None) -> None:
        """The write is over (or abandoned: a failed write is no version); ``written()``, run under the gate before
        the generator may read, records the version written."""
        with self.cond:
            self.writing = False
            if written is not None:
                written()
            self.cond.notify_all()

    def wake(self) -> None:
        """Wake every waiter (to see ``stop``)."""
        with self.cond:
            self.cond.notify_all()

    # ------------------------------------------------------------------ generator thread
    def hold(self) -> None:
        """The generator reads its weights from here until `release`. A write in progress finishes first; in flight
        a publish waiting to write goes first too (in strict mode it may be waiting for this very batch)."""
        with self.cond:
            yields = not self.strict
            self.cond.wait_for(lambda: not (self.writing or (yields and self.writer_waiting)) or self.stop.is_set())
            self.busy = True

    def release(self, next_index: int | None = None) -> None:
        """A publish may write from here (it first waits for the kernels already queued on the generator's stream);
        ``next_index``: the batch the generator samples next."""
        with self.cond:
            self.busy = False
            if next_index is not None:
                self.next_index = next_index
            self.cond.notify_all()
