"""The policy's vLLM servers as an engine: `ServerEngine` (the policy's replicas, behind the same ``load`` /
``generate`` interface as the in-process ``trl_ext.vllm.engine.VLLMEngine``, so ``trl_ext.vllm.sampler.VLLMSampler``
drives either). The servers' other parts: the client and its start checks (``trl_ext.serve.client``), TRL's
``vllm_generation`` at ``--max_async_level 0`` (``trl_ext.serve.generation``), a teacher's log-probs
(``trl_ext.serve.teacher``).

Each distinct prompt goes to one replica (`replica_of`: the rows of a GRPO group share one server, whose prefix
cache then holds their prompt once), prompts to the replicas in turn; one request per row with its own seed (a
batched request shares one seed, so a group's identical prompts would draw identical completions), sent concurrently.
"""

from __future__ import annotations

from trl_ext.interfaces import SamplingParams
from trl_ext.serve.client import Replica, concurrently


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

        return concurrently(one, list(range(len(prompt_ids))))
