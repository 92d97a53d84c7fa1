"""vLLM servers as the project's engines: `ServerEngine` (the policy's replicas, behind the same ``load`` /
``generate`` interface as the in-process ``trl_ext.vllm.engine.VLLMEngine``, so `VLLMSampler` drives either),
`ServerGeneration` (TRL's ``vllm_generation`` interface at ``--max_async_level 0``), `check_replicas` (a server
serving another model, tokenizer or log-prob mode is refused at start) and `server_teacher_logprobs` (a teacher's
log-probs from a server's prompt log-probs).

Each distinct prompt goes to one replica (`replica_of`: the rows of a GRPO group share one server, whose prefix
cache then holds their prompt once), prompts to the replicas in turn; one request per row with its own seed (a
batched request shares one seed, so a group's identical prompts would draw identical completions), sent concurrently.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

from trl_ext.generation.sampler import SamplingParams
from trl_ext.registry import ConfigError
from trl_ext.serve.client import Replica

MAX_CONCURRENT = 64
"""Requests in flight at once from one trainer process (each a row)."""
PROBE_TEXT = "Once upon a time, 42 + 7 = 49. <answer> ok </answer>"
"""Text both tokenizers must split alike (`check_replicas`)."""


_POOL: ThreadPoolExecutor | None = None
"""The request threads, kept for the process: each keeps its HTTP session (`Replica`), so connections are reused
from batch to batch."""


def _map(fn, items: list) -> list:
    global _POOL
    if len(items) <= 1:
        return [fn(x) for x in items]
    if _POOL is None:
        _POOL = ThreadPoolExecutor(MAX_CONCURRENT, thread_name_prefix="trl_ext_serve")
    return list(_POOL.map(fn, items))  # the first failure raises here: no row is dropped


def replica_of(rows: list[list[int]], replicas: int, offset: int = 0) -> list[int]:
    """The replica of each row: the j-th distinct prompt (in order of first appearance) to replica (j + ``offset``)
    mod ``replicas``, so every row of a prompt goes to one server (``offset``: the trainer process's index, so the
    processes' first prompts do not all go to one replica)."""
    first: dict[tuple, int] = {}
    return [(first.setdefault(tuple(row), len(first)) + offset) % replicas for row in rows]


class ServerEngine:
    """The policy's vLLM servers (``replicas``). `load` names the checkpoint of the version to sample with; every
    request carries it and the server loads it before answering (``trl_ext.serve.endpoint``)."""

    def __init__(self, replicas: list[Replica], offset: int = 0) -> None:
        if not replicas:
            raise ValueError("no server")
        self.replicas, self.offset = replicas, offset
        self.version: int | None = None
        self.directory: str | None = None

    def load(self, directory: str, version: int | None = None) -> None:
        if version is None:
            raise ValueError("a server engine needs the version of each checkpoint it loads")
        self.version, self.directory = version, directory

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, max_tokens: list[int],
                 seeds: list[int | None]) -> list[tuple[list[int], list[float]]]:  # fmt: skip
        if self.version is None:
            raise RuntimeError("no policy version loaded: the server's start weights are not the policy's")

        where = replica_of(prompt_ids, len(self.replicas), self.offset)

        def one(i: int):
            return self.replicas[where[i]].sample(
                prompt_ids[i], max_tokens=max_tokens[i], temperature=params.temperature, seed=seeds[i],
                stop_token_ids=list(params.eos_token_ids), version=self.version, directory=self.directory)

        return _map(one, list(range(len(prompt_ids))))


def check_replicas(replicas: list[Replica], tokenizer, max_len: int | None, role: str,
                   model_config=None) -> list[dict]:  # fmt: skip
    """Each server's ``info``, refused (ConfigError naming it) when it cannot serve this run: another tokenizer (the
    probe text splits differently), a max_model_len below the run's longest sequence ``max_len``, sampled log-probs
    other than ``processed_logprobs`` (the policy's; they would not be the behaviour log-probs), or, with
    ``model_config`` (the policy's), another model (architecture or shape: the policy's checkpoints would not load)."""
    from trl_ext.serve.endpoint import SHAPE_KEYS

    infos = []
    want = list(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"])
    for r in replicas:
        info = r.info()
        if (got := r.tokenize(PROBE_TEXT)) != want:
            raise ConfigError(f"{role} {r} serves {info['model']!r}, whose tokenizer differs from the run's "
                              f"({PROBE_TEXT!r}: {got[:12]} vs {want[:12]})")  # fmt: skip
        if max_len is not None and info["max_model_len"] < max_len:
            raise ConfigError(f"{role} {r}: max_model_len {info['max_model_len']} < the run's {max_len} tokens "
                              "(prompt + completion); restart it with a larger --max-model-len")
        if role == "policy server" and info["logprobs_mode"] != "processed_logprobs":
            raise ConfigError(f"{role} {r} returns {info['logprobs_mode']}: start it with --logprobs-mode "
                              "processed_logprobs (the behaviour log-probs are log_softmax(logits / T))")
        if model_config is not None:
            ours = {k: getattr(model_config, k, None) for k in SHAPE_KEYS}
            ours["architectures"] = list(ours["architectures"] or []) or None  # none recorded: not compared
            theirs = {k: info["shape"].get(k) for k in SHAPE_KEYS}
            theirs["architectures"] = list(theirs["architectures"] or [])
            differ = {k: (theirs[k], ours[k]) for k in SHAPE_KEYS if theirs[k] != ours[k] and ours[k] is not None}
            if differ:
                raise ConfigError(f"{role} {r} serves another model than the run's ({info['model']!r}; server vs "
                                  f"run: {differ}): start it on --model")  # fmt: skip
        infos.append(info)
    return infos


class ServerGeneration:
    """TRL's ``vllm_generation`` at ``--max_async_level 0`` with ``--vllm_mode server``: ``sync_weights()`` publishes
    the policy as the checkpoint of version ``global_step`` (every process takes part: a collective under FSDP2),
    ``generate(...)`` samples this process's rows on the servers with exactly that version, one completion per row
    (TRL's sampler has repeated each prompt already), each row seeded from (seed, process, step, call within the step),
    so a resumed run draws the seeds the uninterrupted one did."""

    def __init__(self, trainer, sampler, publisher, params) -> None:
        self.trainer, self.sampler, self.publisher, self._params = trainer, sampler, publisher, params
        self._calls = (None, 0)  # (version, generate calls at that version): seeds that a resumed run repeats

    def sync_weights(self) -> None:
        t = self.trainer
        version = t.state.global_step
        self.publisher.publish(version, t.accelerator.unwrap_model(t.model))
        self.sampler.stage(version, self.publisher.snapshot(version))

    def generate(self, prompts, images=None, num_generations=1, profiler=None):
        from contextlib import nullcontext

        if images is not None:
            raise ValueError("--vllm_mode server samples text prompts only")
        t = self.trainer
        version = t.state.global_step
        call = self._calls[1] if self._calls[0] == version else 0
        self._calls = (version, call + 1)
        rng = torch.Generator().manual_seed(hash((t.args.seed, t.accelerator.process_index, version, call)) % 2**63)
        with profiler or nullcontext():
            out = self.sampler.sample([list(p) for p in prompts], self._params, rng, before_step=lambda _: version)
        return prompts, out.completion_ids, [[[lp] for lp in row] for row in out.logprobs], None


def server_teacher_logprobs(replicas: list[Replica], input_ids: Tensor, attention_mask: Tensor,
                            logits_to_keep: int, score_mask: Tensor | None = None) -> Tensor:  # fmt: skip
    """`trl_ext.distill.teacher.teacher_logprobs` (temperature 1) from teacher servers: each row's real tokens
    (``attention_mask``) are scored by a server's prompt log-probs; ``[B, C]``, 0 where masked. The completion block
    (the last ``logits_to_keep`` columns) must be right-padded, as TRL's completions are."""
    c = logits_to_keep
    comp = attention_mask[:, -c:].bool()
    if (comp[:, 1:] > comp[:, :-1]).any():
        raise ValueError("the completion block must be right-padded")
    rows = [ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask)]
    lengths = comp.sum(1).tolist()

    def one(i: int) -> list[float]:
        if lengths[i] == 0:
            return []
        return replicas[i % len(replicas)].prompt_logprobs(rows[i])[-lengths[i]:]

    out = torch.zeros(input_ids.size(0), c, dtype=torch.float32)
    for i, lps in enumerate(_map(one, list(range(len(rows))))):
        out[i, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
    scored = comp.cpu() if score_mask is None else comp.cpu() & score_mask.bool().cpu()
    return torch.where(scored, out, 0.0).to(input_ids.device)
