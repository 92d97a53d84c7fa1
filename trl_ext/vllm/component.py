"""vLLM generation as a component (`VLLMGeneration`): the engine behind TRL's ``--use_vllm``.

- ``--max_async_level 0``: TRL's own colocate engine (in `engine_dtype`: ``--vllm_dtype``) and generation path,
  with the project's weight sync (`sync_colocate`): the policy's merged weights (``trl_ext.vllm.weights``: PEFT LoRA
  and dual LoRA at their current scales), loaded in place on CUDA (TRL's way) and through vLLM's ``reload_weights``
  on CPU, where vLLM prepacks the linear weights and in-place loading fails.
- ``--max_async_level >= 1``: TRL builds no engine (it is given the arguments with ``use_vllm`` off, so it neither
  starts one nor recomputes old log-probs); the off-policy generator samples with its own `VLLMEngine`
  (`trl_ext.transport.generator_transport`), loading each published checkpoint (``trl_ext.vllm.publish``: written
  once per node per step, streamed from the trained, possibly FSDP2-sharded, model).
- ``--vllm_mode server`` (either k): the policy's vLLM servers (``trl_ext.serve``) instead of an engine in process:
  the same published checkpoints, written under the servers' weights directory, loaded by each request's version.
- ``--vllm_lora_sync`` (``trl_ext.vllm.args.lora_sync_plan``, checked again on the built model here): with adapters,
  every engine starts with LoRA enabled, the base weights go once and each version is its LoRA adapter
  (``trl_ext.vllm.lora``); TRL's colocate engine then samples through `AdapterLLM`, which names the adapter.
"""

from __future__ import annotations

import copy
import time
from contextlib import nullcontext

import torch

from trl_ext import compat, transport
from trl_ext.components import Component, register
from trl_ext.registry import ConfigError
from trl_ext.vllm.dtype import engine_dtype
from trl_ext.vllm.engine import AdapterLoads, cpu_settings, lora_settings, shared_llm
from trl_ext.vllm.weights import base_of, merged_weights, unmergeable


@torch.no_grad()
def sync_colocate(generation, model) -> int:
    """Load ``model``'s merged weights into TRL's colocate engine (``generation``: TRL's VLLMGeneration), streamed one
    module at a time from the (FSDP2-sharded) model (``trl_ext.vllm.weights.merged_weights``; every process runs it:
    each has its engine); returns the bytes loaded. Sleep mode's weights are woken first, as TRL's ``sync_weights``
    does."""
    compat.wake_colocate_weights(generation)  # sleep mode: load_weights into released memory would crash (trl 5142)
    runner = compat.colocate_model_runner(generation)
    sent = [0]

    def counted():
        for name, tensor in merged_weights(model):
            sent[0] += tensor.numel() * tensor.element_size()
            yield name, tensor

    weights = counted()
    if torch.cuda.is_available():
        for name, tensor in weights:
            runner.model.load_weights([(name, tensor)])  # in place, one tensor at a time, as TRL's own sync
    else:  # CPU vLLM prepacks its linear weights: a reload (layer by layer) repacks them
        runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    generation.llm.reset_prefix_cache()
    return sent[0]


class AdapterLLM:
    """TRL's colocate ``vllm.LLM`` whose ``generate`` names the current version's adapter (``adapters``:
    ``trl_ext.vllm.engine.AdapterLoads``); everything else is the engine's own."""

    def __init__(self, llm, adapters) -> None:
        self._llm, self._adapters = llm, adapters

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def generate(self, *args, **kwargs):
        if self._adapters.request is None:
            raise RuntimeError("the colocate engine has no adapter version loaded: its base weights are not the "
                               "policy")
        return self._llm.generate(*args, lora_request=self._adapters.request, **kwargs)


def sync_adapter(generation, model, publisher, adapters, version: int) -> None:
    """The policy's adapters into TRL's colocate engine as LoRA version ``version``: published (the base weights
    too, the first time) and taken by every process's engine (``trl_ext.vllm.engine.AdapterLoads``)."""
    compat.wake_colocate_weights(generation)
    publisher.publish(version, model)
    adapters.load(generation.llm._llm, publisher.snapshot(version), version)


@register
class VLLMGeneration(Component):
    """Routes ``--use_vllm`` to TRL's colocate engine (k = 0), to the policy's servers (``--vllm_mode server``) or
    to the off-policy generator's engine (k >= 1: `generator_transport`)."""

    name, order = "vllm", 35  # after the off-policy component: it hands TRL the config with use_vllm off

    @classmethod
    def wanted(cls, cfg, kwargs) -> bool:
        return bool(cfg.use_vllm)

    def __init__(self, trainer, kwargs: dict, options: dict) -> None:
        super().__init__(trainer, kwargs, options)
        config = kwargs["args"]
        self.servers_on = config.vllm_mode == "server"
        self.offpolicy = config.max_async_level >= 1
        self.settings = cpu_settings() if not (torch.cuda.is_available() or self.servers_on) else {}
        self.dtype: str | None = None  # the colocate engine's dtype (set while TRL builds it)
        self.servers: transport.PolicyServers | None = None
        self.transport: transport.Transport | None = None  # k = 0 on the servers, or k = 0 colocate with adapters
        self.adapters: AdapterLoads | None = None  # k = 0 colocate with adapters: the version TRL's engine samples
        self._lora_decided = False
        self.generator: transport.Transport | None = None  # k >= 1: the generator's transport
        if self.offpolicy or self.servers_on:
            config = kwargs["args"] = copy.copy(config)
            config.use_vllm = False  # TRL starts no engine and no server client: `setup` / `generator_transport`

    def building(self, kwargs: dict):
        """While TRL builds its colocate engine: ``vllm.LLM`` called with `engine_dtype` (TRL passes none) and
        ``--vllm_enforce_eager``, shared with the process's later trainers (`trl_ext.vllm.engine.shared_llm`)."""
        if self.offpolicy or self.servers_on:
            return nullcontext()
        t = self.trainer

        def build(llm, **kwargs):
            self._decide_lora_sync()
            kwargs.setdefault("dtype", engine_dtype(t.args, t.model))
            kwargs.setdefault("enforce_eager", t.args.vllm_enforce_eager)
            kwargs.update(lora_settings(t.args.vllm_adapter_rank, 0))
            self.dtype = kwargs["dtype"]
            return shared_llm(llm, **kwargs)

        return compat.swap_trl_vllm_llm(lambda llm: lambda **kwargs: build(llm, **kwargs))

    def setup(self) -> None:
        t = self.trainer
        self._decide_lora_sync()
        if self.servers_on:
            self.servers = transport.connect_policy_servers(t)
            if not self.offpolicy:  # TRL's generation path, IS correction and sync points, on the servers
                self.transport = transport.server_transport(t, self.servers)
                from trl_ext.serve.generation import ServerGeneration

                publisher = self.transport.pusher or self.transport.publisher
                compat.install_vllm_generation(t, ServerGeneration(t, self.transport.sampler, publisher,
                                                                   transport.sampling_params(t)), mode="server")
        from trl_ext.vllm.args import check_tied_head, head_adapter

        check_tied_head(base_of(t.model).config, head_adapter(t.model))
        if t.args.vllm_adapter_rank is None and (reason := unmergeable(t.model)) is not None:
            raise ConfigError(f"--use_vllm: the policy's adapters cannot be merged into the weights vLLM loads: "
                              f"{reason}")
        if not (self.offpolicy or self.servers_on):  # TRL's colocate engine: the project's weight sync
            generation = t.vllm_generation
            if t.args.vllm_adapter_rank is None:
                def sync() -> None:  # the policy as prepared for training, read at every sync
                    start = time.perf_counter()
                    nbytes = sync_colocate(generation, t.accelerator.unwrap_model(t.model))
                    metrics = compat.trl_metrics(t, "train")
                    metrics["vllm/publish_bytes"].append(float(nbytes or 0))
                    metrics["vllm/publish_seconds"].append(time.perf_counter() - start)
            else:
                self.adapters = AdapterLoads()
                generation.llm = AdapterLLM(generation.llm, self.adapters)
                policy = t.accelerator.unwrap_model(t.model)
                self.transport = transport.Transport("LoRA adapter files", publisher=transport.publisher(t, 0, policy))

                def sync() -> None:
                    sync_adapter(generation, t.accelerator.unwrap_model(t.model), self.transport.publisher,
                                 self.adapters, t.state.global_step)

            compat.replace_colocate_sync(generation, sync)
        if t.accelerator.is_main_process:  # one line per run, not per process
            print(self.describe(), flush=True)

    def adapter_eval_sampler(self):
        """The routing eval's sampler on this run's vLLM engine (``trl_ext.vllm.eval_sampler``) with adapters: TRL's
        colocate engine at ``--max_async_level 0``, or the servers at any k (the generation's publisher writes the
        eval's adapters beside its versions), when the eval's sampling is temperature alone; else None (the eval
        samples with transformers: train.log's header says which)."""
        t = self.trainer
        if self.eval_on_transformers() is not None:
            return None
        from trl_ext.vllm.engine import VLLMEngine
        from trl_ext.vllm.eval_sampler import AdapterEvalSampler

        source = self.generator if self.offpolicy else self.transport
        if self.servers_on:  # an engine of its own: the eval's loads leave the generation's version alone
            from trl_ext.serve.engine import ServerEngine

            engine = ServerEngine(source.sampler.engine.replicas, t.accelerator.process_index)
        else:
            loads = AdapterLoads()
            loads.base = self.adapters.base  # loaded by the generation's syncs (the same publisher's base)
            engine = VLLMEngine.over(t.vllm_generation.llm._llm, loads)
        return AdapterEvalSampler(engine, source.publisher, transport.sampling_params(t),
                                  compat.trl_tokenizer(t))  # fmt: skip

    def eval_on_transformers(self) -> str | None:
        """Why the routing eval samples with transformers, not this run's vLLM engine; None: on the engine."""
        t, args = self.trainer, self.trainer.args
        if args.vllm_adapter_rank is None:  # (adapters travel as files: a pushed run's versions are merged)
            return "versions go merged (--vllm_lora_sync)"
        if self.offpolicy and not self.servers_on:
            return "at --max_async_level >= 1 the in-process engine is the generator's, sampling in its own thread"
        if args.vllm_enable_sleep_mode:
            return "--vllm_enable_sleep_mode: TRL's engine sleeps between its generations"
        params = transport.sampling_params(t)
        if params.top_k or params.top_p != 1.0 or args.min_p or args.repetition_penalty != 1.0 or \
                args.generation_kwargs:  # fmt: skip
            return "the eval's sampling has more than a temperature (top-k / top-p / min-p / penalties)"
        return None

    def _decide_lora_sync(self) -> None:
        """``--vllm_lora_sync`` decided on the built policy (``trl_ext.vllm.args.lora_sync_of_model``), once, before
        any engine starts: adapters that cannot be one LoRA adapter go merged under 'auto' (the reason in
        train.log's header) and are refused under 'adapter'."""
        if self._lora_decided:
            return
        from trl_ext.vllm.args import lora_sync_of_model

        args = self.trainer.args
        args.vllm_adapter_rank, args.vllm_lora_why = lora_sync_of_model(args, self.trainer.model)
        self._lora_decided = True

    def describe(self) -> str:
        """train.log's line on where vLLM generates."""
        mode = "synchronous" if not self.offpolicy else "off-policy"
        if self.servers_on:
            info = self.servers.infos[0]
            how = self.trainer.args.vllm_weight_transfer
            if how != "files":
                how = f"weights pushed over {how}"
            else:
                how = "checkpoints they reload" if self.trainer.args.vllm_adapter_rank is None else "adapters they take"
            return (f"vLLM generation: the vLLM servers {', '.join(r.url for r in self.servers.replicas)} ({how}), "
                    f"{mode}; {info['dtype']}, max_model_len {info['max_model_len']}{self._lora()}")
        from vllm import __version__

        where = ("the off-policy generator's engine" if self.offpolicy
                 else f"TRL's {self.trainer.args.vllm_mode} engine ({self.dtype})")
        return f"vLLM generation: {where}; vllm {__version__}; {self.settings or 'CUDA'}{self._lora()}"

    def _lora(self) -> str:
        args = self.trainer.args
        out = f"; policy versions as {args.vllm_lora_why}" if args.vllm_lora_why else ""
        if getattr(args, "eval_routing_steps", 0) and getattr(args, "dual_lora", False):
            reason = self.eval_on_transformers()
            out += ("; the routing eval's modes as LoRA adapters on this engine" if reason is None
                    else f"; the routing eval samples with transformers ({reason})")
        return out

    def generator_transport(self, policy) -> transport.Transport | None:
        if not self.offpolicy:
            return None
        self.generator = transport.generator_transport(self.trainer, policy, self.servers)  # the eval's too (servers)
        return self.generator

    def close(self) -> None:  # k = 0 with servers: the published checkpoints go with the run
        if self.transport is not None:
            self.transport.close()
