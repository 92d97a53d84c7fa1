"""Does a layout fit its devices? A plan per device, from a model's config alone (nothing loaded), before a job is
queued: each vLLM server's weights and KV cache, each trainer process's shard of parameters, gradients and optimizer
state (FSDP2 or DDP), and the problems that would stop the run (layout.py ``--dry_run``; docs/layout.md).

Units: GiB = 2**30 bytes throughout (an inventory's ``8x80`` is 8 devices of 80 GiB; CUDA reports a little less for
a card sold as "80 GB", so state e.g. ``8x79`` to plan to the byte). Exact counts (parameters, KV bytes per token) come
from the model built on the meta device; the activation and transient terms are estimates, labelled so in the plan.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from trl_ext.models.arch import block_linears, matches
from trl_ext.registry import ConfigError

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
VLLM_GPU_MEMORY_UTILIZATION = 0.92
"""vLLM's default --gpu-memory-utilization (``vllm.config.cache.CacheConfig``, 0.30); older releases used 0.9."""
VLLM_BLOCK_SIZE = 16
"""Tokens per KV-cache block (``CacheConfig.DEFAULT_BLOCK_SIZE``): vLLM allocates whole blocks."""
SERVER_FIXED_RESERVE = GiB
"""Estimate: a server's non-KV memory beyond weights and sampler logits (CUDA context, CUDA graphs, NCCL, the
profiled forward of max_num_batched_tokens)."""
TRAINER_FIXED_RESERVE = GiB
"""Estimate: a trainer process's CUDA context, NCCL buffers and allocator fragmentation."""
ACTIVATION_ELEMENTS = 17
"""Estimate: saved activations per token per layer, in units of hidden elements: Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models") count 34·hidden bytes in 16-bit with flash attention (no
seq² term); GQA and wider MLPs shift it somewhat."""


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


@dataclass(frozen=True)
class Device:
    index: int
    total_bytes: int
    name: str = ""

    def __str__(self) -> str:
        return f"GPU {self.index} ({gib(self.total_bytes)})"


def parse_inventory(text: str) -> list[Device]:
    """``"8x80"``: 8 devices of 80 GiB (2**30 bytes); ``"2x80,1x24"``: GPUs 0-1 of 80 GiB, GPU 2 of 24 GiB.
    ConfigError for anything else (a zero count or size included)."""
    devices: list[Device] = []
    for entry in (e.strip() for e in text.split(",")):
        m = re.fullmatch(r"(\d+)\s*[xX]\s*(\d+(?:\.\d+)?)", entry)
        if not m:
            raise ConfigError(f"a GPU inventory is COUNTxGIB[,COUNTxGIB...] (e.g. 8x80), got {text!r}")
        count, size = int(m.group(1)), float(m.group(2))
        if count < 1 or size <= 0:
            raise ConfigError(f"a GPU inventory needs counts >= 1 and sizes > 0 GiB, got {entry!r} in {text!r}")
        devices += [Device(len(devices) + i, int(size * GiB), "planned") for i in range(count)]
    return devices


def cuda_inventory() -> list[Device]:
    """The CUDA devices this process sees (``torch.cuda.get_device_properties``); [] without CUDA."""
    if not torch.cuda.is_available():
        return []
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    return [Device(i, p.total_memory, p.name) for i, p in enumerate(props)]


@dataclass(frozen=True)
class ModelShape:
    """A causal LM's sizes, counted on its meta-device instance (`model_shape`)."""

    model_type: str
    params: int  # every parameter element; a tied embedding / LM head counted once
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    largest_layer_params: int  # the largest decoder block: one FSDP2 unit
    outside_params: int  # everything outside the blocks (embeddings, final norm, LM head): FSDP2's root unit
    linear_shapes: tuple[tuple[str, int, int], ...]  # (path inside its block, in, out) of every block's linears
    dtype: str = "float32"  # the checkpoint's (config ``dtype``): what ``dtype="auto"`` loads


def model_shape(source, trust_remote_code: bool = False) -> ModelShape:
    """The shape of the model at ``source`` (a folder or hub id: its config.json only; a hub id resolves from the HF
    cache under HF_HUB_OFFLINE=1) or of a transformers config. The model is built under ``torch.device("meta")``, so
    counts are exact for any architecture and no weight is read. Nested (multimodal) configs: the text config's."""
    from transformers import AutoModelForCausalLM

    from trl_ext.models.arch import decoder_blocks, model_config

    config = source
    if isinstance(source, str):
        try:
            config = model_config(source, trust_remote_code)
        except ConfigError as e:
            raise ConfigError(f"cannot read the config of {source} ({e})") from e
    text = config.get_text_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    try:
        _, blocks = decoder_blocks(model)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    n = len(blocks)
    per_block = [sum(p.numel() for p in b.parameters()) for b in blocks]
    linears = tuple((path, *_in_out(m)) for b in blocks for path, m in block_linears(b).items())
    heads = text.num_attention_heads
    return ModelShape(
        model_type=text.model_type, params=sum(p.numel() for p in model.parameters()), layers=n,
        hidden=text.hidden_size, heads=heads, kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads, vocab=text.vocab_size,
        tied_embeddings=bool(getattr(text, "tie_word_embeddings", False)), largest_layer_params=max(per_block),
        outside_params=sum(p.numel() for p in model.parameters()) - sum(per_block), linear_shapes=linears,
        dtype=str(getattr(text, "dtype", None) or "float32").removeprefix("torch."))  # fmt: skip


def _in_out(m) -> tuple[int, int]:
    w = m.weight  # nn.Linear stores [out, in]; transformers' Conv1D [in, out]
    return (w.shape[1], w.shape[0]) if isinstance(m, torch.nn.Linear) else (w.shape[0], w.shape[1])


def dtype_bytes(dtype: str) -> int:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ConfigError(f"cannot size dtype {dtype!r}: name one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def lora_params(shape: ModelShape, rank: int, targets: Sequence[str] | None = None) -> int:
    """PEFT LoRA's trainable elements: ``rank * (in + out)`` per targeted linear (lora_A [rank, in], lora_B
    [out, rank], no bias). Targets follow the project's rule (`trl_ext.models.arch`, PEFT's matching): a name
    selects a block linear whose path is it or ends in ``.name``; None = every linear of the decoder blocks
    (train.py's default for --lora_rank). ConfigError for a name that selects none."""
    for name in targets or ():
        if not any(matches(name, p) for p, _, _ in shape.linear_shapes):
            raise ConfigError(f"LoRA target {name!r} names no linear layer of a {shape.model_type} block")
    return sum(rank * (i + o) for p, i, o in shape.linear_shapes
               if targets is None or any(matches(n, p) for n in targets))  # fmt: skip


def serving_weight_bytes(shape: ModelShape, dtype: str, tp: int) -> int:
    """A vLLM server's weights per tensor-parallel rank: ``params * dtype_bytes / tp``. vLLM splits the attention and
    MLP matrices and the vocabulary (embeddings and LM head, ``VocabParallelEmbedding``/``ParallelLMHead``) over the
    ranks; norms and row-parallel biases are replicated and the vocabulary padded to 64 per rank (a slight
    under-count at tp > 1)."""
    return -(-shape.params * dtype_bytes(dtype) // tp)


def kv_bytes_per_token(shape: ModelShape, dtype: str, tp: int) -> int:
    """KV cache per token per rank: ``2 * layers * max(1, kv_heads // tp) * head_dim * dtype_bytes`` (K and V of
    every layer). vLLM: ``ModelConfig.get_num_kv_heads`` divides the KV heads over the ranks and replicates them when
    there are fewer than ranks; ``AttentionSpec.page_size_bytes`` = block_size * kv_heads * (K + V head size) *
    dtype size, per layer (KV cache dtype "auto" = the serving dtype). MLA and sliding-window/hybrid caches are not
    modelled (this over-counts them)."""
    return 2 * shape.layers * max(1, shape.kv_heads // tp) * shape.head_dim * dtype_bytes(dtype)


def server_reserve_bytes(shape: ModelShape, max_num_seqs: int) -> int:
    """Estimate of a server's non-KV, non-weight memory: `SERVER_FIXED_RESERVE` plus the fp32 logits of vLLM's
    dummy sampler run (``max_num_seqs * vocab * 4``; ``gpu_model_runner._dummy_sampler_run`` in its profile run)."""
    return SERVER_FIXED_RESERVE + max_num_seqs * shape.vocab * 4


def kv_tokens(budget: int, per_token: int) -> int:
    """Tokens a KV budget holds, in whole blocks of `VLLM_BLOCK_SIZE` tokens (0 for a budget <= 0)."""
    return max(0, budget // (per_token * VLLM_BLOCK_SIZE)) * VLLM_BLOCK_SIZE


def default_max_num_seqs(device: Device) -> int:
    """vLLM's API-server default (``EngineArgs.get_batch_defaults``): 1024 on >= 70 GiB devices but A100s, else 256."""
    return 1024 if device.total_bytes >= 70 * GiB and "a100" not in device.name.lower() else 256


@dataclass
class ServerPart:
    """One vLLM server: tensor-parallel over ``devices``; it claims ``gpu_memory_utilization`` of each (vLLM's
    per-instance share: weights, activations, and the KV cache in the rest)."""

    role: str  # "policy" | "teacher"
    index: int
    shape: ModelShape
    devices: list[int]
    dtype: str = "bfloat16"
    gpu_memory_utilization: float = VLLM_GPU_MEMORY_UTILIZATION
    max_model_len: int = 8192
    max_num_seqs: int | None = None  # None: vLLM's default for the device (`default_max_num_seqs`)


@dataclass
class TrainerPart:
    """The torchrun trainer: one process per device. ``reference_copy``: beta > 0 (TRL's reference model; none under
    LoRA: the adapter-disabled model is the reference). ``teacher_shape``: an in-process --teacher_model (unsharded,
    in the policy's dtype: trl_ext.distill.component). ``weights_dtype``: what the model is loaded in (TRL's and
    train.py's default float32); ``compute_dtype``: the forward's (bfloat16 under --bf16; None: ``weights_dtype``).
    ``seq_len``: prompt + completion tokens of a row; ``completion_len``: the tokens scored (TRL's
    ``logits_to_keep``; None: ``seq_len``)."""

    shape: ModelShape
    devices: list[int]
    sharding: str = "FSDP2"  # "FSDP2" | "DDP" | "none" (one process)
    lora_rank: int = 0
    lora_targets: Sequence[str] | None = None
    rows_per_micro_batch: int = 1
    seq_len: int = 1024
    completion_len: int | None = None
    gradient_checkpointing: bool = False
    reference_copy: bool = False
    teacher_shape: ModelShape | None = None
    weights_dtype: str = "float32"
    compute_dtype: str | None = None
    dual: tuple[str, int, int] | None = None  # dual adapters ("lora" | "mlp", retain rank, forget rank): routing


def trainer_items(t: TrainerPart) -> list[tuple[str, int, bool]]:
    """(label, bytes, is an estimate) of one trainer process.

    - Parameters: under FSDP2 every parameter is sharded over the N processes (``fully_shard``, PyTorch FSDP2
      docs); accelerate upcasts the trainable ones to fp32 (``fsdp2_prepare_model``), frozen ones (a LoRA base) stay
      in ``weights_dtype``: ``(frozen * dtype_bytes + trainable * 4) / N``. DDP / one process: unsharded.
    - Gradients: fp32 of the trainable parameters, / N under FSDP2; DDP adds its bucket copy (PyTorch DDP docs,
      ``gradient_as_bucket_view=False``: buckets the size of the gradients): 2 * trainable * 4.
    - AdamW: exp_avg and exp_avg_sq, 2 * trainable * 4, / N under FSDP2.
    - FSDP2 all-gathers (estimate): the root unit (embeddings, final norm, LM head) stays unsharded from forward to
      backward (``reshard_after_forward`` is False for the root) and two blocks are unsharded at once (the current
      one and the prefetched next), in the compute dtype (``MixedPrecisionPolicy.param_dtype``):
      ``(outside_params + 2 * largest_layer_params) * compute_bytes``.
    - Reference model (beta > 0, full fine-tune; TRL builds it in the policy's dtype and shards it under FSDP2):
      ``params * dtype_bytes`` (/ N). In-process teacher: ``params * dtype_bytes``, unsharded.
    - Logits (estimate): ``rows * completion_len * vocab * (compute_bytes + 4)``: the scored tokens' logits and their
      fp32 log-softmax (an upper bound where TRL's fused LM head computes log-probs in chunks).
    - Activations (estimate): ``rows * seq_len * hidden * compute_bytes`` times `ACTIVATION_ELEMENTS` per layer, or
      with gradient checkpointing one hidden state per layer plus one block's full `ACTIVATION_ELEMENTS`.
    """
    if t.sharding not in ("FSDP2", "DDP", "none"):
        raise ConfigError(f"trainer sharding must be FSDP2, DDP or none, got {t.sharding!r}")
    if t.sharding == "none" and len(t.devices) != 1:
        raise ConfigError(f"an unsharded trainer is one process, got {len(t.devices)} devices (use DDP or FSDP2)")
    s, wb, n = t.shape, dtype_bytes(t.weights_dtype), len(t.devices)
    cb = dtype_bytes(t.compute_dtype or t.weights_dtype)
    div = n if t.sharding == "FSDP2" else 1
    trainable = lora_params(s, t.lora_rank, t.lora_targets) if t.lora_rank else s.params
    what = f"LoRA rank {t.lora_rank}" if t.lora_rank else "full fine-tune"
    if t.dual is not None:  # every block adapted (an upper bound under --lora_layer_*); the head's adapters left out
        kind, retain, forget = t.dual
        if kind == "lora":  # retain and forget on the same linears: rank retain + forget
            trainable, what = lora_params(s, retain + forget, t.lora_targets), f"dual LoRA {retain} + {forget}"
        else:  # a mini-SwiGLU of n neurons beside each block's MLP: gate and up (hidden -> n), down (n -> hidden)
            trainable, what = s.layers * 3 * s.hidden * (retain + forget), f"dual MLP adapters {retain} + {forget}"
    adapted = bool(t.lora_rank or t.dual)
    frozen = s.params if adapted else 0  # the base; the adapters are the trainable ones
    shard = f"/ {n} (FSDP2)" if div > 1 else "unsharded"
    items = [(f"parameters ({what}: {trainable:,} trainable, fp32), {shard}", (frozen * wb + trainable * 4) // div,
              False),
             (f"gradients, fp32, {shard}" + (" + DDP buckets" if t.sharding == "DDP" else ""),
              trainable * 4 * (2 if t.sharding == "DDP" else 1) // div, False),
             (f"AdamW state (2 x fp32), {shard}", 2 * trainable * 4 // div, False)]  # fmt: skip
    if div > 1:
        items.append((f"FSDP2 all-gather: root unit + 2 blocks, {t.compute_dtype or t.weights_dtype} (estimate)",
                      (s.outside_params + 2 * s.largest_layer_params) * cb, True))
    if t.reference_copy and not adapted:
        items.append((f"reference model, {t.weights_dtype}, {shard}", s.params * wb // div, False))
    if t.teacher_shape is not None:
        items.append((f"in-process teacher, {t.weights_dtype}, unsharded", t.teacher_shape.params * wb, False))
    scored, tokens = t.completion_len or t.seq_len, t.rows_per_micro_batch * t.seq_len
    items.append((f"logits + fp32 log-softmax of {t.rows_per_micro_batch} x {scored} tokens (estimate)",
                  t.rows_per_micro_batch * scored * s.vocab * (cb + 4), True))
    layers_held = (s.layers + ACTIVATION_ELEMENTS) if t.gradient_checkpointing else s.layers * ACTIVATION_ELEMENTS
    items.append((f"activations of {t.rows_per_micro_batch} x {t.seq_len} tokens"
                  f"{', checkpointed' if t.gradient_checkpointing else ''} (estimate)",
                  tokens * s.hidden * layers_held * cb, True))
    items.append(("CUDA context and allocator (estimate)", TRAINER_FIXED_RESERVE, True))
    return items


@dataclass
class Part:
    """What one server or trainer process holds on one device: ``claimed`` bytes in all (a server claims its whole
    share), itemised."""

    title: str
    items: list[tuple[str, int, bool]]
    claimed: int
    kv_tokens: int | None = None
    max_model_len: int | None = None


@dataclass
class FitPlan:
    devices: dict[int, tuple[Device, list[Part]]]
    problems: list[str] = field(default_factory=list)

    def free_bytes(self, index: int) -> int:
        device, parts = self.devices[index]
        return device.total_bytes - sum(p.claimed for p in parts)

    def describe(self) -> str:
        """A table per device: each part's items in GiB, a server's KV tokens, the memory left."""
        lines, shown = [], {}
        for index, (device, parts) in self.devices.items():
            lines.append(f"{device}{f' {device.name}' if device.name else ''}")
            for part in parts:
                lines.append(f"  {part.title}")
                if id(part.items) in shown:  # the trainer's other processes: the same items
                    lines.append(f"    as on {shown[id(part.items)]}: {gib(part.claimed)} in all")
                    continue
                shown[id(part.items)] = str(device)
                lines += [f"    {label:<72} {gib(n):>11}" for label, n, _ in part.items]
                if part.kv_tokens is None:
                    lines.append(f"    {'in all':<72} {gib(part.claimed):>11}")
                else:
                    lines.append(f"    KV cache holds {part.kv_tokens:,} tokens; max_model_len {part.max_model_len:,} "
                                 f"tokens: {part.kv_tokens // part.max_model_len:,} full-length sequences")
            lines.append(f"  free after: {gib(self.free_bytes(index))}" if parts else "  unused")
        lines += [f"does not fit: {p}" for p in self.problems] or ["fits (estimates labelled; GiB = 2**30 bytes)"]
        return "\n".join(lines)

    def check(self) -> None:
        if self.problems:
            raise ConfigError("the layout does not fit its devices: " + "; ".join(self.problems))


def plan_fit(servers: Sequence[ServerPart], trainer: TrainerPart | None, inventory: Sequence[Device]) -> FitPlan:
    """Each device's parts and the problems (see the module docstring). ConfigError for a device id not in the
    inventory or named twice by one part, or a gpu_memory_utilization outside (0, 1]."""
    by_id = {d.index: d for d in inventory}
    plan = FitPlan({i: (d, []) for i, d in sorted(by_id.items())})
    shares: dict[int, list[float]] = {}

    def device(i: int, who: str, ids: Sequence[int]) -> Device:
        if i not in by_id:
            have = ", ".join(map(str, sorted(by_id))) or "none"
            raise ConfigError(f"{who} names GPU {i}, which the inventory lacks (GPUs: {have})")
        if list(ids).count(i) > 1:
            raise ConfigError(f"{who} names GPU {i} twice")
        return by_id[i]

    for s in servers:
        who, tp = f"{s.role} server {s.index}", len(s.devices)
        if not 0 < s.gpu_memory_utilization <= 1:
            raise ConfigError(f"{who}: gpu_memory_utilization must be in (0, 1], got {s.gpu_memory_utilization}")
        if not tp:
            raise ConfigError(f"{who} has no devices")
        if s.shape.heads % tp:
            plan.problems.append(f"GPUs {','.join(map(str, s.devices))}: {who}'s tensor-parallel size {tp} does not "
                                 f"divide the {s.shape.heads} attention heads (vLLM refuses it)")
        weights, per_token = serving_weight_bytes(s.shape, s.dtype, tp), kv_bytes_per_token(s.shape, s.dtype, tp)
        for i in s.devices:
            d = device(i, who, s.devices)
            share = int(s.gpu_memory_utilization * d.total_bytes)
            reserve = server_reserve_bytes(s.shape, s.max_num_seqs or default_max_num_seqs(d))
            budget = share - weights - reserve
            tokens = kv_tokens(budget, per_token)
            on = f"GPU {i}" if tp == 1 else f"GPUs {','.join(map(str, s.devices))}"
            title = (f"{who} (vLLM, tensor-parallel {tp} over {on}; "
                     f"{s.gpu_memory_utilization:g} of the device = {gib(share)})")
            items = [(f"weights, {s.dtype}, 1/{tp} of {s.shape.params:,} parameters", weights, False),
                     ("activations, sampler logits, CUDA graphs (estimate)", reserve, True),
                     (f"KV cache at {per_token:,} bytes per token", max(budget, 0), False)]  # fmt: skip
            plan.devices[i][1].append(Part(title, items, share, tokens, s.max_model_len))
            shares.setdefault(i, []).append(s.gpu_memory_utilization)
            if budget <= 0:
                plan.problems.append(f"{d}: {who} needs {gib(weights)} of weights in {s.dtype} + {gib(reserve)} "
                                     f"of activations (estimate) with {s.gpu_memory_utilization:g} of the device = "
                                     f"{gib(share)}")
            elif tokens < s.max_model_len:
                plan.problems.append(f"{d}: {who}'s KV cache of {gib(budget)} ({s.gpu_memory_utilization:g} of the "
                                     f"device = {gib(share)} less {gib(weights)} of weights in {s.dtype} and "
                                     f"{gib(reserve)} reserved) holds {tokens:,} tokens at {per_token:,} bytes per "
                                     f"token, fewer than max_model_len {s.max_model_len:,} (vLLM refuses it)")
    for i, fractions in shares.items():
        if sum(fractions) > 1:
            plan.problems.append(f"{by_id[i]}: its servers claim {' + '.join(f'{f:g}' for f in fractions)} = "
                                 f"{sum(fractions):g} of the device (more than all of it)")
    if trainer is not None:
        items = trainer_items(trainer)
        need = sum(n for _, n, _ in items)
        short: dict[tuple[int, int], list[Device]] = {}  # (bytes left, total) -> the devices short of memory
        for rank, i in enumerate(trainer.devices):
            d = device(i, "the trainer", trainer.devices)
            left = plan.free_bytes(i)
            how = "one process" if trainer.sharding == "none" else f"{trainer.sharding} over {len(trainer.devices)} " \
                                                                    "processes"
            plan.devices[i][1].append(Part(f"trainer process {rank} ({how})", items, need))
            if need > left:
                short.setdefault((left, d.total_bytes), []).append(d)
        parts = ", ".join(f"{label.split(' (')[0].split(',')[0]}{' (estimate)' * est} {gib(n)}"
                          for label, n, est in items)
        for (left, _), ds in short.items():
            alike = f" (and GPUs {', '.join(str(d.index) for d in ds[1:])} alike)" if len(ds) > 1 else ""
            plan.problems.append(f"{ds[0]}{alike}: a trainer process needs {gib(need)} ({parts}) but {gib(left)} is "
                                 "left" + (" after the servers' shares" if ds[0].index in shares else ""))
    return plan
