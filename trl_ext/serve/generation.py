"""TRL's ``vllm_generation`` at ``--max_async_level 0`` with ``--vllm_mode server`` (`ServerGeneration`): the
policy's servers sample each step's rows with exactly that step's policy version."""

from __future__ import annotations

import torch


class ServerGeneration:
    """TRL's ``vllm_generation`` at ``--max_async_level 0`` with ``--vllm_mode server``: ``sync_weights()`` publishes
    the policy as the checkpoint of version ``global_step`` (every process takes part: a collective under FSDP2),
    ``generate(...)`` samples this process's rows on the servers with exactly that version, one completion per row
    (TRL's sampler has repeated each prompt already), each row seeded from (seed, process, step, call within the step),
    so a resumed run draws the seeds the uninterrupted one did."""

    def __init__(self, trainer, sampler, publisher, params) -> None:
        self.trainer, self.sampler, self.publisher, self._params = trainer, sampler, publisher, params
        self._calls = (None, 0)  # (version, generate calls at that version): seeds that a resumed run repeats

    def sync_weights(self) -> None:
        t = self.trainer
        version = t.state.global_step
        self.publisher.publish(version, t.accelerator.unwrap_model(t.model))
        self.sampler.stage(version, self.publisher.snapshot(version))

    def generate(self, prompts, images=None, num_generations=1, profiler=None):
        from contextlib import nullcontext

        if images is not None:
            raise ValueError("--vllm_mode server samples text prompts only")
        t = self.trainer
        version = t.state.global_step
        call = self._calls[1] if self._calls[0] == version else 0
        self._calls = (version, call + 1)
        rng = torch.Generator().manual_seed(hash((t.args.seed, t.accelerator.process_index, version, call)) % 2**63)
        with profiler or nullcontext():
            out = self.sampler.sample([list(p) for p in prompts], self._params, rng, before_step=lambda _: version)
        return prompts, out.completion_ids, [[[lp] for lp in row] for row in out.logprobs], None
