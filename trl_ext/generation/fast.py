"""Fast sampler for small causal LMs: a static KV cache, preallocated step buffers, the fused sampling step of
``trl_ext.generation.sampling`` and, on CUDA, one CUDA graph per (batch, length) for the whole decode step.

The per-token cost of ``transformers.generate`` on a tiny model is Python and kernel-launch overhead (dynamic cache,
mask building, logits processors, stopping criteria, output dataclasses), not arithmetic. This sampler runs the
model's own embedding and rotary modules, and each decoder layer as transformers computes it, in the same order of
operations (``trl_ext.generation.layers``), on fused weights read from the model's projections
(``trl_ext.generation.weights``: LoRA / PEFT / dual-LoRA wrappers as their merged weights).

Families (transformers ``model_type``, ``trl_ext.generation.families``): llama, qwen2, qwen3, mistral, phi3, olmo2,
gemma2, gemma3_text, with their sliding windows, q/k norms, soft-caps and per-layer-type RoPE. Everything else is
refused with a reason (`fast_backend_refusal`, decidable from the config at parse time).

Positions are numbered 0..len-1 over the left-padded row, as TRL's trainer forward numbers them (it passes no
position ids); ``transformers.generate`` numbers them from each row's first real token instead. The two agree
whenever the prompts of a batch have equal length (the story prompts); with unequal lengths the fast backend samples
the policy that the trainer scores. Sliding windows count positions of the padded row, as transformers' masks do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from trl.trainer.utils import pad

from trl_ext.generation.families import FAMILIES, fast_backend_refusal
from trl_ext.generation.layers import DecodePlan, decode_layers, logits_of, prefill_masks, rope_tables, window_mask
from trl_ext.generation.sampling import completions_from_steps, finish_step, left_padded, sample_step
from trl_ext.generation.weights import DecodeWeights, check_generation_safe
from trl_ext.interfaces import Sampled, SamplingParams

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
__all__ = ["FastSampler", "decoder_of", "fast_backend_refusal", "SUPPORTED_MODEL_TYPES"]


def decoder_of(model: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` module under a PEFT wrapper (or the model itself); ValueError with `fast_backend_refusal`'s
    reason for a model the fast backend does not sample exactly. Dropout modules are checked as they are when sampling
    (``check_generation_safe``: zeroed by ``--disable_dropout``, inactive in eval mode), not from the config."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = getattr(base, "config", None)
    if cfg is None:
        raise ValueError(f"the fast generation backend needs a transformers model with a config, got "
                         f"{type(base).__name__}; use --generation_backend trl")  # fmt: skip
    reason = fast_backend_refusal(cfg, disable_dropout=True)
    if reason is not None:
        raise ValueError(reason)
    return base


class FastSampler:
    """Samples completions from ``model`` (its weights as they are at each call: no copy is taken): a
    ``trl_ext.interfaces.ModelSampler``."""

    loads_versions = False  # a new version is written into ``model``

    def __init__(self, model: nn.Module, cuda_graphs: bool = True) -> None:
        self.model = model
        self.decoder = decoder_of(model)
        self.inner = self.decoder.model
        self.plan = DecodePlan.of(self.decoder)
        self.cuda_graphs = cuda_graphs
        self.weights: DecodeWeights | None = None
        self._state: _DecodeState | None = None

    # ------------------------------------------------------------------ model pieces
    def _prefill(self, ids: Tensor, key_valid: Tensor, state: _DecodeState) -> Tensor:
        """Prompt pass; returns the last position's logits [B, V]."""
        b, p = ids.shape
        pos = torch.arange(p, device=ids.device)
        masks = prefill_masks(key_valid, p, state.windows)
        ropes = {key: (cos[:p], sin[:p]) for key, (cos, sin) in state.ropes.items()}
        h = decode_layers(self.plan, self.weights, self.inner.embed_tokens(ids), pos, ropes, masks, state.k, state.v, p)
        return logits_of(self.plan, self.weights, h.view(b, p, -1)[:, -1])

    def _decode_step(self, state: _DecodeState, params: SamplingParams, noise_gen: torch.Generator | None,
                     graphed: bool) -> None:  # fmt: skip
        """One token for every row: the forward at ``state.pos`` of ``state.tok`` and the fused sampling step, all in
        place on the state's buffers (so that a CUDA graph can replay it)."""
        pos = state.pos
        ropes = {key: (cos.index_select(0, pos), sin.index_select(0, pos)) for key, (cos, sin) in state.ropes.items()}
        if graphed:  # static shapes: attend over the whole cache, keys past pos masked
            masks, kv_len = {w: window_mask(state.key_valid, state.arange, pos, w) for w in state.windows}, None
        else:
            kv_len = state.host_pos + 1
            valid = state.key_valid[:, :kv_len]
            masks = {w: valid[:, None, None, :] if w is None else window_mask(valid, state.arange[:kv_len], pos, w)
                     for w in state.windows}  # fmt: skip
        h = self.inner.embed_tokens(state.tok[:, None])
        h = decode_layers(self.plan, self.weights, h, pos, ropes, masks, state.k, state.v, kv_len)
        self._sample_into(state, logits_of(self.plan, self.weights, h), params, noise_gen)

    def _sample_into(self, state: _DecodeState, logits: Tensor, params: SamplingParams,
                     noise_gen: torch.Generator | None) -> None:  # fmt: skip
        """Sample the token at ``state.pos + 1`` from ``logits``; record it, its log-prob and aliveness at column
        ``pos + 1 - prompt_len``; advance ``pos``."""
        if state.noise is not None:
            state.noise.exponential_(generator=noise_gen)
        tok, logp = sample_step(logits, params.temperature, params.top_k, params.top_p, state.noise, noise_gen)
        tok, alive, done = finish_step(tok, state.done, state.eos, params.pad_token_id)
        if state.stops is not None:  # rolling window of each row's last tokens against the stop sequences
            state.tail.copy_(torch.cat([state.tail[:, 1:], tok[:, None]], 1))
            hit = ((state.tail[:, None, :] == state.stops[None]) | (state.stops[None] < 0)).all(-1).any(-1)
            done = done | (hit & alive)
        col = state.pos + 1 - state.prompt_len
        state.tokens.index_copy_(1, col, tok[:, None])
        state.logps.index_copy_(1, col, logp[:, None])
        state.alive.index_copy_(1, col, alive[:, None])
        state.done.copy_(done)
        state.tok.copy_(tok)
        state.pos.add_(1)

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def sample(self, prompt_ids: list[list[int]], params: SamplingParams, rng: torch.Generator | None = None,
               before_step: Callable[[int], int] | None = None) -> Sampled:  # fmt: skip
        """One completion per prompt (left-padded batch).

        ``rng`` draws the sampling noise (None: torch's default generator of the device). ``before_step(t)`` is called
        before every forward pass (t = 0 is the prefill); it may load new weights in place and returns the version
        that produces token t (without it every token is version 0).
        """
        check_generation_safe(self.model)
        device = next(self.model.parameters()).device
        rows, ids = left_padded(prompt_ids, params.pad_token_id, device)
        prompt_mask = pad([torch.ones_like(r, dtype=torch.bool) for r in rows], padding_value=False,
                          padding_side="left")  # fmt: skip
        versions = [before_step(0) if before_step is not None else 0]
        self._refresh_weights()
        state = self._state_for(len(rows), ids.size(1), params, device)
        graph = self._graph_for(state, params, rng) if state.graphable and self.cuda_graphs else None
        state.reset(prompt_mask)
        state.pos.fill_(ids.size(1) - 1)
        self._sample_into(state, self._prefill(ids, state.key_valid, state), params, rng)
        state.host_pos = ids.size(1)
        for t in range(1, params.max_new_tokens):
            if (graph is None or t % 8 == 0) and bool(state.done.all()):  # a sync: every 8 steps on CUDA
                break
            versions.append(before_step(t) if before_step is not None else 0)
            if versions[-1] != versions[-2]:
                self._refresh_weights()  # in-flight weight update
            if graph is not None:
                graph.replay()
            else:
                self._decode_step(state, params, rng, graphed=False)
            state.host_pos += 1
        n = len(versions)
        token_ids, logps = completions_from_steps(state.tokens[:, :n], state.logps[:, :n], state.alive[:, :n])
        return Sampled(token_ids, logps, [versions[: len(c)] for c in token_ids])

    def _refresh_weights(self) -> None:
        if self.weights is None:
            self.weights = DecodeWeights(self.decoder)
        else:
            self.weights.refresh()

    def _state_for(self, batch: int, prompt_len: int, params: SamplingParams, device: torch.device) -> _DecodeState:
        key = (batch, prompt_len, params, device)
        if self._state is None or self._state.key != key:
            self._state = _DecodeState(key, self, batch, prompt_len, params, device)
        return self._state

    def _graph_for(self, state: _DecodeState, params: SamplingParams, rng: torch.Generator | None):
        """The decode step captured as a CUDA graph for this state (captured once; replays read the weights in place).
        Capturing writes into the cache and step buffers, so it happens before the prefill of the call."""
        if state.graph is not None and state.graph_rng is rng and state.graph_training == self.model.training:
            return state.graph
        state.pos.fill_(state.prompt_len)
        rng_state = rng.get_state() if rng is not None else torch.cuda.get_rng_state(state.pos.device)
        side = torch.cuda.Stream(state.pos.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy initialisation stays out of the graph
                self._decode_step(state, params, rng, graphed=True)
                state.pos.fill_(state.prompt_len)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if rng is not None:
            graph.register_generator_state(rng)
        autocast = torch.is_autocast_enabled("cuda")
        dtype = torch.get_autocast_dtype("cuda")
        # thread_local: the trainer thread may allocate or synchronise while the generator thread captures
        with (torch.autocast("cuda", dtype=dtype, enabled=autocast, cache_enabled=False),
              torch.cuda.graph(graph, capture_error_mode="thread_local")):
            self._decode_step(state, params, rng, graphed=True)
        if rng is not None:  # warm-up and capture drew no sample of this call: same seed, same sample
            rng.set_state(rng_state)
        else:
            torch.cuda.set_rng_state(rng_state, state.pos.device)
        state.graph, state.graph_rng, state.graph_training = graph, rng, self.model.training
        return graph


class _DecodeState:
    """Preallocated buffers of one (batch, prompt length, sampling params, device): KV cache, RoPE tables, step
    buffers, and the CUDA graph captured on them."""

    def __init__(self, key, sampler: FastSampler, batch: int, prompt_len: int, params: SamplingParams,
                 device: torch.device) -> None:  # fmt: skip
        self.key, self.prompt_len = key, prompt_len
        total = prompt_len + params.max_new_tokens
        inner, plan = sampler.inner, sampler.plan
        dtype = inner.embed_tokens.weight.dtype
        if torch.is_autocast_enabled(device.type):
            dtype = torch.get_autocast_dtype(device.type)
        shape = (batch, plan.n_kv, total, plan.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in inner.layers]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in inner.layers]
        self.ropes = {k: rope_tables(inner.rotary_emb, k, total, plan, dtype, device) for k in set(plan.rope_keys)}
        self.windows = set(plan.windows)
        positions = torch.arange(total, device=device)
        self.arange = positions
        self.key_valid = torch.ones(batch, total, dtype=torch.bool, device=device)
        vocab = sampler.weights.head["head"].shape[1]
        # CUDA: exponential-race noise (no host sync, graph-capturable); CPU: inverse CDF (one uniform per row)
        self.noise = torch.empty(batch, vocab, dtype=torch.float32, device=device) if device.type == "cuda" else None
        self.tokens = torch.zeros(batch, params.max_new_tokens, dtype=torch.long, device=device)
        self.logps = torch.zeros(batch, params.max_new_tokens, dtype=torch.promote_types(dtype, torch.float32),
                                 device=device)
        self.alive = torch.zeros(batch, params.max_new_tokens, dtype=torch.bool, device=device)
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)
        self.tok = torch.zeros(batch, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.eos = torch.tensor(params.eos_token_ids, device=device)
        self.stops = self.tail = None
        if params.stop_sequences:  # right-aligned, left-padded with -1 (matches anything)
            width = max(len(seq) for seq in params.stop_sequences)
            self.stops = torch.tensor([[-1] * (width - len(q)) + list(q) for q in params.stop_sequences], device=device)
            self.tail = torch.full((batch, width), -1, dtype=torch.long, device=device)
        self.host_pos = 0
        self.graphable = device.type == "cuda"
        self.graph = self.graph_rng = self.graph_training = None

    def reset(self, prompt_mask: Tensor) -> None:
        self.key_valid[:, : self.prompt_len].copy_(prompt_mask)
        self.done.zero_()
        self.alive.zero_()
        if self.tail is not None:
            self.tail.fill_(-1)
