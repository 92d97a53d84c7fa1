"""The routing eval's modes sampled by the run's vLLM engine, each mode the policy's adapters as one LoRA adapter at
that mode's scales (`AdapterEvalSampler`; ``trl_ext.vllm.lora``: ``retain_only`` is the forget block's columns at
0), never a merged model. Each mode's completions come with the gap between vLLM's sampling log-probs and the
trainer's (the model's forward with the same scales, ``log_softmax(logits / T)``): the mode vLLM served is the mode
the trainer ablates (``vllm_logp_gap``, float error in float32)."""

from __future__ import annotations

import torch
from torch import nn

from trl_ext.interfaces import SamplingParams
from trl_ext.vllm.sampler import VLLMSampler


@torch.no_grad()
def trainer_logprobs(model: nn.Module, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    """The log-prob of each token of ``completion`` after ``prompt`` under ``model``'s ``log_softmax(logits / T)``."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + completion], device=device)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0].tolist()


class AdapterEvalSampler:
    """Samples held-out prompts with ``engine`` (``trl_ext.vllm.engine.VLLMEngine``, TRL's colocate engine in one,
    or the servers' ``trl_ext.serve.engine.ServerEngine``), the policy's adapters published by ``publisher``
    (``trl_ext.vllm.publish.CheckpointPublisher`` with adapters) as an adapter of their own per mode."""

    def __init__(self, engine, publisher, params: SamplingParams, tokenizer) -> None:
        self.engine, self.publisher, self.params, self.tokenizer = engine, publisher, params, tokenizer
        self.calls = 0  # each call's adapter gets a directory (and a served name) of its own

    def __call__(self, model: nn.Module, prompts: list[str], seed: int, tag: str,
                 version: int) -> tuple[list[str], float]:  # fmt: skip
        """(completion texts cut at the first EOS, mean |vLLM log-prob - trainer log-prob| over their tokens) of
        ``prompts`` (no special tokens added), each row's request seeded from ``seed``; ``model``'s adapters at their
        current scales, published as adapter ``tag`` (a collective under FSDP2)."""
        self.calls += 1
        directory = self.publisher.publish_adapter(f"{tag}-{self.calls}", model)
        sampler = VLLMSampler(self.engine, None)
        sampler.stage(version, directory)
        ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        out = sampler.sample(ids, self.params, torch.Generator().manual_seed(seed), before_step=lambda _: version)
        eos, texts, gaps = set(self.params.eos_token_ids), [], []
        was_training = model.training
        model.eval()
        try:
            for prompt, row, logps in zip(ids, out.completion_ids, out.logprobs, strict=True):
                if row:
                    mine = trainer_logprobs(model, prompt, row, self.params.temperature)
                    gaps += [abs(a - b) for a, b in zip(mine, logps, strict=True)]
                cut = next((i for i, t in enumerate(row) if t in eos), len(row))
                texts.append(self.tokenizer.decode(row[:cut], skip_special_tokens=True))
        finally:
            model.train(was_training)
        return texts, (sum(gaps) / len(gaps) if gaps else 0.0)
