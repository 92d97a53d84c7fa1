"""Trainer plumbing of vLLM generation (`VLLMMixin`): the engine behind TRL's ``--use_vllm``.

- ``--max_async_level 0``: TRL's own colocate engine (in `engine_dtype`: ``--vllm_dtype``) and generation path,
  with the project's weight sync (`sync_colocate`): the policy's merged weights (``trl_ext.vllm.weights``: PEFT LoRA
  and dual LoRA at their current scales), loaded in place on CUDA (TRL's way) and through vLLM's ``reload_weights``
  on CPU, where vLLM prepacks the linear weights and in-place loading fails.
- ``--max_async_level >= 1``: TRL builds no engine (it is given the arguments with ``use_vllm`` off, so it neither
  starts one nor recomputes old log-probs); the off-policy generator samples with its own `VLLMEngine`
  (`rollout_engine`), loading each published checkpoint (``trl_ext.vllm.publish``: written once per node per step,
  streamed from the trained, possibly FSDP2-sharded, model).
- ``--vllm_mode server`` (either k): the policy's vLLM servers (``trl_ext.serve``) instead of an engine in process:
  the same published checkpoints, written under the servers' weights directory, loaded by each request's version.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager, nullcontext

import torch

from trl_ext.registry import ConfigError
from trl_ext.vllm.engine import VLLMEngine, VLLMSampler, cpu_settings, shared_llm
from trl_ext.vllm.weights import base_of, merged_weights, unmergeable


def policy_dtype(model) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def engine_dtype(args, model) -> str:
    """The dtype an in-process vLLM engine runs ``model`` in: ``--vllm_dtype``; its "auto" is bfloat16 on CUDA and
    the policy's own dtype without (vLLM's own "auto" would downcast a float32 model to bfloat16,
    ``vllm.config.model._resolve_auto_dtype``, and the CPU tests check the log-probs to float error)."""
    if args.vllm_dtype != "auto":
        return args.vllm_dtype
    return "bfloat16" if torch.cuda.is_available() else policy_dtype(model)


@contextmanager
def _engine_dtype(trainer):
    """While TRL builds its colocate engine: ``vllm.LLM`` called with `engine_dtype` (TRL passes
    none) and ``--vllm_enforce_eager``, shared with the process's later trainers (`trl_ext.vllm.engine.shared_llm`)."""
    from trl.generation import vllm_generation

    llm = vllm_generation.LLM

    def build(**kwargs):
        kwargs.setdefault("dtype", engine_dtype(trainer.args, trainer.model))
        kwargs.setdefault("enforce_eager", trainer.args.vllm_enforce_eager)
        trainer.vllm_dtype = kwargs["dtype"]
        return shared_llm(llm, **kwargs)

    vllm_generation.LLM = build
    try:
        yield
    finally:
        vllm_generation.LLM = llm


@torch.no_grad()
def sync_colocate(generation, model) -> None:
    """Load ``model``'s merged weights into TRL's colocate engine (``generation``: TRL's VLLMGeneration), streamed one
    module at a time from the (FSDP2-sharded) model (``trl_ext.vllm.weights.merged_weights``; every process runs it:
    each has its engine). Sleep mode's weights are woken first, as TRL's ``sync_weights`` does."""
    if generation.enable_sleep_mode:  # TRL: load_weights into released memory would crash (trl issue 5142)
        from trl.generation.vllm_generation import empty_cache

        empty_cache()
        generation.llm.wake_up(tags=["weights"])
        generation._llm_weights_sleeping = False
    runner = generation.llm.llm_engine.model_executor.driver_worker.model_runner
    weights = merged_weights(model)
    if torch.cuda.is_available():
        for name, tensor in weights:
            runner.model.load_weights([(name, tensor)])  # in place, one tensor at a time, as TRL's own sync
    else:  # CPU vLLM prepacks its linear weights: a reload (layer by layer) repacks them
        runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    generation.llm.reset_prefix_cache()


class VLLMMixin:
    """Routes ``--use_vllm`` to TRL's colocate engine (k = 0) or to the off-policy generator's engine (k >= 1)."""

    vllm_offpolicy = False  # k >= 1 with --use_vllm: the generator's engine samples (also without __init__)

    def __init__(self, *args, **kwargs):
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        use_vllm = bool(getattr(config, "use_vllm", False))
        servers = use_vllm and getattr(config, "vllm_mode", None) == "server"
        if use_vllm:
            self.vllm_settings = cpu_settings() if not (torch.cuda.is_available() or servers) else {}
        self.vllm_offpolicy = use_vllm and getattr(config, "max_async_level", 0) >= 1
        if self.vllm_offpolicy or servers:
            config = copy.copy(config)
            config.use_vllm = False  # TRL starts no engine and no server client: `rollout_engine` / `_connect_servers`
            if "args" in kwargs:
                kwargs["args"] = config
            else:
                args = (*args[:2], config, *args[3:])
        self.policy_replicas = None
        with _engine_dtype(self) if use_vllm and not (self.vllm_offpolicy or servers) else nullcontext():
            super().__init__(*args, **kwargs)
        if servers:
            self._connect_servers()
        if use_vllm and self.accelerator.is_main_process:  # one line per run, not per process
            if servers:
                where = f"the vLLM servers {', '.join(r.url for r in self.policy_replicas)}"
                how = self.args.vllm_weight_transfer
                how = "checkpoints they reload" if how == "files" else f"weights pushed over {how}"
                print(f"vLLM generation: {where} ({how}), "
                      f"{'synchronous' if not self.vllm_offpolicy else 'off-policy'}; "
                      f"{self.policy_servers_info[0]['dtype']}, max_model_len "
                      f"{self.policy_servers_info[0]['max_model_len']}", flush=True)  # fmt: skip
            else:
                where = ("the off-policy generator's engine" if self.vllm_offpolicy
                         else f"TRL's {self.args.vllm_mode} engine ({self.vllm_dtype})")
                from vllm import __version__

                print(f"vLLM generation: {where}; vllm {__version__}; {self.vllm_settings or 'CUDA'}", flush=True)
        if use_vllm:
            from trl_ext.vllm.args import check_tied_head, head_adapter

            check_tied_head(base_of(self.model).config, head_adapter(self.model))
        if use_vllm and (reason := unmergeable(self.model)) is not None:
            raise ConfigError(f"--use_vllm: the policy's adapters cannot be merged into the weights vLLM loads: "
                              f"{reason}")
        if self.use_vllm and self.args.vllm_mode == "colocate":
            generation, trainer = self.vllm_generation, self
            generation.sync_weights = lambda: sync_colocate(generation, trainer.accelerator.unwrap_model(trainer.model))

    def _connect_servers(self) -> None:
        """``--vllm_mode server``: the policy's replicas (``trl_ext.serve``), checked (`check_replicas`: tokenizer,
        max_model_len, log-prob mode, weights directory); at k = 0 TRL's ``vllm_generation`` becomes the project's
        `ServerGeneration` (TRL's generation path, IS correction and sync points unchanged)."""
        import os

        from trl_ext.serve.args import server_urls
        from trl_ext.serve.client import Replica
        from trl_ext.serve.engine import ServerEngine, ServerGeneration, check_replicas
        from trl_ext.vllm.publish import CheckpointPublisher, model_bytes

        urls = server_urls(self.args)
        rank = self.accelerator.process_index
        urls = urls[rank % len(urls):] + urls[: rank % len(urls)]  # each process starts its rows on another replica
        self.policy_replicas = [Replica(u, os.environ.get("VLLM_API_KEY"), self.args.vllm_request_timeout)
                                for u in urls]  # fmt: skip
        base = base_of(self.accelerator.unwrap_model(self.model))
        infos = check_replicas(self.policy_replicas, self.processing_class, self.max_completion_length + 1,
                               "policy server", base.config)  # a longer prompt is the server's 400: a ServerError
        pushed = self.args.vllm_weight_transfer != "files"
        roots = {i["weights_dir"] for i in infos}
        fallback = self.vllm_offpolicy and self.args.strict_async_level  # strict k >= 1: a checkpoint when a
        # generator still owes batches of an older policy (in flight every version is pushed)
        if (not pushed or fallback) and (len(roots) != 1 or None in roots):
            raise ConfigError(f"the policy servers load checkpoints from {sorted(map(str, roots))}: start every one "
                              "with the same TRL_EXT_WEIGHTS_DIR (layout.py does)")  # fmt: skip
        self.policy_servers_info = infos
        if self.vllm_offpolicy:
            return
        if pushed:  # process 0 pushes each version into every replica
            publisher = self._pusher_for(self.accelerator.unwrap_model(self.model))
        else:
            publisher = CheckpointPublisher(self.accelerator, 0, model_bytes(base), root=roots.pop())
        sampler = VLLMSampler(ServerEngine(self.policy_replicas, self.accelerator.process_index), None)
        self.use_vllm, self.vllm_mode, self._last_loaded_step = True, "server", -1
        self.vllm_generation = ServerGeneration(self, sampler, publisher)

    def _pusher_for(self, policy):
        """``--vllm_weight_transfer nccl|gloo``: the pusher of ``policy`` into the policy servers (every process joins
        the transfer groups; nothing is gathered until the first publish); None with files."""
        if self.args.vllm_weight_transfer == "files":
            return None
        from trl_ext.serve.transfer import WeightPusher

        return WeightPusher(self.policy_replicas, self.policy_servers_info, self.args.vllm_weight_transfer, policy,
                            self.accelerator.process_index, self.args.weight_transfer_address,
                            self.args.vllm_request_timeout)  # fmt: skip

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:  # k = 0 with servers: the published checkpoints go with the run
            generation = getattr(self, "vllm_generation", None)
            if generation is not None and hasattr(generation, "publisher"):
                generation.publisher.close()

    def rollout_engine(self, policy):
        """``(sampler, publisher, pusher)`` of the off-policy generator with ``--use_vllm``: a `VLLMSampler` over this
        process's `VLLMEngine`, or over the policy's servers (``--vllm_mode server``), the checkpoint publisher
        (``trl_ext.vllm.publish``) and, with ``--vllm_weight_transfer nccl|gloo``, the servers' pusher
        (``trl_ext.serve.transfer``); None without vLLM."""
        if not self.vllm_offpolicy:
            return None
        if self.policy_replicas is not None:
            from trl_ext.serve.engine import ServerEngine
            from trl_ext.vllm.publish import CheckpointPublisher, model_bytes

            root = self.policy_servers_info[0]["weights_dir"]  # None: in flight with pushes (never written)
            publisher = CheckpointPublisher(self.accelerator, self.args.max_async_level, model_bytes(base_of(policy)),
                                            root=root)  # fmt: skip
            inflight = None if self.args.strict_async_level else self.args.vllm_inflight_tokens
            engine = ServerEngine(self.policy_replicas, self.accelerator.process_index)
            return VLLMSampler(engine, inflight), publisher, self._pusher_for(policy)
        from trl_ext.vllm.placement import engine_placement
        from trl_ext.vllm.publish import CheckpointPublisher, model_bytes

        args = self.args
        base = base_of(policy)
        devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
        acc = self.accelerator
        place = engine_placement(acc.local_process_index, acc.num_processes, devices, args.vllm_gpu_memory_utilization)
        max_len = args.vllm_max_model_length or getattr(base.config, "max_position_embeddings", None)
        engine = VLLMEngine(
            base.name_or_path, dtype=engine_dtype(args, base), max_model_len=max_len,
            seed=args.seed + self.accelerator.process_index, gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            trust_remote_code=args.trust_remote_code, enforce_eager=args.vllm_enforce_eager,
            placement=place.llm_kwargs,
        )  # fmt: skip
        print(f"vLLM engine of process {self.accelerator.process_index}: {engine_dtype(args, base)} (the policy "
              f"{policy_dtype(base)}), on {place.device}, "
              f"max_model_len {max_len}", flush=True)  # fmt: skip
        inflight = None if args.strict_async_level else args.vllm_inflight_tokens
        publisher = CheckpointPublisher(self.accelerator, args.max_async_level, model_bytes(base))
        return VLLMSampler(engine, inflight), publisher, None
