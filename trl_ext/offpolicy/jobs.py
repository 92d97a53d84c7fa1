"""The off-policy generator's job queue (`JobQueue`): the prompt batches the trainer submits, each taken once by the
generator thread in index order, and the finished rollouts (`Rollout`), at most ``max_async_level`` of them waiting
for the trainer (prime-rl's bounded rollout queue)."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

from trl_ext.offpolicy.store import Closed


@dataclass
class Rollout:
    """A generation batch as the trainer receives it: dataset rows, token ids, behaviour log-probs, versions."""

    index: int
    rows: list[dict]
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]
    extra: dict = field(default_factory=dict)  # episode outputs of environment runs (env_mask, env_return, ...)

    def version_range(self) -> tuple[int, int]:
        flat = [v for seq in self.versions for v in seq]
        return min(flat), max(flat)


class JobQueue:
    """Submitted prompt batches by index (`submit`, taken with `take`) and the finished rollouts (`put`, `poll`),
    ``finished`` bounded by ``max_async_level``. ``stop`` set: every wait ends with `Closed`."""

    def __init__(self, max_async_level: int, start_step: int, stop: threading.Event) -> None:
        self.finished: queue.Queue[Rollout] = queue.Queue(maxsize=max_async_level)
        self.stop = stop
        self._jobs: dict[int, tuple[list[dict], list[list[int]]]] = {}
        self._cond = threading.Condition()
        self.claimed = start_step - 1  # the newest batch the generator has taken

    def submit(self, index: int, rows: list[dict], prompt_ids: list[list[int]]) -> None:
        """The prompts of batch ``index`` (trainer thread)."""
        with self._cond:
            self._jobs[index] = (rows, prompt_ids)
            self._cond.notify_all()

    def has(self, index: int) -> bool:
        """Whether batch ``index`` is submitted (waiting, or taken by the generator): a publish may wait for it."""
        with self._cond:
            return index in self._jobs or self.claimed >= index

    def take(self, index: int) -> tuple[list[dict], list[list[int]]]:
        """The rows and prompt ids of batch ``index``, once submitted (generator thread)."""
        with self._cond:
            self._cond.wait_for(lambda: self.stop.is_set() or index in self._jobs)
            if self.stop.is_set():
                raise Closed
            self.claimed = index
            return self._jobs.pop(index)

    def put(self, rollout: Rollout) -> None:
        """``rollout`` for the trainer, once the queue has room (generator thread)."""
        while True:
            if self.stop.is_set():
                raise Closed
            try:
                self.finished.put(rollout, timeout=0.1)
                return
            except queue.Full:
                continue

    def poll(self, index: int, timeout: float) -> Rollout | None:
        """The next finished rollout, which must be batch ``index``; None if none comes within ``timeout`` s."""
        try:
            rollout = self.finished.get(timeout=timeout)
        except queue.Empty:
            return None
        if rollout.index != index:
            raise RuntimeError(f"expected rollout batch {index}, the queue delivered batch {rollout.index}")
        return rollout

    def wake(self) -> None:
        """Wake a `take` waiting for a batch (to see ``stop``)."""
        with self._cond:
            self._cond.notify_all()
