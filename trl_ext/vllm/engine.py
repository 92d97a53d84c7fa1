"""A vLLM engine that samples the project's rollouts: `VLLMEngine` (start, weight loading, per-token behaviour
log-probs) and `VLLMSampler` (the off-policy generator's sampler interface over it, ``trl_ext.offpolicy.worker``).

Weights reach the engine as a checkpoint directory (``trl_ext.vllm.publish``: the policy's merged weights, streamed
from the trained model once per publish) that every engine worker reloads with vLLM's
``reload_weights(weights_path=...)``, then the prefix cache is reset.

Behaviour log-probs: ``logprobs_mode="processed_logprobs"`` and ``logprobs=0`` give, per generated token, the log-prob
of the sampled token under ``log_softmax(logits / temperature)``, which is what the trainer's forward computes; top-k
/ top-p / min-p / penalties would change it (the off-policy flags refuse them with vLLM).

In-flight updates (``--max_async_level >= 1`` non-strict): vLLM decodes a whole request per call, so the sampler
decodes in chunks of ``inflight_tokens`` tokens; before each chunk the generator may load a newer policy, and the next
chunk continues every unfinished row from its prompt and the tokens so far with the new weights (its prefix is
re-encoded: the prefix cache is reset at every load). Every token is stamped with the version of the chunk that
sampled it, so its behaviour log-prob is exactly that policy's, given its prefix.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from trl_ext.interfaces import Sampled, SamplingParams
from trl_ext.vllm.placement import cpu_scheduler

CPU_KVCACHE_GIB = 1
"""``VLLM_CPU_KVCACHE_SPACE`` (GiB) when the environment does not set it: unset, vLLM sizes the CPU KV cache from
the machine's memory (tens of GiB per engine)."""
MAX_SEED = 2**31 - 1


def cpu_settings(environ=os.environ) -> dict[str, str]:
    """Set vLLM's CPU defaults that are unset (`CPU_KVCACHE_GIB`); return the values in effect, for train.log."""
    environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_KVCACHE_GIB))
    return {"VLLM_CPU_KVCACHE_SPACE": environ["VLLM_CPU_KVCACHE_SPACE"]}


_ENGINES: dict[tuple, object] = {}


def shared_llm(build, **kwargs):
    """``build(**kwargs)`` (``vllm.LLM``), once per process for the same arguments: a later trainer of the process
    (the Python API, an in-process sweep) reuses the engine, whose memory vLLM does not free when another one starts.
    Reuse is sound because every user loads the current policy before its first generation."""
    key = tuple(sorted(kwargs.items()))
    if key not in _ENGINES:
        _ENGINES[key] = build(**kwargs)
    return _ENGINES[key]


class VLLMEngine:
    """A ``vllm.LLM`` over ``model_path`` (the policy's starting checkpoint: config, tokenizer, weights), shared by the
    process's later engines with the same settings (`shared_llm`)."""

    def __init__(self, model_path: str, *, dtype: str, max_model_len: int, seed: int, gpu_memory_utilization: float,
                 enforce_eager: bool, trust_remote_code: bool = False,
                 placement: dict | None = None) -> None:  # fmt: skip
        """``placement``: the keyword arguments that put the engine on this process's device
        (``trl_ext.vllm.placement.engine_placement``)."""
        from vllm import LLM

        cpu_settings()
        scheduler = {} if torch.cuda.is_available() else cpu_scheduler(max_model_len)
        self.llm = shared_llm(LLM, model=model_path, dtype=dtype, max_model_len=max_model_len, seed=seed,
                              gpu_memory_utilization=gpu_memory_utilization, trust_remote_code=trust_remote_code,
                              enforce_eager=enforce_eager, logprobs_mode="processed_logprobs",
                              **scheduler, **(placement or {}))  # fmt: skip

    def load(self, directory: str, version: int | None = None) -> None:
        """Load the checkpoint in ``directory`` (``trl_ext.vllm.publish``) into every engine worker; the prefix cache
        is reset (cached prefixes hold the old weights' keys and values). ``version`` is the server engine's
        (``trl_ext.serve.engine``); an in-process engine needs only the directory."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": directory, "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()

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
        outs = self.llm.generate(prompts, sps, use_tqdm=False)
        result = []
        for out in outs:
            o = out.outputs[0]
            ids = list(o.token_ids)
            result.append((ids, [step[tok].logprob for step, tok in zip(o.logprobs, ids, strict=True)]))
        return result


def _cut_at_stop(ids: list[int], stops: tuple[tuple[int, ...], ...]) -> int | None:
    """Length of ``ids`` up to and including the first complete stop sequence, or None."""
    best = None
    for seq in stops:
        n = len(seq)
        for end in range(n, len(ids) + 1):
            if tuple(ids[end - n : end]) == seq:
                best = end if best is None else min(best, end)
                break
    return best


class VLLMSampler:
    """The off-policy generator's sampler over a `VLLMEngine` (or the servers' ``trl_ext.serve.engine.ServerEngine``):
    a ``trl_ext.interfaces.VersionedSampler``. The generator `stage`s each policy version it loads (its checkpoint
    directory, ``trl_ext.vllm.publish``; None for a version pushed into the servers); when ``before_step`` reports a
    version other than the engine's, the staged checkpoint is loaded into the engine. ``inflight_tokens`` None decodes
    each row in one call (strict mode: the version cannot change within a batch); otherwise in chunks of that many
    tokens."""

    loads_versions = True  # it loads each staged version itself

    def __init__(self, engine: VLLMEngine, inflight_tokens: int | None) -> None:
        if inflight_tokens is not None and inflight_tokens < 1:
            raise ValueError(f"inflight_tokens must be >= 1, got {inflight_tokens}")
        self.engine, self.inflight_tokens = engine, inflight_tokens
        self.engine_version: int | None = None
        self._staged: tuple[int, str | None] | None = None

    def stage(self, version: int, snapshot: str | None) -> None:
        """The checkpoint directory of ``version`` (None: pushed), the one the generator now samples with (loaded at
        the next `_sync`)."""
        self._staged = (version, snapshot)

    def _sync(self, version: int) -> None:
        if version == self.engine_version:
            return
        if self._staged is None or self._staged[0] != version:
            raise RuntimeError(f"the generator samples with policy {version}, and the staged checkpoint is "
                               f"{self._staged and self._staged[0]}")  # fmt: skip
        self.engine.load(self._staged[1], version)
        self.engine_version = version

    def sample(self, prompt_ids: list[list[int]], params: SamplingParams, rng: torch.Generator | None = None,
               before_step: Callable[[int], int] | None = None) -> Sampled:  # fmt: skip
        if not prompt_ids or min(len(p) for p in prompt_ids) == 0:
            raise ValueError("every prompt needs at least one token")
        n, limit = len(prompt_ids), params.max_new_tokens
        seeds: list[int | None] = [None] * n
        if rng is not None:  # one request seed per row, drawn from the batch's generator (reproducible runs)
            seeds = torch.randint(0, MAX_SEED, (n,), generator=rng, device=rng.device).tolist()
        ids: list[list[int]] = [[] for _ in range(n)]
        logps: list[list[float]] = [[] for _ in range(n)]
        versions: list[list[int]] = [[] for _ in range(n)]
        done = [False] * n
        eos = set(params.eos_token_ids)
        t, chunk = 0, 0
        while t < limit and not all(done):
            version = before_step(t) if before_step is not None else 0
            self._sync(version)
            size = limit - t if self.inflight_tokens is None else min(self.inflight_tokens, limit - t)
            active = [i for i in range(n) if not done[i]]
            outs = self.engine.generate(
                [prompt_ids[i] + ids[i] for i in active], params, [size] * len(active),
                [None if seeds[i] is None else (seeds[i] + 104_729 * chunk) % MAX_SEED for i in active],
            )  # fmt: skip
            for i, (new_ids, new_lps) in zip(active, outs, strict=True):
                ids[i] += new_ids
                logps[i] += new_lps
                versions[i] += [version] * len(new_ids)
                cut = _cut_at_stop(ids[i], params.stop_sequences) if params.stop_sequences else None
                if cut is not None:
                    del ids[i][cut:], logps[i][cut:], versions[i][cut:]
                if cut is not None or (new_ids and new_ids[-1] in eos) or len(new_ids) < size:
                    done[i] = True
            t += size
            chunk += 1
        return Sampled(ids, logps, versions)
