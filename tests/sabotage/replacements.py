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

def gate_without_load(orig):
    """VersionGate.enter (the server's version gate) never loads a checkpoint: it records the requested version and
    answers with the weights the server holds (its start weights)."""

    async def enter(self, version, load):
        async def nothing():
            return None

        return await orig(self, version, nothing)

    return enter


def each_process_alone(orig):
    """RolloutWorker's ``agree`` (every process must be able to push before any pushes into the shared servers) is
    replaced by this process's own decision."""

    def init(self, *args, **kwargs):
        kwargs["agree"] = lambda ok: ok
        orig(self, *args, **kwargs)

    return init


def push_start_weights(orig):
    """PolicySource (the weights a push sends) yields, at every push, the weights of its first push (the start
    policy): the transfer runs as before, with stale tensors."""

    def iterate(self):
        if not hasattr(self, "_first"):
            self._first = [(name, t.detach().clone()) for name, t in orig(self)]
        return iter(self._first)

    return iterate


def single_attempt(orig):
    """retrying (the client's retry) sends each request once: a transient error (connection refused, 502/503/504)
    fails at once, with or without a restarted server to wait for."""

    def retrying(send, recover=None):
        return send()

    return retrying


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


def gather_whole_model_first(orig):
    """merged_weights, as the publish reads it, gathers and merges every tensor of the model before yielding the
    first (the whole model held at once on every process, as the publishes held it before they were streamed)."""

    def merged_weights(model):
        yield from list(orig(model))

    return merged_weights


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


def recipe_flags_last(orig):
    """expand puts the recipes' flags after the command line's: the recipe overrides what was typed."""

    def expand(argv, parser):
        from trl_ext.runs.recipe import recipe_argv

        full, recipes = orig(argv, parser)
        mine = [a for r in recipes for a in recipe_argv(r, parser)]
        return full[len(mine):] + mine, recipes

    return expand


def no_reproduction_check(orig):
    """check_reproduces checks nothing: a run_config.yaml recipe runs into its own directory, or as another run when a
    default changed."""

    def check_reproduces(plan, recipe):
        plan.origin = recipe.origin

    return check_reproduces


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


def batches_not_skipped(orig):
    """skip_first_batches (transformers.trainer's) skips nothing: a resumed run starts the data order over."""

    def skip_first_batches(dataloader, num_batches=0):
        return dataloader

    return skip_first_batches


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


def reward_unguarded(orig):
    """guard_reward returns the reward function unwrapped: a computed NaN reaches TRL as a None would."""

    def guard_reward(fn, name, faults=None):
        return fn

    return guard_reward


def plain_write(orig):
    """write_atomic writes the file in place (open, write), with no temporary file and no rename."""

    def write_atomic(path, text):
        with open(path, "w") as f:
            f.write(text)

    return write_atomic


def marker_first(orig):
    """RunLifecycle._save_checkpoint writes the completion marker before the checkpoint's files."""

    def _save_checkpoint(self, model, trial, *args, **kwargs):
        import sys
        from pathlib import Path

        if self.args.should_save:
            ckpt = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{self.state.global_step}"
            ckpt.mkdir(parents=True, exist_ok=True)
            sys.modules["trl_ext.runs.lifecycle"].mark_complete(ckpt, self.state.global_step)
        return orig(self, model, trial, *args, **kwargs)

    return _save_checkpoint


def checks_left_to_the_trainer(orig):
    """check_trainer_plan (layout.py's run of train.py's checks before any server starts) does nothing: the trainer
    checks its plan itself, after the servers have started."""

    def check(layout):
        return None

    return check


def vllm_default_shares(orig):
    """gpu_shares gives every server vLLM's own default share (0.92), whatever else runs on its GPUs, and refuses
    nothing."""

    def shares(servers, given):
        return [given or 0.92 for _ in servers]

    return shares


def rows_round_robin(orig):
    """replica_of sends row i to replica (i + offset) mod R: a group's rows are split over the replicas."""

    def replica_of(rows, replicas, offset=0):
        return [(i + offset) % replicas for i in range(len(rows))]

    return replica_of


def server_not_a_teacher(orig):
    """has_teacher does not count a teacher server (--teacher_server_url) as the run's teacher."""

    def has_teacher(cfg, adapters):
        return bool(cfg.teacher_model) or adapters or cfg.dual_lora or cfg.beta > 0

    return has_teacher


def agreement_by_any_process(orig):
    """OffPolicy._every_process (the trainer processes' agreement before a push into the shared servers) reduces with
    MAX instead of MIN: a version is pushed when any process may push it (the all-reduce still runs on every
    process; one process alone is unchanged)."""

    def _every_process(self, ok):
        return not orig(self, not ok)  # MIN over the negations: the negation of the MAX

    return _every_process


def keys_not_checked(orig):
    """authorized (the version gate's API-key check) accepts every request: the gate's routes run without a key
    (vLLM's own check comes after them, or never for the routes the gate answers itself)."""

    def authorized(header, keys):
        return True

    return authorized


def not_confined(orig):
    """inside (the gate's confinement of checkpoints to TRL_EXT_WEIGHTS_DIR) says yes to every directory: the gate
    loads any directory on the host a request names."""

    def inside(directory, root):
        return True

    return inside


def takes_every_push(orig):
    """takes_pushes says yes to every server: the push routes of a server started without --weight-transfer-config
    reach the gate and the engine."""

    def takes_pushes(engine):
        return True

    return takes_pushes


def open_push_kept(orig):
    """VersionGate.abandon_push does nothing: a push a killed trainer left open (start, no finish) keeps the gate
    held after the next trainer's init."""

    async def abandon_push(self):
        return None

    return abandon_push


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


def token_rows_of_process_0(orig):
    """Records.write_token_records gathers only process 0's token rows: every other process sends empty columns to
    the gather (the collective still runs; one process alone is unchanged)."""

    def write_token_records(self):
        acc = self.trainer.accelerator
        if acc.num_processes > 1 and not acc.is_main_process and self.table is not None:
            self.table.samples.clear()
        return orig(self)

    return write_token_records


def start_weights_without_origin(orig):
    """start_weights (train.py's record or check of the start weights) runs as if the run had no recipe run: a rerun
    from another run's run_config.yaml records its start weights without comparing them with that run's."""

    def start_weights(plan, model_path, teacher=None):
        origin = getattr(plan, "origin", None)
        plan.origin = None
        try:
            return orig(plan, model_path, teacher)
        finally:
            plan.origin = origin

    return start_weights


def never_restart_servers(orig):
    """server_restartable (layout.py's watcher: is a server that exited started again?) answers no: a server that
    dies during training stops the run, as before restarts existed."""

    def server_restartable(server, limit):
        return False

    return server_restartable


def never_restart_the_trainer(orig):
    """trainer_refusal (layout.py's watcher: why a trainer's exit is not restarted) always refuses: a crashed trainer
    stops the run, as before restarts existed."""

    def trainer_refusal(code, run_dir, started, restarts, limit):
        return "restarts switched off"

    return trainer_refusal


def restart_every_trainer_exit(orig):
    """trainer_refusal (layout.py's watcher) takes every non-zero exit for a crash: exit 2 and a run_summary.json
    saying config_error or numeric_fault are restarted too (the bound and the checkpoint are still checked)."""

    def trainer_refusal(code, run_dir, started, restarts, limit):
        return orig(1, run_dir, float("inf"), restarts, limit)

    return trainer_refusal


def no_wait_for_a_restart(orig):
    """Replica.recover (a request's wait for a server layout.py restarts) gives up at once: the request fails as
    if the server had no restart coming."""

    def recover(self, failure):
        raise failure.error from failure

    return recover


def version_by_number(orig):
    """VersionGate.serves (is the requested version loaded?) compares version numbers only: a restarted trainer's
    version N, published under a new directory, is answered with the weights the dead trainer's N left loaded."""

    def serves(self, version, source=None):
        return self.version == version

    return serves
