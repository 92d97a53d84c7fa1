"""How a policy version reaches the sampler that generates with it: the one place that chooses.

- **in place**: the sampler runs on a copy of the policy that the trainer writes each version into (the off-policy
  generator's copy, `trl_ext.offpolicy.worker`; TRL's colocate vLLM engine, `trl_ext.vllm.component.sync_colocate`);
- **files**: each version is published as a checkpoint (`trl_ext.vllm.publish.CheckpointPublisher`) that an
  in-process vLLM engine or the policy's vLLM servers load by version;
- **push over gloo / NCCL**: each version is pushed into the servers with vLLM's weight-transfer backends
  (`trl_ext.serve.transfer.WeightPusher`); a strict generator still owing batches of an older version falls back to
  files (the checkpoint publisher is built beside the pusher).

`generator_transport` chooses for the off-policy generator (``--max_async_level >= 1``), `server_transport` for
TRL's generation on the servers (k = 0); `connect_policy_servers` connects and checks the servers both use.
prime-rl's ``setup_weight_broadcast`` is the same idea: one function chooses, one module per transport.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from trl_ext import compat
from trl_ext.env.episodes import answer_stop_sequences
from trl_ext.interfaces import SamplingParams
from trl_ext.registry import ConfigError
from trl_ext.vllm.weights import base_of


@dataclass
class Transport:
    """A sampler and how each policy version reaches it."""

    how: str
    """``"in place"``, ``"files"``, ``"push over gloo"`` or ``"push over nccl"`` (train.log says which)."""
    sampler: object | None = None
    """The sampler (`trl_ext.interfaces.Sampler`); None: the generator samples with its own copy (in place)."""
    publisher: object | None = None
    """Writes each version's checkpoint (`trl_ext.interfaces.Publisher`), or None."""
    pusher: object | None = None
    """Pushes each version into the servers (`trl_ext.interfaces.Publisher`), or None."""

    def close(self) -> None:
        for p in (self.publisher, self.pusher):
            if p is not None:
                p.close()


@dataclass
class PolicyServers:
    """The policy's vLLM servers as this process sees them: its replicas (its rows start on its own one) and what
    each said it runs (`trl_ext.serve.client.check_replicas`)."""

    replicas: list
    infos: list[dict]


def sampling_params(trainer) -> SamplingParams:
    """The sampling settings of the project's samplers and engines (the generator's, the servers')."""
    args = trainer.args
    return SamplingParams(
        max_new_tokens=trainer.max_completion_length, temperature=trainer.temperature, top_k=args.top_k or 0,
        top_p=args.top_p, eos_token_ids=tuple(trainer.eos_token_ids),
        pad_token_id=compat.trl_tokenizer(trainer).pad_token_id,
        stop_sequences=answer_stop_sequences(trainer.processing_class) if args.env and not args.tool_env else (),
    )  # fmt: skip


def connect_policy_servers(trainer) -> PolicyServers:
    """``--vllm_mode server``: the policy's replicas (``trl_ext.serve``), checked (tokenizer, max_model_len,
    log-prob mode; one weights directory when a version may travel as files)."""
    from trl_ext.serve.args import server_urls
    from trl_ext.serve.client import Replica, check_replicas

    args = trainer.args
    urls = server_urls(args)
    rank = trainer.accelerator.process_index
    urls = urls[rank % len(urls):] + urls[: rank % len(urls)]  # each process starts its rows on another replica
    replicas = [Replica(u, os.environ.get("VLLM_API_KEY"), args.vllm_request_timeout,
                        args.vllm_server_restart_timeout) for u in urls]
    base = base_of(trainer.accelerator.unwrap_model(trainer.model))
    infos = check_replicas(replicas, trainer.processing_class, trainer.max_completion_length + 1, "policy server",
                           base.config)  # a longer prompt is the server's 400: a ServerError  # fmt: skip
    pushed = args.vllm_weight_transfer != "files"
    rank = args.vllm_adapter_rank
    for replica, info in zip(replicas, infos, strict=True):
        if rank is not None and (info.get("max_lora_rank") or 0) < rank:
            raise ConfigError(f"{replica} serves LoRA adapters up to rank {info.get('max_lora_rank')}, and this run "
                              f"sends its versions as adapters of rank {rank} ({args.vllm_lora_why}): start the "
                              f"servers with --enable-lora --max-lora-rank {rank} (layout.py does), or pass "
                              "--vllm_lora_sync merged")  # fmt: skip
    roots = {i["weights_dir"] for i in infos}
    fallback = args.max_async_level >= 1 and args.strict_async_level  # strict k >= 1: a checkpoint when a
    # generator still owes batches of an older policy (in flight every version is pushed)
    if (not pushed or fallback) and (len(roots) != 1 or None in roots):
        raise ConfigError(f"the policy servers load checkpoints from {sorted(map(str, roots))}: start every one "
                          "with the same TRL_EXT_WEIGHTS_DIR (layout.py does)")  # fmt: skip
    return PolicyServers(replicas, infos)


def _pusher(trainer, servers: PolicyServers, policy):
    """``--vllm_weight_transfer nccl|gloo``: the pusher of ``policy`` into the servers (every process joins the
    transfer groups; nothing is gathered until the first publish); None with files."""
    args = trainer.args
    if args.vllm_weight_transfer == "files":
        return None
    from trl_ext.serve.transfer import WeightPusher

    return WeightPusher(servers.replicas, servers.infos, args.vllm_weight_transfer, policy,
                        trainer.accelerator.process_index, args.weight_transfer_address,
                        args.vllm_request_timeout)  # fmt: skip


def _how(args) -> str:
    if args.vllm_weight_transfer != "files":
        return f"push over {args.vllm_weight_transfer}"
    return "files" if args.vllm_adapter_rank is None else "LoRA adapter files"


def publisher(trainer, max_async_level: int, policy, root: str | None = None):
    """The checkpoint publisher of ``policy``'s versions (``trl_ext.vllm.publish``): adapters with the engines'
    LoRA rank where ``--vllm_lora_sync`` resolved to adapters (``args.vllm_adapter_rank``), else merged; its bytes
    and seconds logged with TRL's metrics."""
    from trl_ext.vllm.publish import CheckpointPublisher, model_bytes

    return CheckpointPublisher(trainer.accelerator, max_async_level, model_bytes(base_of(policy)), root=root,
                               adapter_rank=trainer.args.vllm_adapter_rank,
                               metrics=lambda: compat.trl_metrics(trainer, "train"))  # fmt: skip


def server_transport(trainer, servers: PolicyServers) -> Transport:
    """k = 0 on the servers: process 0 pushes each version into every replica (nccl, gloo), or each version is a
    checkpoint the servers reload (files)."""
    from trl_ext.serve.engine import ServerEngine
    from trl_ext.vllm.sampler import VLLMSampler

    policy = trainer.accelerator.unwrap_model(trainer.model)
    pusher = _pusher(trainer, servers, policy)
    writer = None
    if pusher is None:
        writer = publisher(trainer, 0, policy, root=servers.infos[0]["weights_dir"])
    sampler = VLLMSampler(ServerEngine(servers.replicas, trainer.accelerator.process_index), None)
    return Transport(_how(trainer.args), sampler, writer, pusher)


def generator_transport(trainer, policy, servers: PolicyServers | None) -> Transport:
    """k >= 1 with ``--use_vllm``: a `VLLMSampler` over the policy's servers (``servers``) or over this process's
    `VLLMEngine`, the checkpoint publisher (``trl_ext.vllm.publish``) and, with ``--vllm_weight_transfer
    nccl|gloo``, the servers' pusher (``trl_ext.serve.transfer``)."""
    from trl_ext.vllm.sampler import VLLMSampler

    args, acc = trainer.args, trainer.accelerator
    inflight = None if args.strict_async_level else args.vllm_inflight_tokens
    base = base_of(policy)
    if servers is not None:
        from trl_ext.serve.engine import ServerEngine

        root = servers.infos[0]["weights_dir"]  # None: in flight with pushes (never written)
        writer = publisher(trainer, args.max_async_level, policy, root=root)
        pusher = _pusher(trainer, servers, policy)
        return Transport(_how(args), VLLMSampler(ServerEngine(servers.replicas, acc.process_index), inflight),
                         writer, pusher)  # fmt: skip
    from trl_ext.vllm.dtype import engine_dtype, policy_dtype
    from trl_ext.vllm.engine import VLLMEngine, lora_settings
    from trl_ext.vllm.placement import engine_placement

    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    place = engine_placement(acc.local_process_index, acc.num_processes, devices, args.vllm_gpu_memory_utilization)
    max_len = args.vllm_max_model_length or getattr(base.config, "max_position_embeddings", None)
    engine = VLLMEngine(
        base.name_or_path, dtype=engine_dtype(args, base), max_model_len=max_len,
        seed=args.seed + acc.process_index, gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        trust_remote_code=args.trust_remote_code, enforce_eager=args.vllm_enforce_eager, placement=place.llm_kwargs,
        lora=lora_settings(args.vllm_adapter_rank, args.max_async_level),
    )  # fmt: skip
    print(f"vLLM engine of process {acc.process_index}: {engine_dtype(args, base)} (the policy "
          f"{policy_dtype(base)}), on {place.device}, max_model_len {max_len}", flush=True)  # fmt: skip
    return Transport(_how(args), VLLMSampler(engine, inflight), publisher(trainer, args.max_async_level, policy), None)
