"""The sabotage table's switches (``tests/sabotage/switches.py``): each function takes the original of a row's target
and returns its sabotaged replacement; its docstring says what the switch turns off (the results table's "switch").
Replacements import what they need when called: this file is imported at interpreter start-up.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any


def _rebinding(orig, **change: Callable[[dict], Any]):
    """``orig`` with some arguments recomputed from the bound arguments before the call."""
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        arguments = bound.arguments
        for name, fn in change.items():
            arguments[name] = fn(arguments)
        return orig(*bound.args, **bound.kwargs)

    return wrapper


def importance_without(doc: str, **off: float):
    """A replacement of ``importance_loss`` that runs it with ``off`` in its config (one mask or clip off)."""

    def replacement(orig):
        return _rebinding(orig, cfg=lambda a: dataclasses.replace(a["cfg"], **off))

    replacement.__doc__ = doc
    return replacement


def does_nothing(doc: str):
    """A replacement whose callable returns None whatever it is given (a sync, a load, a restore, a check that does
    nothing); ``doc`` says what that switches off."""

    def replacement(orig):
        def nothing(*args, **kwargs):
            return None

        return nothing

    replacement.__doc__ = doc
    return replacement


noop_sync = does_nothing("sync_colocate does nothing (TRL's colocate engine keeps the starting weights).")


noop_engine_load = does_nothing(
    "VLLMEngine.load does nothing (the generator's engine keeps the weights it started from).")


rng_not_restored = does_nothing(
    "Trainer._load_rng_state (transformers) does nothing: a resumed run keeps the RNG state of its fresh start.")


numeric_fault_ignored = does_nothing(
    "RunLifecycle.numeric_fault does nothing: a NaN / inf loss or gradient norm trains on.")


def load_without_copy(orig):
    """GeneratorWeights.load (the off-policy generator's load of a published snapshot) takes the snapshot and records
    its version but never copies the weights into the generator's model, nor hands a vLLM engine the version's
    checkpoint (the generator keeps sampling with its starting weights; the vLLM sampler, asked for a version it was
    never given, stops the run)."""

    def load(self, version):
        self.store.take(version)
        self.loaded_version = version

    return load


def copy_nothing(orig):
    """GeneratorWeights.copy_in (every publish's and load's copy into the off-policy generator's model) reads every
    published tensor (the FSDP2 gathers still run) but copies none into the generator's model (it keeps sampling with
    its starting weights)."""

    def copy_in(self, tensors):
        for _ in tensors:
            pass

    return copy_in


def always_snapshot(orig):
    """WeightGate.write_decision (the off-policy generator's weight gate) always answers "snapshot": every publish
    keeps a copy of the trainable weights in the store until the generator loads it (as every publish did before the
    weights were written in place)."""

    def write_decision(self, version):
        return "snapshot"

    return write_decision


def always_write(orig):
    """WeightGate.write_decision (the off-policy generator's weight gate) answers "write" at once, whatever the
    generator still has to sample: a publish overwrites the policy a strict generator still owes batches of."""

    def write_decision(self, version):
        return "write"

    return write_decision


def refresh_once(orig):
    """FastSampler._refresh_weights builds the fused decode weights once and never refreshes them (the fast sampler
    keeps the first policy's fused matrices after every weight load)."""

    def _refresh_weights(self):
        if self.weights is None:
            orig(self)

    return _refresh_weights


def gather_nothing_for_publishes(orig):
    """iter_whole of a sharded model with trainable_only (each publish to the generator: written in place, or a
    snapshot) gathers as before (the collective runs on every process) but yields nothing: the generator's plain copy
    keeps its starting weights."""

    def iter_whole(model, trainable_only=False):
        from trl_ext.offpolicy.sharded import is_sharded

        if not (trainable_only and is_sharded(model)):
            yield from orig(model, trainable_only)
            return
        for _ in orig(model, trainable_only):
            pass

    return iter_whole


def _first_version(versions: list[list[int]]) -> list[list[int]]:
    return [[seq[0]] * len(seq) if seq else [] for seq in versions]


def stamp_first_version(orig):
    """BatchSampler.sample_batch (the off-policy generator's sampling of one batch) stamps every token of a sequence
    with the version of its first token (in-flight weight loads still happen; the versions no longer say so)."""

    def sample_batch(self, index, rows, prompt_ids, rng):
        rollout = orig(self, index, rows, prompt_ids, rng)
        rollout.versions = _first_version(rollout.versions)
        return rollout

    return sample_batch


def vllm_stamp_first_version(orig):
    """VLLMSampler.sample stamps every token of a row with the version of its first chunk (the engine still reloads
    between chunks; the versions no longer say so)."""

    def sample(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        out.versions[:] = _first_version(out.versions)
        return out

    return sample


def kl_on_dropped_tokens(orig):
    """reference_kl is given keep = the loss mask: tokens the IS masks drop get a KL term and its gradient."""
    return _rebinding(orig, keep=lambda a: a["loss_mask"].bool())


def unrouted_single_pass(orig):
    """routing_mask sets no per-sample gradient masks (a plain context): the single-pass step trains both adapters
    on every sample."""

    @contextmanager
    def routing_mask(model, good_mask, mode):
        yield

    return routing_mask


def shares_by_sample_count(orig):
    """pass_share gives every loss type a mean-over-samples share (n_sub / n, 1 with keep_rows): the two-pass step
    splits token-normalised losses (bnpo, dapo) with the wrong weights."""

    def pass_share(loss_type, rows, token_mask, keep_rows):
        return 1.0 if keep_rows else int(rows.sum()) / len(rows)

    return pass_share


def unlabelled_masks(orig):
    """mask_labels names no mask: every token record says kept, whatever the importance masks dropped."""

    def mask_labels(masks, loss_mask):
        return [[None] * loss_mask.size(1) for _ in range(loss_mask.size(0))]

    return mask_labels


def no_gradient_restore(orig):
    """_gradients_kept restores nothing: the two-pass step's routed-away side keeps the gradient of the pass it must
    not learn from."""

    @contextmanager
    def _gradients_kept(params):
        yield

    return _gradients_kept


def unrouted_under_fsdp(orig):
    """routed_backward under FSDP2 runs one plain backward of the whole loss (no routing); DDP unchanged."""

    def routed_backward(trainer, loss_fn, inputs, is_bad, model):
        if not trainer.is_fsdp_enabled:
            return orig(trainer, loss_fn, inputs, is_bad, model)
        loss = loss_fn(inputs)
        trainer.accelerator.backward(loss)
        return loss.detach()

    return routed_backward


def scales_unchanged(orig):
    """The routing eval's scales() sets no adapter scales (a plain context): every eval mode samples the full
    model."""

    @contextmanager
    def scales(model, retain, forget):
        yield

    return scales


def no_context_ids(orig):
    """encode_context returns no tokens: the teacher scores plain-text prompts without the context."""

    def encode_context(tokenizer, text):
        return []

    return encode_context


def chat_messages_unchanged(orig):
    """teacher_messages returns the student's messages unchanged: the teacher of chat prompts sees no context."""

    def teacher_messages(messages, context):
        return [dict(m) for m in messages]

    return teacher_messages


def env_tokens_trained(orig):
    """The episode loop (play) returns env_mask all ones: environment tokens (replies, tool results, prefills, the
    closing EOS) are trained on."""

    def play(*args, **kwargs):
        out = orig(*args, **kwargs)
        out["env_mask"] = [[1] * len(mask) for mask in out["env_mask"]]
        return out

    return play


def env_tokens_version_zero(orig):
    """Environment tokens (replies, tool results) are stamped policy version 0 instead of the version of the agent
    token before them."""

    def _append_env(i, env_ids, completion, mask, logprobs, versions):
        before = len(versions[i])
        orig(i, env_ids, completion, mask, logprobs, versions)
        versions[i][before:] = [0] * (len(versions[i]) - before)

    return _append_env


def loss_mask_ignores_tool_mask(orig):
    """loss_mask returns completion_mask alone: the project's losses, ratios, IS masks and teacher scores include
    environment tokens."""

    def loss_mask(batch):
        return batch["completion_mask"]

    return loss_mask


def schedule_from_step_zero(orig):
    """WeightGate.required_version (the off-policy schedule, RolloutWorker.required_version's) ignores the step
    training resumed at (max(n - k, 0), not max(n - k, s)): a resumed run asks for policies from before the
    checkpoint."""

    def required_version(self, index):
        return max(index - self.k, 0)

    return required_version


def prompts_from_batch_zero(orig):
    """OffPolicy._prompt_stream ignores the resume step: the generator's prompt batches start over at batch 0."""

    def _prompt_stream(self, start):
        return orig(self, 0)

    return _prompt_stream


def every_batch_submitted(orig):
    """WeightGate is built with has_job answering True for every batch: a strict k = 1 publish waits for the batch
    the trainer takes next even when the trainer has not submitted it (instead of keeping the version as a
    snapshot)."""

    def init(self, max_async_level, strict, start_step, stop, alive, has_job):
        orig(self, max_async_level, strict, start_step, stop, alive, lambda index: True)

    return init


def failed_write_recorded(orig):
    """GeneratorWeights.write records its version (as a completed write does) when the write raises midway; the
    exception still reaches the trainer: the generator may sample the half-written copy under that version."""

    def write(self, version, model, stream):
        try:
            orig(self, version, model, stream)
        except BaseException:
            self.written(version)
            raise

    return write
