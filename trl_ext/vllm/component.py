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
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import torch

from trl_ext import compat, transport
from trl_ext.components import Component, register
from trl_ext.registry import ConfigError
from trl_ext.vllm.dtype import engine_dtype
from trl_ext.vllm.engine import cpu_settings, shared_llm
from trl_ext.vllm.weights import base_of, merged_weights, unmergeable


@torch.no_grad()
def sync_colocate(generation, model) -> None:
    """Load ``model``'s merged weights into TRL's colocate engine (``generation``: TRL's VLLMGeneration), streamed one
    module at a time from the (FSDP2-sharded) model (``trl_ext.vllm.weights.merged_weights``; every process runs it:
    each has its engine). Sleep mode's weights are woken first, as TRL's ``sync_weights`` does."""
    compat.wake_colocate_weights(generation)  # sleep mode: load_weights into released memory would crash (trl 5142)
    runner = compat.colocate_model_runner(generation)
    weights = merged_weights(model)
    if torch.cuda.is_available():
        for name, tensor in weights:
            runner.model.load_weights([(name, tensor)])  # in place, one tensor at a time, as TRL's own sync
    else:  # CPU vLLM prepacks its linear weights: a reload (layer by layer) repacks them
        runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    generation.llm.reset_prefix_cache()


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
        self.transport: transport.Transport | None = None  # k = 0 on the servers
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
            kwargs.setdefault("dtype", engine_dtype(t.args, t.model))
            kwargs.setdefault("enforce_eager", t.args.vllm_enforce_eager)
            self.dtype = kwargs["dtype"]
            return shared_llm(llm, **kwargs)

        return compat.swap_trl_vllm_llm(lambda llm: lambda **kwargs: build(llm, **kwargs))

    def setup(self) -> None:
        t = self.trainer
        if self.servers_on:
            self.servers = transport.connect_policy_servers(t)
            if not self.offpolicy:  # TRL's generation path, IS correction and sync points, on the servers
                self.transport = transport.server_transport(t, self.servers)
                from trl_ext.serve.generation import ServerGeneration

                publisher = self.transport.pusher or self.transport.publisher
                compat.install_vllm_generation(t, ServerGeneration(t, self.transport.sampler, publisher,
                                                                   transport.sampling_params(t)), mode="server")
        if t.accelerator.is_main_process:  # one line per run, not per process
            print(self.describe(), flush=True)
        from trl_ext.vllm.args import check_tied_head, head_adapter

        check_tied_head(base_of(t.model).config, head_adapter(t.model))
        if (reason := unmergeable(t.model)) is not None:
            raise ConfigError(f"--use_vllm: the policy's adapters cannot be merged into the weights vLLM loads: "
                              f"{reason}")
        if not (self.offpolicy or self.servers_on):  # TRL's colocate engine: the project's weight sync
            generation = t.vllm_generation
            def sync() -> None:  # the policy as prepared for training, read at every sync
                sync_colocate(generation, t.accelerator.unwrap_model(t.model))

            compat.replace_colocate_sync(generation, sync)

    def describe(self) -> str:
        """train.log's line on where vLLM generates."""
        mode = "synchronous" if not self.offpolicy else "off-policy"
        if self.servers_on:
            info = self.servers.infos[0]
            how = self.trainer.args.vllm_weight_transfer
            how = "checkpoints they reload" if how == "files" else f"weights pushed over {how}"
            return (f"vLLM generation: the vLLM servers {', '.join(r.url for r in self.servers.replicas)} ({how}), "
                    f"{mode}; {info['dtype']}, max_model_len {info['max_model_len']}")
        from vllm import __version__

        where = ("the off-policy generator's engine" if self.offpolicy
                 else f"TRL's {self.trainer.args.vllm_mode} engine ({self.dtype})")
        return f"vLLM generation: {where}; vllm {__version__}; {self.settings or 'CUDA'}"

    def generator_transport(self, policy) -> transport.Transport | None:
        return transport.generator_transport(self.trainer, policy, self.servers) if self.offpolicy else None

    def close(self) -> None:  # k = 0 with servers: the published checkpoints go with the run
        if self.transport is not None:
            self.transport.close()
