"""The off-policy generator's sampler over a vLLM engine (`VLLMSampler`, a ``trl_ext.interfaces.VersionedSampler``
used by ``trl_ext.offpolicy.worker``): the in-process ``trl_ext.vllm.engine.VLLMEngine`` or the servers'
``trl_ext.serve.engine.ServerEngine``.

In-flight updates (``--max_async_level >= 1`` non-strict): vLLM decodes a whole request per call, so the sampler
decodes in chunks of ``inflight_tokens`` tokens; before each chunk the generator may load a newer policy, and the next
chunk continues every unfinished row from its prompt and the tokens so far with the new weights (its prefix is
re-encoded: the prefix cache is reset at every load). Every token is stamped with the version of the chunk that
sampled it, so its behaviour log-prob is exactly that policy's, given its prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from trl_ext.interfaces import Sampled, SamplingParams

if TYPE_CHECKING:
    from trl_ext.vllm.engine import VLLMEngine

MAX_SEED = 2**31 - 1
"""The largest request seed."""


def _cut_at_stop(ids: list[int], stops: tuple[tuple[int, ...], ...]) -> int | None:
    """Length of ``ids`` up to and including the first complete stop sequence, or None."""
    best = None
    for seq in stops:
        n = len(seq)
        for end in range(n, len(ids) + 1):
            if tuple(ids[end - n : end]) == seq:
                best = end if best is None else min(best, end)
                break
    return best


class VLLMSampler:
    """The off-policy generator's sampler over a vLLM engine (``trl_ext.vllm.engine.VLLMEngine``, or the servers'
    ``trl_ext.serve.engine.ServerEngine``): a ``trl_ext.interfaces.VersionedSampler``. The generator `stage`s each
    policy version it loads (its checkpoint directory, ``trl_ext.vllm.publish``; None for a version pushed into the
    servers); when ``before_step`` reports a version other than the engine's, the staged checkpoint is loaded into the
    engine. ``inflight_tokens`` None decodes each row in one call (strict mode: the version cannot change within a
    batch); otherwise in chunks of that many tokens."""

    loads_versions = True  # it loads each staged version itself

    def __init__(self, engine: VLLMEngine, inflight_tokens: int | None) -> None:
        if inflight_tokens is not None and inflight_tokens < 1:
            raise ValueError(f"inflight_tokens must be >= 1, got {inflight_tokens}")
        self.engine, self.inflight_tokens = engine, inflight_tokens
        self.engine_version: int | None = None
        self._staged: tuple[int, str | None] | None = None

    def stage(self, version: int, snapshot: str | None) -> None:
        """The checkpoint directory of ``version`` (None: pushed), the one the generator now samples with (loaded at
        the next `_sync`)."""
        self._staged = (version, snapshot)

    def _sync(self, version: int) -> None:
        if version == self.engine_version:
            return
        if self._staged is None or self._staged[0] != version:
            raise RuntimeError(f"the generator samples with policy {version}, and the staged checkpoint is "
                               f"{self._staged and self._staged[0]}")  # fmt: skip
        self.engine.load(self._staged[1], version)
        self.engine_version = version

    def sample(self, prompt_ids: list[list[int]], params: SamplingParams, rng: torch.Generator | None = None,
               before_step: Callable[[int], int] | None = None) -> Sampled:  # fmt: skip
        if not prompt_ids or min(len(p) for p in prompt_ids) == 0:
            raise ValueError("every prompt needs at least one token")
        n, limit = len(prompt_ids), params.max_new_tokens
        seeds: list[int | None] = [None] * n
        if rng is not None:  # one request seed per row, drawn from the batch's generator (reproducible runs)
            seeds = torch.randint(0, MAX_SEED, (n,), generator=rng, device=rng.device).tolist()
        ids: list[list[int]] = [[] for _ in range(n)]
        logps: list[list[float]] = [[] for _ in range(n)]
        versions: list[list[int]] = [[] for _ in range(n)]
        done = [False] * n
        eos = set(params.eos_token_ids)
        t, chunk = 0, 0
        while t < limit and not all(done):
            version = before_step(t) if before_step is not None else 0
            self._sync(version)
            size = limit - t if self.inflight_tokens is None else min(self.inflight_tokens, limit - t)
            active = [i for i in range(n) if not done[i]]
            outs = self.engine.generate(
                [prompt_ids[i] + ids[i] for i in active], params, [size] * len(active),
                [None if seeds[i] is None else (seeds[i] + 104_729 * chunk) % MAX_SEED for i in active],
            )  # fmt: skip
            for i, (new_ids, new_lps) in zip(active, outs, strict=True):
                ids[i] += new_ids
                logps[i] += new_lps
                versions[i] += [version] * len(new_ids)
                cut = _cut_at_stop(ids[i], params.stop_sequences) if params.stop_sequences else None
                if cut is not None:
                    del ids[i][cut:], logps[i][cut:], versions[i][cut:]
                if cut is not None or (new_ids and new_ids[-1] in eos) or len(new_ids) < size:
                    done[i] = True
            t += size
            chunk += 1
        return Sampled(ids, logps, versions)
