"""A vLLM engine that samples the project's rollouts for a policy version: `VLLMEngine` (start, weight loading,
per-token behaviour log-probs), in process; the servers' ``trl_ext.serve.engine.ServerEngine`` has the same ``load`` /
``generate`` interface, and the off-policy generator's sampler over either is ``trl_ext.vllm.sampler.VLLMSampler``.

Weights reach the engine as a checkpoint directory (``trl_ext.vllm.publish``: the policy's merged weights, streamed
from the trained model once per publish) that every engine worker reloads with vLLM's
``reload_weights(weights_path=...)``, then the prefix cache is reset. With ``lora_rank`` (``--vllm_lora_sync``) a
version is an adapter directory (``trl_ext.vllm.lora``): the base checkpoint beside it is reloaded once, and every
request names the version's adapter (``LoRARequest``, one id per directory), which vLLM loads at its first request.

Behaviour log-probs: ``logprobs_mode="processed_logprobs"`` and ``logprobs=0`` give, per generated token, the log-prob
of the sampled token under ``log_softmax(logits / temperature)``, which is what the trainer's forward computes; top-k
/ top-p / min-p / penalties would change it (the off-policy flags refuse them with vLLM).
"""

from __future__ import annotations

import itertools
import os

import torch

from trl_ext.interfaces import SamplingParams
from trl_ext.vllm.placement import cpu_scheduler

CPU_KVCACHE_GIB = 1
"""``VLLM_CPU_KVCACHE_SPACE`` (GiB) when the environment does not set it: unset, vLLM sizes the CPU KV cache from
the machine's memory (tens of GiB per engine)."""


def cpu_settings(environ=os.environ) -> dict[str, str]:
    """Set vLLM's CPU defaults that are unset (`CPU_KVCACHE_GIB`); return the values in effect, for train.log."""
    environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_KVCACHE_GIB))
    return {"VLLM_CPU_KVCACHE_SPACE": environ["VLLM_CPU_KVCACHE_SPACE"]}


_ENGINES: dict[tuple, object] = {}
LORA_KEYS = ("enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras")
"""``vllm.LLM``'s LoRA arguments (`lora_settings`): an engine with at least these serves a run asking for them, and
any run asking for none (a merged or full fine-tune policy, sampled without a LoRA request)."""


def _serves(have: dict, want: dict) -> bool:
    if not want:
        return True
    return bool(have.get("enable_lora")) and all(have.get(k, 0) >= v for k, v in want.items() if k != "enable_lora")


def shared_llm(build, **kwargs):
    """``build(**kwargs)`` (``vllm.LLM``), once per process for the same arguments: a later trainer of the process
    (the Python API, an in-process sweep) reuses the engine, whose memory vLLM does not free when another one starts.
    Reuse is sound because every user loads the current policy before its first generation (an adapter user its
    base too: ``AdapterLoads``). The LoRA arguments may differ: an engine serves a run whose LoRA needs it covers, and
    every run without LoRA (`LORA_KEYS`)."""
    key = tuple(sorted((k, v) for k, v in kwargs.items() if k not in LORA_KEYS))
    lora = {k: kwargs[k] for k in LORA_KEYS if k in kwargs}
    for (other, have), engine in _ENGINES.items():
        if other == key and _serves(dict(have), lora):
            return engine
    engine = build(**kwargs)
    _ENGINES[(key, tuple(sorted(lora.items())))] = engine
    return engine


_ADAPTER_IDS = itertools.count(1)
"""vLLM's adapter ids, one per adapter directory, unique in the process (engines are shared: `shared_llm`)."""


def lora_settings(rank: int | None, max_async_level: int) -> dict:
    """``vllm.LLM``'s LoRA arguments for adapters of ``rank`` (None: none): a batch holds at most the versions a
    generator may sample together (``max_async_level`` + 1, and one more at a change), the CPU cache as many more."""
    if rank is None:
        return {}
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": max_async_level + 2,
            "max_cpu_loras": 2 * (max_async_level + 2)}  # fmt: skip


class AdapterLoads:
    """The adapter of the version an in-process engine samples with (`load`), its base checkpoint reloaded once per
    publisher (its directory changed), and the counts: ``base_loads`` (whole-model reloads), ``adapter_loads``."""

    def __init__(self) -> None:
        self.base: str | None = None
        self.request = None
        self.base_loads = self.adapter_loads = 0

    def load(self, llm, directory: str, version: int | None) -> bool:
        """Take ``directory``; False where it is not an adapter (a merged checkpoint: the caller reloads it)."""
        from trl_ext.vllm.lora import base_dir_of

        base = base_dir_of(directory)
        if base is None:
            self.request, self.base = None, None
            return False
        from vllm.lora.request import LoRARequest

        if base != self.base:
            reload(llm, base)
            self.base = base
            self.base_loads += 1
        self.request = LoRARequest(f"policy-v{version}", next(_ADAPTER_IDS), directory)
        self.adapter_loads += 1
        return True


def reload(llm, directory: str) -> None:
    """The checkpoint in ``directory`` into every worker of ``llm``; its prefix cache reset."""
    llm.collective_rpc("reload_weights", kwargs={"weights_path": directory, "is_checkpoint_format": True})
    llm.reset_prefix_cache()


class VLLMEngine:
    """A ``vllm.LLM`` over ``model_path`` (the policy's starting checkpoint: config, tokenizer, weights), shared by the
    process's later engines with the same settings (`shared_llm`)."""

    def __init__(self, model_path: str, *, dtype: str, max_model_len: int, seed: int, gpu_memory_utilization: float,
                 enforce_eager: bool, trust_remote_code: bool = False, placement: dict | None = None,
                 lora: dict | None = None) -> None:  # fmt: skip
        """``placement``: the keyword arguments that put the engine on this process's device
        (``trl_ext.vllm.placement.engine_placement``); ``lora``: `lora_settings` (adapters served as LoRA)."""
        from vllm import LLM

        cpu_settings()
        scheduler = {} if torch.cuda.is_available() else cpu_scheduler(max_model_len)
        self.llm = shared_llm(LLM, model=model_path, dtype=dtype, max_model_len=max_model_len, seed=seed,
                              gpu_memory_utilization=gpu_memory_utilization, trust_remote_code=trust_remote_code,
                              enforce_eager=enforce_eager, logprobs_mode="processed_logprobs",
                              **scheduler, **(placement or {}), **(lora or {}))  # fmt: skip
        self.adapters = AdapterLoads()

    @classmethod
    def over(cls, llm, adapters: AdapterLoads) -> VLLMEngine:
        """The engine interface over an engine built elsewhere (TRL's colocate ``vllm.LLM``), with its adapters."""
        engine = cls.__new__(cls)
        engine.llm, engine.adapters = llm, adapters
        return engine

    def load(self, directory: str, version: int | None = None) -> None:
        """Load the checkpoint in ``directory`` (``trl_ext.vllm.publish``) into every engine worker; the prefix cache
        is reset (cached prefixes hold the old weights' keys and values). An adapter directory is taken as the
        requests' adapter (`AdapterLoads`), its base reloaded only when it changed. ``version`` names the adapter
        (and the server engine's requests: ``trl_ext.serve.engine``)."""
        if not self.adapters.load(self.llm, directory, version):
            reload(self.llm, directory)

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, max_tokens: list[int],
                 seeds: list[int | None]) -> list[tuple[list[int], list[float]]]:  # fmt: skip
        """(token ids, their behaviour log-probs) of one continuation per prompt, at most ``max_tokens[i]`` tokens;
        a row stops at an EOS of ``params.eos_token_ids`` (kept, as the project's samplers keep it)."""
        from vllm import SamplingParams as VParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids]
        sps = [VParams(max_tokens=n, temperature=params.temperature, logprobs=0, seed=s, ignore_eos=True,
                       stop_token_ids=list(params.eos_token_ids), detokenize=False)
               for n, s in zip(max_tokens, seeds, strict=True)]  # fmt: skip
        outs = self.llm.generate(prompts, sps, use_tqdm=False, lora_request=self.adapters.request)
        result = []
        for out in outs:
            o = out.outputs[0]
            ids = list(o.token_ids)
            result.append((ids, [step[tok].logprob for step, tok in zip(o.logprobs, ids, strict=True)]))
        return result
