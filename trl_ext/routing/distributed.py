"""The routed backward on several processes (`routed_backward`), for DDP and for FSDP2.

**DDP**: computed locally (DDP's own all-reduce cannot sync two backward passes, nor restore a routed-away side's
gradient after its reduce), then the gradients averaged as DDP would (`trl_ext.launch.processes.average_gradients`),
once, on the micro-batch where DDP would sync (``require_backward_grad_sync``).

**FSDP2**: every backward reduce-scatters the (routed) unsharded gradients into each process's gradient shard,
averaged over the processes as DDP averages, and a second backward accumulates into the shard. The routing masks act
inside the adapters' autograd functions on the unsharded parameters that FSDP2 all-gathers for the forward, so the
single pass needs nothing more. The two-pass step restores a routed-away side's gradient after its pass
(`trl_ext.routing.step._gradients_kept`): on the *shard*, after the reduce-scatter. The reduction is linear and
elementwise per shard, so restoring the averaged shard equals restoring every process's unsharded gradient before
the reduction. On a micro-batch where the Trainer defers the reduction (gradient accumulation: accelerate's
``no_sync``, FSDP2's ``set_requires_gradient_sync(False)``) FSDP2 would accumulate the unsharded gradients outside
``.grad``, where the restore cannot reach them: the two-pass step turns the reduction back on for its passes (more
communication, the same sum). Checked against one process at ``gradient_accumulation_steps`` 1.

Both: the two-pass step runs the sides that have samples on any process, each pass on all rows (``keep_rows``), so
that every process makes the same loss calls on the same shapes (TRL's loss gathers metrics; FSDP2's forward and
backward are collectives).
"""

from __future__ import annotations

import torch

from trl_ext.routing.step import single_pass_backward, two_pass_backward


def global_sides(accelerator, is_bad: torch.Tensor) -> tuple[bool, bool]:
    """(any good sample, any bad sample) over every process."""
    counts = torch.stack([(~is_bad).sum(), is_bad.sum()]).to(accelerator.device)
    good, bad = (accelerator.reduce(counts, reduction="sum") > 0).tolist()
    return good, bad


def routed_backward(trainer, loss_fn, inputs: dict, is_bad: torch.Tensor, model) -> torch.Tensor:
    """The routed backward of ``trainer`` (several processes, DDP or FSDP2); returns the detached loss."""
    acc, mode, two_pass = trainer.accelerator, trainer.args.routing_mode, trainer.args.routing_two_pass

    def step(backward):
        if two_pass:
            sides = global_sides(acc, is_bad)
            return two_pass_backward(loss_fn, inputs, is_bad, model, mode, backward, sides, keep_rows=True,
                                     loss_type=trainer.loss_type)
        return single_pass_backward(loss_fn, inputs, is_bad, model, mode, backward)

    if trainer.is_fsdp_enabled:
        if two_pass and hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(True)  # each pass reduced, also in accumulation (module docstring)
        return step(acc.backward)  # FSDP2 reduce-scatters each backward (module docstring)
    from trl_ext.launch.processes import average_gradients

    sync = getattr(model, "require_backward_grad_sync", True)
    with acc.no_sync(model):
        loss = step(acc.backward)
    if sync:
        average_gradients([p for p in model.parameters() if p.requires_grad])
    return loss
