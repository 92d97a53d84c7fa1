"""Off-policy training as a component (`OffPolicy`); the flags are ``trl_ext.offpolicy.args``. The rollout machinery
is in ``trl_ext.offpolicy.worker``, the loss in ``trl_ext.offpolicy.importance``.

With ``max_async_level = 0`` (the default) nothing changes: TRL's own synchronous generation and loss run untouched.
With k > 0 a generator thread samples batches ahead of the trainer (``trl_ext.offpolicy.worker`` has the schedule; the
sampler is the one ``--generation_backend`` names, ``trl_ext.generation.backends``, announced once in train.log) and
every training step uses the masked importance-sampling loss of prime-rl (``trl_ext.offpolicy.importance``) with the
recorded behaviour log-probs, whatever the masks are set to: with the masks off (``importance.NO_MASK``) it is REINFORCE weighted by the
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

from trl_ext import compat, transport
from trl_ext.batch import BatchContext, loss_mask
from trl_ext.components import Component, LossTokens, register
from trl_ext.generation.backends import DESCRIPTIONS, make_sampler
from trl_ext.offpolicy.importance import (
    NORMALISATIONS,
    ImportanceConfig,
    importance_loss,
    policy_lag_stats,
    reference_kl,
)
from trl_ext.offpolicy.worker import PolicyStore, RolloutWorker, WorkerConfig, generation_copy
from trl_ext.registry import ConfigError


class _Generator(TrainerCallback):
    """The generator's lifecycle: started when training begins (at the restored step on a resume), a publish after
    every optimizer step; stopped by `OffPolicy.close` when the trainer's ``train`` returns or raises (after every
    callback's ``on_train_end``, which may still read the generator)."""

    def __init__(self, component):
        self.component = component

    def on_train_begin(self, args, state, control, **kwargs):
        self.component.start()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step < state.max_steps:  # the last step's policy samples no batch that is trained
            self.component.publish(state.global_step)


@register
class OffPolicy(Component):
    """``--max_async_level >= 1``: the generator thread's batches as TRL's generation batches, their policy
    versions, and the importance-sampling loss (module docstring)."""

    name, order = "offpolicy", 30

    @classmethod
    def wanted(cls, cfg, kwargs) -> bool:
        return cfg.max_async_level > 0

    def __init__(self, trainer, kwargs: dict, options: dict) -> None:
        super().__init__(trainer, kwargs, options)
        cfg = kwargs["args"]
        self.cfg = ImportanceConfig.from_object(cfg)
        self.trace: list[tuple[int, int, int]] = []
        """(step, oldest, newest policy version) of every batch trained, for tests and diagnostics."""
        self.worker: RolloutWorker | None = None
        self.transport: transport.Transport | None = None
        self.pending = None  # the generator's rollout of the generation batch being built
        self.submitted = -1
        self.prompt_batches = None
        self._generation_template = None  # FSDP2: the generator's plain copy, made before the Trainer shards the model
        self._saved_threads = None
        self.uses_engine = bool(cfg.use_vllm)  # read before the vLLM component (built after) hands TRL use_vllm off

    def setup(self) -> None:
        t = self.trainer
        episodes = getattr(t, "episode_source", None) is not None
        if (t.rollout_func is not None and not episodes) or t.tools or t.environment_factories is not None:
            raise ConfigError("--max_async_level >= 1 drives single-turn generation and the project's episode loop "
                              "(text and tool environments); not another rollout_func, or TRL's own tool loop (tools=)")
        if not hasattr(t.train_dataset, "__getitem__"):
            raise ConfigError("--max_async_level >= 1 needs an indexable (map-style) train dataset")
        if t.is_fsdp_enabled and not self.uses_engine:
            from trl_ext.offpolicy.sharded import is_sharded

            model = t.accelerator.unwrap_model(t.model)
            if is_sharded(model):
                raise RuntimeError("the policy is sharded already: the generator's plain copy cannot be made")
            self._generation_template = generation_copy(model)
        if not self.uses_engine:
            backend = t.args.generation_backend
            print(f"off-policy generator: {DESCRIPTIONS[backend]} (--generation_backend {backend})", flush=True)
        elif t.accelerator.is_main_process:  # one line per run
            servers = t.args.vllm_mode == "server"
            print(f"off-policy generator: {'the vLLM servers' if servers else 'a vLLM engine'} (--use_vllm; "
                  f"trl_ext.{'serve' if servers else 'vllm'}.engine)", flush=True)

    def callbacks(self) -> list:
        return [_Generator(self)]

    # ------------------------------------------------------------------ generator lifecycle
    def start(self) -> None:
        t = self.trainer
        args, start = t.args, t.state.global_step
        model = t.accelerator.unwrap_model(t.model)
        gathered = self._generation_template is not None
        engine = t.components.first("generator_transport", model)  # --use_vllm: an engine samples
        self.transport = engine if engine is not None else transport.Transport("in place")
        pusher = self.transport.pusher
        if engine is not None:
            gen_model, sampler = None, engine.sampler
            store = PolicyStore.of(engine.publisher)
            where = f"none: the vLLM engine loads each published checkpoint ({engine.publisher.why})"
        else:
            if gathered:  # FSDP2: the plain copy, loaded with the gathered whole weights
                from trl_ext.offpolicy.sharded import load_streamed

                gen_model, self._generation_template = self._generation_template, None
                gen_model.to(t.accelerator.device)  # made on the host before sharding: moved to the trainer's device
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
        if sampler is None:  # --generation_backend's sampler on the generator's copy
            sampler = make_sampler(args.generation_backend, gen_model)
        config = WorkerConfig(max_async_level=args.max_async_level, strict=args.strict_async_level, start_step=start,
                              seed=args.seed, rank=t.accelerator.process_index, num_threads=gen_threads)
        self.worker = RolloutWorker(sampler, store, transport.sampling_params(t), config,
                                    episode_fn=self._episode_fn() if getattr(t, "episode_source", None) else None, pusher=pusher,
                                    agree=self._every_process, autocast=t.accelerator.autocast)  # fmt: skip
        if pusher is not None:
            self.worker.publish(start, model)  # the starting policy, pushed into the servers
        self.prompt_batches = self._prompt_stream(start)
        self.submitted = start - 1
        self.worker.start()
        mode = "strict" if args.strict_async_level else "non-strict (in-flight updates)"
        print(f"off-policy: generator thread started at policy version {start}, max_async_level "
              f"{args.max_async_level}, {mode}, generator threads {gen_threads}, its copy {where}",
              flush=True)  # fmt: skip

    def _episode_fn(self):
        """Environments: the generator thread plays each batch's episodes (``trainer.episode_source``, text or tool
        environments) with its own tokenizer copy (a fast tokenizer is not safe to share between threads)."""
        from trl_ext.env.source import context_length

        t = self.trainer
        source, tok, limit = t.episode_source, copy.deepcopy(t.processing_class), context_length(t)

        def episodes(rows, sample_turn):
            return source.play(rows, tok, sample_turn, max_context=limit)

        return episodes

    def close(self) -> None:
        if self.worker is None:
            return
        self.worker.stop()
        self.transport.close()
        self.worker = None
        torch.set_num_threads(self._saved_threads)

    def _prompt_stream(self, start: int):
        """This process's rows of the generation batches, in the order TRL's RepeatSampler gives them, from batch
        ``start`` (resume). The sampler's order is global (``generation_batch_size`` counts every process); accelerate
        hands process r the r-th contiguous slice of each batch, and so does this stream."""
        t = self.trainer
        sampler = RepeatSampler(
            data_source=t.train_dataset, mini_repeat_count=t.num_generations,
            batch_size=t.args.generation_batch_size // t.num_generations, repeat_count=1,
            shuffle=t.shuffle_dataset, seed=t.args.seed,
        )  # fmt: skip
        index, size = 0, t.args.generation_batch_size
        local = size // t.accelerator.num_processes
        first = t.accelerator.process_index * local
        while True:
            order = list(sampler)
            for i in range(0, len(order) - size + 1, size):
                if index >= start:
                    yield [t.train_dataset[j] for j in order[i + first : i + first + local]]
                index += 1

    def _every_process(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every process (a collective)."""
        acc = self.trainer.accelerator
        if acc.num_processes == 1:
            return ok
        flag = torch.tensor([int(ok)], device=acc.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag.item())

    def publish(self, version: int) -> None:
        if self.worker is not None:
            self.worker.publish(version, self.trainer.accelerator.unwrap_model(self.trainer.model))

    # ------------------------------------------------------------------ 1. rollouts into TRL's batch
    def generation_rows(self, rows: list[dict]) -> list[dict]:
        """The generator's batch for this step (the generation batch TRL would have built is dropped)."""
        t = self.trainer
        if self.worker is None:
            raise RuntimeError("the off-policy generator is not running: it starts when training begins")
        step, worker = t.state.global_step, self.worker
        while self.submitted < step + t.args.max_async_level:
            self.submitted += 1
            batch = next(self.prompt_batches)
            prompt_ids, images, _ = compat.tokenize_prompts(t, [row["prompt"] for row in batch])
            if images is not None:
                raise ConfigError("--max_async_level >= 1 supports text prompts only")
            worker.submit(self.submitted, batch, prompt_ids)
        rollout = worker.get(step)
        oldest, newest = rollout.version_range()
        need = worker.required_version(step)
        if newest > step or oldest < need or (t.args.strict_async_level and oldest != newest):
            raise RuntimeError(f"batch {step} was sampled by policies {oldest}..{newest}; allowed {need}..{step}")
        self.trace.append((step, oldest, newest))
        self.pending = rollout
        return rollout.rows

    def generate(self, prompts: list, ctx: BatchContext) -> dict | None:
        rollout, self.pending = self.pending, None
        if rollout is None:
            return None
        if list(prompts) != [row["prompt"] for row in rollout.rows]:
            raise RuntimeError("prompts of the generation batch differ from the rollout's prompts")
        ctx.rollout = rollout
        own = {"prompt_ids": rollout.prompt_ids, "completion_ids": rollout.completion_ids, "logprobs": rollout.logprobs}
        if getattr(self.trainer, "episode_source", None):  # episodes played by the generator thread: env_mask,
            from trl_ext.env.source import take_episodes  # env_return; metrics logged here, as env_rollout

            extra = dict(rollout.extra)
            take_episodes(self.trainer, ctx, extra)
            own.update(extra)
        return own

    # ------------------------------------------------------------------ 3. scorer
    def score(self, batch: dict, ctx: BatchContext) -> None:
        """The policy version of every completion token (``behaviour_versions``) joins the batch and the policy lag
        is logged; nothing when the batch did not come from the generator thread."""
        rollout = ctx.rollout
        if rollout is None:
            return
        t = self.trainer
        versions = pad([torch.tensor(v) for v in rollout.versions], padding_value=0, padding_side="right",
                       pad_to_multiple_of=t.pad_to_multiple_of).to(batch["completion_ids"].device)  # fmt: skip
        if versions.shape != batch["completion_ids"].shape or "sampling_per_token_logps" not in batch:
            raise RuntimeError("rollout versions / behaviour log-probs do not line up with the completions")
        batch["behaviour_versions"] = versions
        lag = policy_lag_stats(versions, loss_mask(batch), t.state.global_step)
        self._log_over_processes({f"offpolicy/{name}": value for name, value in lag.items()})

    def batch_keys(self, ctx: BatchContext) -> dict[str, bool]:
        return {"offpolicy": ctx.rollout is not None}

    # ------------------------------------------------------------------ loss
    def loss(self, model, inputs: dict) -> tuple[torch.Tensor, LossTokens] | None:
        """k >= 1, training: prime-rl's masked importance-sampling loss on the behaviour log-probs, plus the reference
        KL on the kept tokens (module docstring)."""
        t = self.trainer
        if not t.model.training:
            return None
        if "sampling_per_token_logps" not in inputs:
            raise RuntimeError("off-policy loss without behaviour log-probs: the batch did not come from the generator")
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        mask = loss_mask(inputs)
        lp, entropies, _ = compat.per_token_logps(t, model, input_ids, attention_mask, completion_ids.size(1),
                                                  compute_entropy=True)
        accumulation = t.current_gradient_accumulation_steps
        num_items = None
        if t.loss_type in ("dapo", "token"):  # TRL: tokens of the generation batch, rescaled to one window
            num_items = inputs["num_items_in_batch"] / t.accelerator.num_processes
            num_items = num_items * accumulation / t.args.steps_per_generation
        kwargs = {"num_items_in_batch": num_items, "max_completion_length": t.max_completion_length}
        out = importance_loss(lp, inputs["sampling_per_token_logps"], inputs["advantages"], mask,
                              self.cfg, t.loss_type, **kwargs)  # fmt: skip
        loss = out.loss
        logged = {f"offpolicy/{name}": value for name, value in out.metrics.items()}
        if t.beta != 0.0:  # kept tokens only, weighted by the policy term's (clipped) ratio: offpolicy.importance
            per_token_kl = reference_kl(lp, inputs["ref_per_token_logps"], inputs["sampling_per_token_logps"], mask,
                                        out.masks["keep"], self.cfg,
                                        bias_correction=t.args.use_bias_correction_kl)  # fmt: skip
            loss = loss + t.beta * NORMALISATIONS.get(t.loss_type)(per_token_kl, mask, **kwargs)
            logged["kl"] = per_token_kl.detach().sum() / mask.sum().clamp(min=1)
        if t.loss_type not in ("dapo", "token"):
            loss = loss / accumulation
        logged["entropy"] = (entropies.detach() * mask).sum() / mask.sum().clamp(min=1)
        self._log_over_processes(logged)
        return loss, LossTokens(lp.detach(), out.masks, self.cfg.ratio_type)

    def _log_over_processes(self, metrics: dict[str, torch.Tensor]) -> None:
        """Training metrics over every process (TRL gathers its own the same way), in one gather: the mean of the
        processes' values, the largest for a ``*_max``; the values themselves on one process."""
        names, t = list(metrics), self.trainer
        rows = t.accelerator.gather(torch.stack([metrics[k].detach().float().reshape(()) for k in names])[None])
        for name, column in zip(names, rows.unbind(1), strict=True):
            t.metrics("train")[name].append((column.max() if name.endswith("_max") else column.mean()).item())
