"""Trainer plumbing of off-policy training: the GRPOTrainer hooks (`OffPolicyMixin`); the flags are
``trl_ext.offpolicy.args``. The rollout machinery is in ``trl_ext.offpolicy.worker``, the loss in ``trl_ext.offpolicy.importance``.

With ``max_async_level = 0`` (the default) nothing changes: TRL's own synchronous generation and loss run untouched.
With k > 0 a generator thread samples batches ahead of the trainer (``trl_ext.offpolicy.worker`` has the schedule; the
sampler is the one ``--generation_backend`` names, ``trl_ext.generation.backends``, announced once in train.log) and
every training step uses the masked importance-sampling loss of prime-rl (``trl_ext.offpolicy.importance``) with the recorded behaviour
log-probs, whatever the masks are set to: with the masks off (``importance.NO_MASK``) it is REINFORCE weighted by the
plain importance ratio. TRL's PPO clip (epsilon, delta), its sequence-level IS, entropy masks and bonus do not apply
to that loss and must stay at their defaults. The KL penalty to the reference model (beta) is TRL's k3 estimator on
the tokens the masks keep, times the policy term's clipped ratio when use_bias_correction_kl (TRL's default; TRL
multiplies by the ratio to its old policy, here the behaviour policy), normalised like the policy term
(``importance.reference_kl``): a dropped token pushes no gradient.
"""

from __future__ import annotations

import copy

import torch
from transformers import TrainerCallback
from trl.trainer.utils import RepeatSampler, pad

from trl_ext.batch import loss_mask
from trl_ext.env.episodes import answer_stop_sequences
from trl_ext.generation.backends import DESCRIPTIONS
from trl_ext.offpolicy.importance import (
    NORMALISATIONS,
    ImportanceConfig,
    importance_loss,
    policy_lag_stats,
    reference_kl,
)
from trl_ext.offpolicy.worker import PolicyStore, RolloutWorker, SamplingParams, generation_copy
from trl_ext.registry import ConfigError


class _PublishWeights(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step < state.max_steps:  # the last step's policy samples no batch that is trained
            self.trainer._publish_policy(state.global_step)


class OffPolicyMixin:
    """GRPOTrainer hooks for max_async_level > 0; every hook is a plain pass-through when it is 0."""

    _pending_rollout = None  # the generator's rollout of the batch being built (also on a trainer built without __init__)
    _publisher = None  # the engine's checkpoint publisher (`rollout_engine`)
    _pusher = None  # the engine's servers' weight pusher (`rollout_engine`)
    vllm_offpolicy = False  # an engine samples (trl_ext.vllm.trainer.VLLMMixin sets it)

    def rollout_engine(self, policy):
        """``(sampler, publisher, pusher)`` when an engine samples the rollouts (`VLLMMixin`: ``--use_vllm``), else
        None: the sampler takes each version's snapshot, which ``publisher.publish(version, policy)`` makes (a
        collective); ``pusher`` (or None) pushes a version into the engine's servers instead, when no batch still to be
        sampled needs an older one (``RolloutWorker.publish``)."""
        return None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.offpolicy_cfg = ImportanceConfig.from_object(self.args) if self.args.max_async_level > 0 else None
        self.offpolicy_trace: list[tuple[int, int, int]] = []
        """(step, oldest, newest policy version) of every batch trained, for tests and diagnostics."""
        self._rollout_worker: RolloutWorker | None = None
        self._pending_rollout = None
        if self.offpolicy_cfg is None:
            return
        if (self.rollout_func is not None and not self.args.env) or self.tools or self.environment_factories is not None:
            raise ConfigError("--max_async_level >= 1 drives single-turn generation and the --env episode loop; "
                              "not another rollout_func, tools or environment factories")
        if not hasattr(self.train_dataset, "__getitem__"):
            raise ConfigError("--max_async_level >= 1 needs an indexable (map-style) train dataset")
        self.add_callback(_PublishWeights(self))
        self._generation_template = None  # FSDP2: the generator's plain copy, made before the Trainer shards the model
        if self.is_fsdp_enabled and not self.vllm_offpolicy:
            from trl_ext.offpolicy.sharded import is_sharded

            model = self.accelerator.unwrap_model(self.model)
            if is_sharded(model):
                raise RuntimeError("the policy is sharded already: the generator's plain copy cannot be made")
            self._generation_template = generation_copy(model)
        if self.vllm_offpolicy:
            servers = self.args.vllm_mode == "server"
            if self.accelerator.is_main_process:  # one line per run
                print(f"off-policy generator: {'the vLLM servers' if servers else 'a vLLM engine'} (--use_vllm; "
                      f"trl_ext.{'serve' if servers else 'vllm'}.engine)", flush=True)
        else:
            backend = self.args.generation_backend
            print(f"off-policy generator: {DESCRIPTIONS[backend]} (--generation_backend {backend})", flush=True)

    # ------------------------------------------------------------------ generator lifecycle
    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            self._stop_rollouts()

    def _start_rollouts(self) -> None:
        args, start = self.args, self.state.global_step
        model = self.accelerator.unwrap_model(self.model)
        gathered = self._generation_template is not None
        engine = self.rollout_engine(model)  # --use_vllm: an engine samples, loading published checkpoints
        self._publisher, pusher = engine[1:] if engine is not None else (None, None)
        self._pusher = pusher
        if engine is not None:
            gen_model, sampler = None, engine[0]
            store = PolicyStore(self._publisher.publish)
            where = f"none: the vLLM engine loads each published checkpoint ({self._publisher.why})"
        else:
            if gathered:  # FSDP2: the plain copy, loaded with the gathered whole weights
                from trl_ext.offpolicy.sharded import load_streamed

                gen_model, self._generation_template = self._generation_template, None
                gen_model.to(self.accelerator.device)  # made on the host before sharding: moved to the trainer's device
                load_streamed(gen_model, model)  # a collective, on every process
            else:
                gen_model = generation_copy(model)
            sampler, store = None, PolicyStore()  # --generation_backend's sampler
            where = f"on {next(gen_model.parameters()).device}{' (gathered from the FSDP2 shards)' * gathered}"
        if engine is not None and pusher is None:
            store.publish(start, model)  # the starting policy's checkpoint (a copy holds it already)
        self._saved_threads = torch.get_num_threads()
        gen_threads = None
        if gen_model is not None and next(gen_model.parameters()).device.type == "cpu":
            gen_threads = args.generator_threads or max(1, self._saved_threads // 2)
            torch.set_num_threads(max(1, self._saved_threads - gen_threads))
        params = self.rollout_sampling_params()
        self._rollout_worker = RolloutWorker(
            gen_model, store, params, max_async_level=args.max_async_level, strict=args.strict_async_level,
            start_step=start, seed=args.seed, rank=self.accelerator.process_index, backend=args.generation_backend,
            num_threads=gen_threads,
            autocast=self.accelerator.autocast,
            episode_fn=self._episode_fn() if args.env else None, sampler=sampler, pusher=pusher,
            agree=self._every_process,
        )  # fmt: skip
        if pusher is not None:
            self._rollout_worker.publish(start, model)  # the starting policy, pushed into the servers
        self._prompt_batches = self._prompt_stream(start)
        self._submitted = start - 1
        self._rollout_worker.start()
        mode = "strict" if args.strict_async_level else "non-strict (in-flight updates)"
        print(f"off-policy: generator thread started at policy version {start}, max_async_level "
              f"{args.max_async_level}, {mode}, generator threads {gen_threads}, its copy {where}",
              flush=True)  # fmt: skip

    def rollout_sampling_params(self) -> SamplingParams:
        """The sampling settings of the project's samplers and engines (the generator's, the servers')."""
        args = self.args
        return SamplingParams(
            max_new_tokens=self.max_completion_length, temperature=self.temperature, top_k=args.top_k or 0,
            top_p=args.top_p, eos_token_ids=tuple(self.eos_token_ids), pad_token_id=self._tokenizer.pad_token_id,
            stop_sequences=answer_stop_sequences(self.processing_class) if args.env else (),
        )  # fmt: skip

    def _episode_fn(self):
        """``--env``: the generator thread plays each batch's episodes (``env.episodes.play_episodes``) with its own
        tokenizer copy (a fast tokenizer is not safe to share between threads)."""
        from trl_ext.env.episodes import play_episodes, row_envs

        args, tok = self.args, copy.deepcopy(self.processing_class)

        def episodes(rows, sample_turn):
            prompts, seeds = [r["prompt"] for r in rows], [r["env_seed"] for r in rows]
            return play_episodes(prompts, seeds, args, tok, sample_turn, row_envs(rows))  # a row's env (mixtures)

        return episodes

    def _stop_rollouts(self) -> None:
        if self._rollout_worker is None:
            return
        self._rollout_worker.stop()
        for publisher in (self._publisher, self._pusher):
            if publisher is not None:
                publisher.close()
        self._rollout_worker = None
        torch.set_num_threads(self._saved_threads)

    def _prompt_stream(self, start: int):
        """This process's rows of the generation batches, in the order TRL's RepeatSampler gives them, from batch
        ``start`` (resume). The sampler's order is global (``generation_batch_size`` counts every process); accelerate
        hands process r the r-th contiguous slice of each batch, and so does this stream."""
        sampler = RepeatSampler(
            data_source=self.train_dataset, mini_repeat_count=self.num_generations,
            batch_size=self.args.generation_batch_size // self.num_generations, repeat_count=1,
            shuffle=self.shuffle_dataset, seed=self.args.seed,
        )  # fmt: skip
        index, size = 0, self.args.generation_batch_size
        local = size // self.accelerator.num_processes
        first = self.accelerator.process_index * local
        while True:
            order = list(sampler)
            for i in range(0, len(order) - size + 1, size):
                if index >= start:
                    yield [self.train_dataset[j] for j in order[i + first : i + first + local]]
                index += 1

    def _every_process(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every process (a collective)."""
        if self.accelerator.num_processes == 1:
            return ok
        flag = torch.tensor([int(ok)], device=self.accelerator.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag.item())

    def _publish_policy(self, version: int) -> None:
        if self._rollout_worker is not None:
            self._rollout_worker.publish(version, self.accelerator.unwrap_model(self.model))

    # ------------------------------------------------------------------ rollouts into TRL's batch
    def _prepare_inputs(self, generation_batch):
        if self.offpolicy_cfg is None or not self.model.training:
            return super()._prepare_inputs(generation_batch)
        if self._step % self.args.steps_per_generation != 0 and self._buffered_inputs is not None:
            return super()._prepare_inputs(generation_batch)  # a later slice of the current generation batch
        if self._rollout_worker is None:
            self._start_rollouts()
        step, worker = self.state.global_step, self._rollout_worker
        while self._submitted < step + self.args.max_async_level:
            self._submitted += 1
            rows = next(self._prompt_batches)
            prompt_ids, images, _ = self._tokenize_prompts([row["prompt"] for row in rows])
            if images is not None:
                raise ConfigError("--max_async_level >= 1 supports text prompts only")
            worker.submit(self._submitted, rows, prompt_ids)
        rollout = worker.get(step)
        oldest, newest = rollout.version_range()
        need = worker.required_version(step)
        if newest > step or oldest < need or (self.args.strict_async_level and oldest != newest):
            raise RuntimeError(f"batch {step} was sampled by policies {oldest}..{newest}; allowed {need}..{step}")
        self.offpolicy_trace.append((step, oldest, newest))
        self._buffered_inputs = None  # force TRL to build the batch from this rollout
        self._pending_rollout = rollout
        try:
            return super()._prepare_inputs(rollout.rows)
        finally:
            self._pending_rollout = None

    def _generate(self, prompts):
        rollout = self._pending_rollout
        if rollout is None:
            return super()._generate(prompts)
        if list(prompts) != [row["prompt"] for row in rollout.rows]:
            raise RuntimeError("prompts of the generation batch differ from the rollout's prompts")
        own = {"prompt_ids": rollout.prompt_ids, "completion_ids": rollout.completion_ids, "logprobs": rollout.logprobs}
        if self.args.env:  # episodes played by the generator thread: env_mask, env_return; metrics logged here
            from trl_ext.env.episodes import log_episodes, log_words

            extra = dict(rollout.extra)
            self._env_trajectories = extra.pop("trajectories")  # for an environment RH detector, as env_rollout
            log_episodes(self, self._env_trajectories, *log_words(self.args))
            own.update(extra)
        self.rollout_func = lambda _prompts, _trainer: own  # TRL's hook for externally generated completions
        try:
            return super()._generate(prompts)
        finally:
            self.rollout_func = None

    def offpolicy_versions_stage(self, out: dict) -> None:
        """Scorer stage: the policy version of every completion token (``behaviour_versions``) joins the batch and
        the policy lag is logged; nothing when the batch did not come from the generator thread."""
        rollout = self._pending_rollout
        if rollout is None:
            return
        versions = pad([torch.tensor(v) for v in rollout.versions], padding_value=0, padding_side="right",
                       pad_to_multiple_of=self.pad_to_multiple_of).to(out["completion_ids"].device)  # fmt: skip
        if versions.shape != out["completion_ids"].shape or "sampling_per_token_logps" not in out:
            raise RuntimeError("rollout versions / behaviour log-probs do not line up with the completions")
        out["behaviour_versions"] = versions
        mask = loss_mask(out)
        lag = policy_lag_stats(versions, mask, self.state.global_step)
        self._log_over_processes({f"offpolicy/{name}": value for name, value in lag.items()})

    # ------------------------------------------------------------------ loss
    @property
    def offpolicy_loss_on(self) -> bool:
        """Whether the loss stage uses the importance-sampling loss (k >= 1, training)."""
        return self.offpolicy_cfg is not None and self.model.training

    def offpolicy_loss(self, model, inputs):
        """Loss stage (k >= 1): prime-rl's masked importance-sampling loss on the behaviour log-probs, plus the
        reference KL on the kept tokens (module docstring)."""
        if "sampling_per_token_logps" not in inputs:
            raise RuntimeError("off-policy loss without behaviour log-probs: the batch did not come from the generator")
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        mask = loss_mask(inputs)
        lp, entropies, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True
        )
        accumulation = self.current_gradient_accumulation_steps
        num_items = None
        if self.loss_type in ("dapo", "token"):  # TRL: tokens of the generation batch, rescaled to one window
            num_items = inputs["num_items_in_batch"] / self.accelerator.num_processes
            num_items = num_items * accumulation / self.args.steps_per_generation
        kwargs = {"num_items_in_batch": num_items, "max_completion_length": self.max_completion_length}
        out = importance_loss(lp, inputs["sampling_per_token_logps"], inputs["advantages"], mask,
                              self.offpolicy_cfg, self.loss_type, **kwargs)  # fmt: skip
        self.record_offpolicy_tokens(inputs, lp, out.masks, mask)  # --token_records_every (runs.token_mixin)
        loss = out.loss
        logged = {f"offpolicy/{name}": value for name, value in out.metrics.items()}
        if self.beta != 0.0:  # kept tokens only, weighted by the policy term's (clipped) ratio: offpolicy.importance
            per_token_kl = reference_kl(lp, inputs["ref_per_token_logps"], inputs["sampling_per_token_logps"], mask,
                                        out.masks["keep"], self.offpolicy_cfg,
                                        bias_correction=self.args.use_bias_correction_kl)  # fmt: skip
            loss = loss + self.beta * NORMALISATIONS.get(self.loss_type)(per_token_kl, mask, **kwargs)
            logged["kl"] = per_token_kl.detach().sum() / mask.sum().clamp(min=1)
        if self.loss_type not in ("dapo", "token"):
            loss = loss / accumulation
        logged["entropy"] = (entropies.detach() * mask).sum() / mask.sum().clamp(min=1)
        self._log_over_processes(logged)
        return loss

    def _log_over_processes(self, metrics: dict[str, torch.Tensor]) -> None:
        """Training metrics over every process (TRL gathers its own the same way), in one gather: the mean of the
        processes' values, the largest for a ``*_max``; the values themselves on one process."""
        names = list(metrics)
        rows = self.accelerator.gather(torch.stack([metrics[k].detach().float().reshape(()) for k in names])[None])
        for name, column in zip(names, rows.unbind(1), strict=True):
            self._metrics["train"][name].append((column.max() if name.endswith("_max") else column.mean()).item())
