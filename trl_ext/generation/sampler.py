"""Fast sampler for small Llama-family causal LMs: a static KV cache, preallocated step buffers, the fused sampling
step of ``trl_ext.generation.sampling`` and, on CUDA, one CUDA graph per (batch, length) for the whole decode step.

The per-token cost of ``transformers.generate`` on a tiny model is Python and kernel-launch overhead (dynamic cache,
mask building, logits processors, stopping criteria, output dataclasses), not arithmetic. This sampler runs the
model's own embedding and rotary tables, and each decoder layer as transformers' Llama/Qwen2 layer computes it (RMSNorm
in float32, rotate-half RoPE, softmax attention, SiLU-gated MLP, in the same order of operations) on fused weights
read from the model's projections (``trl_ext.generation.weights``: LoRA / PEFT / dual-LoRA wrappers as their merged
weights). Attention: ``F.scaled_dot_product_attention`` on CUDA, the plain product on CPU.

Positions are numbered 0..len-1 over the left-padded row, as TRL's trainer forward numbers them (it passes no
position ids); ``transformers.generate`` numbers them from each row's first real token instead. The two agree
whenever the prompts of a batch have equal length (the story prompts); with unequal lengths the fast backend samples
the policy that the trainer scores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from trl.trainer.utils import pad

from trl_ext.generation.sampling import completions_from_steps, finish_step, sample_step
from trl_ext.generation.weights import DecodeWeights, check_generation_safe

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; filled from the trainer's GRPOConfig (no defaults here)."""

    max_new_tokens: int
    temperature: float
    top_k: int  # 0 = off
    top_p: float  # 1.0 = off
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    """Token sequences that end a row like EOS (their last token is the row's last), e.g. an environment answer's
    closing tag: sampling past it would only produce tokens that the episode loop cuts off."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"need top_k >= 0 and 0 < top_p <= 1, got top_k={self.top_k}, top_p={self.top_p}")
        if not self.eos_token_ids:
            raise ValueError("eos_token_ids must not be empty")
        if any(len(seq) == 0 for seq in self.stop_sequences):
            raise ValueError("stop sequences must not be empty")


@dataclass
class Sampled:
    """Per sequence: the completion token ids (up to and including EOS), their behaviour log-probs and versions."""

    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]


def decoder_of(model: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` module under a PEFT wrapper (or the model itself); ValueError for unsupported models."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = getattr(base, "config", None)
    if getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"the fast generation backend supports {', '.join(SUPPORTED_MODEL_TYPES)} models, got "
                         f"{getattr(cfg, 'model_type', type(base).__name__)!r}")  # fmt: skip
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
        raise ValueError("the fast generation backend supports full attention only (sliding-window layers found)")
    return base


def _rms_norm(h: Tensor, weight: Tensor, eps: float) -> Tensor:
    """LlamaRMSNorm / Qwen2RMSNorm: normalised in float32, cast back, then scaled (transformers' order)."""
    return weight * F.rms_norm(h.float(), (h.shape[-1],), None, eps).to(h.dtype)


class FastSampler:
    """Samples completions from ``model`` (its weights as they are at each call: no copy is taken)."""

    def __init__(self, model: nn.Module, cuda_graphs: bool = True) -> None:
        self.model = model
        self.decoder = decoder_of(model)
        self.inner = self.decoder.model
        attn = self.inner.layers[0].self_attn
        self.n_heads, self.n_kv = self.decoder.config.num_attention_heads, self.decoder.config.num_key_value_heads
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.cuda_graphs = cuda_graphs
        self.weights: DecodeWeights | None = None
        self._state: _DecodeState | None = None

    # ------------------------------------------------------------------ model pieces
    def _layers(self, h: Tensor, pos: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, state: _DecodeState,
                kv_len: int | None) -> Tensor:  # fmt: skip
        """Every decoder layer on ``h`` [B, S, H] at positions ``pos`` [S] (RoPE tables ``cos``/``sin`` [S, n, d]
        over the n = n_q + 2 n_kv heads of the fused QKV output), writing K/V into the cache; returns the final-norm
        hidden states [B * S, H]."""
        b, s, hidden = h.shape
        w, eps, nq, d = self.weights, self.weights.eps, self.n_heads, self.head_dim
        h = h.reshape(b * s, hidden)
        for i, lw in enumerate(w.layers):
            x = _rms_norm(h, lw["ln1"], eps)
            qkv = (torch.mm(x, lw["qkv"]) if lw["qkv_b"] is None else torch.addmm(lw["qkv_b"], x, lw["qkv"]))
            qkv = qkv.view(b, s, -1, d)
            # RoPE (rotate-half convention) on the q and k heads; the tables hold cos 1 / sin 0 for the v heads.
            # Products and sums in the order of transformers' layers (fused forms round differently)
            qkv = (qkv * cos + qkv.roll(d // 2, -1) * sin).transpose(1, 2)  # [B, n, S, d]
            k, v = state.k[i], state.v[i]
            k.index_copy_(2, pos, qkv[:, nq : nq + self.n_kv].to(k.dtype))
            v.index_copy_(2, pos, qkv[:, nq + self.n_kv :].to(v.dtype))
            if kv_len is not None:
                k, v = k[:, :, :kv_len], v[:, :, :kv_len]
            o = self._attend(qkv[:, :nq], k.to(qkv.dtype), v.to(qkv.dtype), mask)
            o = o.transpose(1, 2).reshape(b * s, nq * d)
            h = h + (torch.mm(o, lw["o"]) if lw["o_b"] is None else torch.addmm(lw["o_b"], o, lw["o"]))
            x = _rms_norm(h, lw["ln2"], eps)
            gu = torch.mm(x, lw["gate_up"]) if lw["gate_up_b"] is None else torch.addmm(lw["gate_up_b"], x,
                                                                                           lw["gate_up"])
            inter = gu.shape[1] // 2
            act = F.silu(gu[:, :inter]) * gu[:, inter:]
            h = h + (torch.mm(act, lw["down"]) if lw["down_b"] is None else torch.addmm(lw["down_b"], act, lw["down"]))
        return _rms_norm(h, w.head["norm"], eps)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """Softmax attention of ``q`` [B, n_q, S, d] over ``k``/``v`` [B, n_kv, L, d]; ``mask`` [B, 1, S, L] bool.
        CUDA: PyTorch's fused kernel. CPU: the plain product (the fused CPU kernel costs ~0.4 ms per call at
        decode sizes, more than the layer's matmuls)."""
        if q.is_cuda:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling,
                                                  enable_gqa=self.n_kv != self.n_heads)  # fmt: skip
        b, nq, s, d = q.shape
        g = nq // self.n_kv  # query heads per kv head (GQA): grouped, not copied
        q = q.reshape(b, self.n_kv, g * s, d)
        mask = mask if g == 1 or s == 1 else mask.repeat(1, 1, g, 1)
        scores = torch.matmul(q * self.scaling, k.transpose(-1, -2)).masked_fill_(~mask, -torch.inf)
        return torch.matmul(scores.softmax(-1), v).view(b, nq, s, d)

    def _logits(self, h: Tensor) -> Tensor:
        head = self.weights.head
        return torch.mm(h, head["head"]) if head["head_b"] is None else torch.addmm(head["head_b"], h, head["head"])

    def _prefill(self, ids: Tensor, key_valid: Tensor, state: _DecodeState) -> Tensor:
        """Prompt pass; returns the last position's logits [B, V]. Padding queries attend to themselves only (their
        outputs are never used; this keeps every row finite)."""
        b, p = ids.shape
        pos = torch.arange(p, device=ids.device)
        causal = torch.ones(p, p, dtype=torch.bool, device=ids.device).tril()
        mask = (causal & key_valid[:, None, None, :p]) | torch.eye(p, dtype=torch.bool, device=ids.device)
        h = self._layers(self.inner.embed_tokens(ids), pos, state.cos[:p], state.sin[:p], mask, state, p)
        return self._logits(h.view(b, p, -1)[:, -1])

    def _decode_step(self, state: _DecodeState, params: SamplingParams, noise_gen: torch.Generator | None,
                     graphed: bool) -> None:  # fmt: skip
        """One token for every row: the forward at ``state.pos`` of ``state.tok`` and the fused sampling step, all in
        place on the state's buffers (so that a CUDA graph can replay it)."""
        pos = state.pos
        cos, sin = state.cos.index_select(0, pos), state.sin.index_select(0, pos)
        if graphed:  # static shapes: attend over the whole cache, keys past pos masked
            mask, kv_len = (state.key_valid & (state.arange <= pos))[:, None, None, :], None
        else:
            kv_len = state.host_pos + 1
            mask = state.key_valid[:, None, None, :kv_len]
        h = self._layers(self.inner.embed_tokens(state.tok[:, None]), pos, cos, sin, mask, state, kv_len)
        self._sample_into(state, self._logits(h), params, noise_gen)

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
        if not prompt_ids or min(len(p) for p in prompt_ids) == 0:
            raise ValueError("every prompt needs at least one token")
        check_generation_safe(self.model, self.decoder)
        device = next(self.model.parameters()).device
        rows = [torch.tensor(p, dtype=torch.long, device=device) for p in prompt_ids]
        ids = pad(rows, padding_value=params.pad_token_id, padding_side="left")
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
        inner, nq, nkv, d = sampler.inner, sampler.n_heads, sampler.n_kv, sampler.head_dim
        dtype = inner.embed_tokens.weight.dtype
        if torch.is_autocast_enabled(device.type):
            dtype = torch.get_autocast_dtype(device.type)
        self.k = [torch.zeros(batch, nkv, total, d, dtype=dtype, device=device) for _ in inner.layers]
        self.v = [torch.zeros(batch, nkv, total, d, dtype=dtype, device=device) for _ in inner.layers]
        positions = torch.arange(total, device=device)
        cos, sin = inner.rotary_emb(torch.zeros((), dtype=torch.float32, device=device), positions[None])
        sin = torch.cat([-sin[0, :, : d // 2], sin[0, :, d // 2 :]], -1)  # rotate_half(x) * sin = roll(x) * this
        self.cos = torch.cat([cos[0, :, None].expand(total, nq + nkv, d), torch.ones(total, nkv, d, device=device)], 1)
        self.sin = torch.cat([sin[:, None].expand(total, nq + nkv, d), torch.zeros(total, nkv, d, device=device)], 1)
        self.cos, self.sin = self.cos.to(dtype), self.sin.to(dtype)
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
