"""Sampler on transformers' own model forward: any Hugging Face causal LM (GPT-2, GPT-NeoX, Phi-3, OLMo 2, Gemma, ...,
PEFT and dual-LoRA wrappers included). The asynchronous generator's sampler under ``--generation_backend trl``; the
interface is ``trl_ext.interfaces.ModelSampler`` (``sample(prompt_ids, params, rng, before_step) -> Sampled``), as
`FastSampler`'s.

The loop is the one of transformers' ``GenerationMixin._sample`` reduced to what the generator needs: a prefill of the
left-padded prompts, then one forward of the sampled tokens per step with a ``DynamicCache``
(``DynamicCache(config=...)``: sliding-window layers where the config has them), the last position's raw logits only
(``logits_to_keep=1`` where the model takes it, as ``generate`` does). Each step samples with the project's sampling
step (``trl_ext.generation.sampling``: transformers' temperature / top-k / top-p warpers, then an exact categorical
draw from ``rng``) and records the behaviour log-prob ``log_softmax(logits / temperature)`` of the raw logits.

Positions are numbered 0..len-1 over the left-padded row, passed as explicit ``position_ids``: TRL's trainer forward
(``GRPOTrainer._get_per_token_logps_and_entropies``) passes input ids and the attention mask only, so the model
numbers the positions of the padded row from its cache position, 0..len-1. ``generate`` numbers them from each row's
first real token (``GenerationMixin._prepare_position_ids_for_generation``: ``cumsum(attention_mask) - 1``): for RoPE
models the two agree up to float error (attention depends on position differences), for absolute position embeddings
(GPT-2) they are different inputs, and the behaviour log-probs would not be the trainer's.

Why not ``model.generate(..., output_logits=True)``: it draws with ``torch.multinomial`` from torch's global RNG,
which the trainer thread shares (seeding it per batch would reseed the trainer's stream, and the two threads' draws
would interleave nondeterministically); ``before_step`` must run before every forward, which generate exposes no hook
for; and its positions would have to be passed in and extended by generate's own bookkeeping. This loop draws only
from ``rng`` (a per-batch seeded generator: same seed, same samples) and calls ``before_step`` itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import Tensor, nn
from transformers import DynamicCache
from trl.trainer.utils import pad

from trl_ext.generation.sampling import completions_from_steps, finish_step, left_padded, sample_step
from trl_ext.interfaces import Sampled, SamplingParams


def _base_model(model: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def check_no_active_dropout(model: nn.Module) -> None:
    """ValueError when a forward of ``model`` would be random: the behaviour log-probs would not be the policy's."""
    cfg = getattr(_base_model(model), "config", None)
    if model.training and (getattr(cfg, "attention_dropout", 0.0) or any(
            isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())):  # fmt: skip
        raise ValueError("the transformers sampler cannot sample with dropout active (eval mode, or dropouts 0)")


def stop_hits(tail: Tensor, stops: Tensor) -> Tensor:
    """Rows whose last tokens ``tail`` [B, W] end with one of ``stops`` [S, W] (right-aligned, left-padded with -1,
    which matches anything): [B] bool."""
    return ((tail[:, None, :] == stops[None]) | (stops[None] < 0)).all(-1).any(-1)


def stop_table(stop_sequences: tuple[tuple[int, ...], ...], device: torch.device) -> Tensor:
    """The stop sequences right-aligned in one [S, W] tensor, left-padded with -1."""
    width = max(len(seq) for seq in stop_sequences)
    return torch.tensor([[-1] * (width - len(q)) + list(q) for q in stop_sequences], device=device)


class HFSampler:
    """Samples completions from ``model`` through its own forward (its weights as they are at each step): a
    ``trl_ext.interfaces.ModelSampler``."""

    loads_versions = False  # a new version is written into ``model``

    def __init__(self, model: nn.Module) -> None:
        base = _base_model(model)
        if not hasattr(base, "config") or not callable(getattr(base, "forward", None)):
            raise ValueError(f"the transformers sampler needs a transformers causal LM, got {type(base).__name__}")
        self.model, self.config = model, base.config
        self.keep_last = "logits_to_keep" in inspect.signature(base.forward).parameters

    def _forward(self, ids: Tensor, attention: Tensor, positions: Tensor, cache: DynamicCache) -> Tensor:
        """Raw logits [B, V] of the last position of ``ids`` (the model's own forward, extending ``cache``)."""
        extra = {"logits_to_keep": 1} if self.keep_last else {}
        out = self.model(input_ids=ids, attention_mask=attention, position_ids=positions, past_key_values=cache,
                         use_cache=True, **extra)  # fmt: skip
        return out.logits[:, -1]

    @torch.no_grad()
    def sample(self, prompt_ids: list[list[int]], params: SamplingParams, rng: torch.Generator | None = None,
               before_step: Callable[[int], int] | None = None) -> Sampled:  # fmt: skip
        """One completion per prompt (left-padded batch).

        ``rng`` draws the samples (None: torch's default generator of the device). ``before_step(t)`` is called before
        every forward pass (t = 0 is the prefill); it may load new weights in place (the cache of earlier tokens is
        kept) and returns the version that produces token t (without it every token is version 0).
        """
        check_no_active_dropout(self.model)
        device = next(self.model.parameters()).device
        rows, ids = left_padded(prompt_ids, params.pad_token_id, device)
        b, p, n_max = ids.size(0), ids.size(1), params.max_new_tokens
        attention = torch.ones(b, p + n_max, dtype=torch.long, device=device)  # generated tokens: 1, as generate
        attention[:, :p] = pad([torch.ones_like(r) for r in rows], padding_value=0, padding_side="left")
        tokens = torch.full((b, n_max), params.pad_token_id, dtype=torch.long, device=device)
        logps = torch.zeros(b, n_max, dtype=torch.float64, device=device)
        alive = torch.zeros(b, n_max, dtype=torch.bool, device=device)
        done = torch.zeros(b, dtype=torch.bool, device=device)
        eos = torch.tensor(params.eos_token_ids, device=device)
        stops = stop_table(params.stop_sequences, device) if params.stop_sequences else None
        tail = torch.full((b, stops.size(1)), -1, dtype=torch.long, device=device) if stops is not None else None
        cache = DynamicCache(config=self.config)
        step_ids, positions = ids, torch.arange(p, device=device).expand(b, p)
        versions: list[int] = []
        for t in range(n_max):
            if t > 0 and bool(done.all()):
                break
            versions.append(before_step(t) if before_step is not None else 0)
            logits = self._forward(step_ids, attention[:, : p + t], positions, cache)
            tok, logp = sample_step(logits, params.temperature, params.top_k, params.top_p, None, rng)
            tok, alive_t, done = finish_step(tok, done, eos, params.pad_token_id)
            if stops is not None:  # rolling window of each row's last tokens against the stop sequences
                tail = torch.cat([tail[:, 1:], tok[:, None]], 1)
                done = done | (stop_hits(tail, stops) & alive_t)
            tokens[:, t], logps[:, t], alive[:, t] = tok, logp.to(logps.dtype), alive_t
            step_ids, positions = tok[:, None], torch.full((b, 1), p + t, dtype=torch.long, device=device)
        n = len(versions)
        token_ids, lps = completions_from_steps(tokens[:, :n], logps[:, :n], alive[:, :n])
        return Sampled(token_ids, lps, [versions[: len(c)] for c in token_ids])
