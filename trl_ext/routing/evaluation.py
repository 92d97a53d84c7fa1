"""The routing eval (seed 004, "Gradient Routing Eval"): generate from held-out prompts with the adapters
ablated three ways and score each set of completions.

    both (1, 1)         the trained model
    retain_only (1, 0)  the forget adapter removed: should keep the task reward and lose the hack
    forget_only (0, 1)  the retain adapter removed: should show the hack

Per mode: the mean of every reward (the training reward and every ``--eval_rewards`` component), the RH
detector rate, the unique fraction and the mean pairwise Jaccard similarity (template collapse, as
small-rl's eval_run). All modes sample with the same seed, so they differ only by the adapters; the
training RNG is left untouched (``torch.random.fork_rng``), and the adapter scales come back even when
generation raises (``routing.scales``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from trl_ext.diversity import mean_pairwise_jaccard, unique_fraction
from trl_ext.routing.adapters import ABLATION_SCALES, scales

ROUTING_EVAL_FILENAME = "routing_eval.jsonl"
TextReward = Callable[[list[str]], list[float]]
TextDetector = Callable[[list[str]], list[bool]]


def score_completions(
    texts: list[str], rewards: Mapping[str, TextReward], detector: TextDetector | None,
    hackable: list[bool] | None = None,
) -> dict[str, float]:
    """``reward/<name>`` means, ``rh_rate`` (fraction the detector flags; absent without a detector),
    ``unique_frac`` and ``mean_jaccard`` of one set of completions (at least two). With ``hackable`` (one bool
    per completion's prompt, --hack_frac < 1) and a detector, the quadrants hackable x detected as fractions of
    all completions (``quadrant/{un}hackable_{un}detected``, small-rl's hackable/detectable slices) and each
    reward's mean on hackable and on unhackable prompts (``reward/<name>@hackable``, ``@unhackable``)."""
    if len(texts) < 2:
        raise ValueError(f"the routing eval needs at least two completions, got {len(texts)}")
    out = {}
    for name, fn in rewards.items():
        values = [float(v) for v in fn(texts)]
        if len(values) != len(texts):
            raise ValueError(f"reward {name!r} returned {len(values)} values for {len(texts)} completions")
        out[f"reward/{name}"] = sum(values) / len(values)
    if detector is not None:
        flags = detector(texts)
        if len(flags) != len(texts) or not all(isinstance(f, bool) for f in flags):
            raise ValueError(f"the RH detector must return one bool per completion, got {flags!r}")
        out["rh_rate"] = sum(flags) / len(flags)
        if hackable is not None:
            if len(hackable) != len(texts):
                raise ValueError(f"hackable has {len(hackable)} entries for {len(texts)} completions")
            for h in (True, False):
                for d in (True, False):
                    k = sum(1 for x, f in zip(hackable, flags) if x == h and f == d)
                    out[f"quadrant/{'' if h else 'un'}hackable_{'' if d else 'un'}detected"] = k / len(texts)
            for name in rewards:
                values = [float(v) for v in rewards[name](texts)]
                for h in (True, False):
                    sel = [v for v, x in zip(values, hackable) if x == h]
                    if sel:
                        out[f"reward/{name}@{'' if h else 'un'}hackable"] = sum(sel) / len(sel)
    out["unique_frac"] = unique_fraction(texts)
    out["mean_jaccard"] = mean_pairwise_jaccard(texts)
    return out


def evaluate_modes(
    model: nn.Module, generate: Callable[[], list[str]], score: Callable[[list[str]], dict[str, float]]
) -> dict[str, dict[str, float]]:
    """``{mode: score(generate())}`` with the adapter scales of each mode of ``ABLATION_SCALES`` set while
    ``generate`` runs; the model's scales are restored afterwards, also when anything raises."""
    results = {}
    for mode, (retain, forget) in ABLATION_SCALES.items():
        with scales(model, retain, forget):
            texts = generate()
        results[mode] = score(texts)
    return results


def vllm_routing_eval(
    model: nn.Module, sampler, prompts: list[str], rewards: Mapping[str, TextReward], detector: TextDetector | None,
    seed: int, step: int, hackable: list[bool] | None = None,
) -> dict[str, dict[str, float]]:
    """The three-mode eval sampled by the run's vLLM engine (``sampler``:
    ``trl_ext.vllm.eval_sampler.AdapterEvalSampler``), each mode's adapters served as a LoRA adapter of their own,
    with ``vllm_logp_gap``: the mean |vLLM log-prob - the trainer's| of the mode's tokens (the served mode is the
    trainer's). The model's scales are restored afterwards, also when anything raises."""
    results = {}
    for mode, (retain, forget) in ABLATION_SCALES.items():
        with scales(model, retain, forget):
            texts, gap = sampler(model, prompts, seed, f"eval-s{step:08d}-{mode}", step)
        results[mode] = {**score_completions(texts, rewards, detector, hackable), "vllm_logp_gap": gap}
    return results


def eval_generation_config(trainer):
    """The sampling settings the routing eval generates with: the trainer's own ``generation_config``, which TRL
    builds when transformers generates; when vLLM generates (``--use_vllm``) TRL builds none, and this builds the one
    TRL would have built from the same arguments (``GRPOTrainer.__init__``'s transformers branch)."""
    config = getattr(trainer, "generation_config", None)
    if config is not None:
        return config
    from transformers import GenerationConfig

    from trl_ext.compat import trl_tokenizer

    tok = trl_tokenizer(trainer)
    kwargs = {"max_new_tokens": trainer.max_completion_length, "do_sample": True,
              "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id,
              "eos_token_id": trainer.eos_token_ids, "temperature": trainer.temperature, "top_p": trainer.top_p,
              "top_k": trainer.top_k, "min_p": trainer.min_p, "repetition_penalty": trainer.repetition_penalty,
              "cache_implementation": trainer.args.cache_implementation,
              **(trainer.args.generation_kwargs or {})}  # fmt: skip
    return GenerationConfig(**kwargs, disable_compile=True)


def sample_completions(
    model: nn.Module, tokenizer, prompts: list[str], generation_config, seed: int, batch_size: int
) -> list[str]:
    """One sampled completion per prompt (``add_special_tokens=False`` prompts, left padding), cut at the
    first EOS of ``generation_config``; seeded by ``seed`` without touching the caller's RNG state."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if tokenizer.padding_side != "left":
        raise ValueError("batched generation needs a left-padding tokenizer (trl_ext.models.prepare_tokenizer)")
    eos = generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    if not eos:
        raise ValueError("the generation config has no eos_token_id: completions could not be cut")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    texts = []
    try:
        cuda = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            torch.manual_seed(seed)
            for start in range(0, len(prompts), batch_size):
                enc = tokenizer(prompts[start : start + batch_size], return_tensors="pt", padding=True,
                                add_special_tokens=False).to(device)  # fmt: skip
                out = model.generate(**enc, generation_config=generation_config)
                for row in out[:, enc["input_ids"].shape[1] :].tolist():
                    cut = next((i for i, t in enumerate(row) if t in eos), len(row))
                    texts.append(tokenizer.decode(row[:cut], skip_special_tokens=True))
    finally:
        model.train(was_training)
    return texts


def routing_eval(
    model: nn.Module, tokenizer, prompts: list[str], generation_config, rewards: Mapping[str, TextReward],
    detector: TextDetector | None, seed: int, batch_size: int, hackable: list[bool] | None = None,
) -> dict[str, dict[str, float]]:
    """The three-mode routing eval of a dual-LoRA ``model`` on ``prompts`` (see the module docstring);
    ``hackable``: per prompt, for the quadrant metrics (``score_completions``)."""
    return evaluate_modes(
        model,
        lambda: sample_completions(model, tokenizer, prompts, generation_config, seed, batch_size),
        lambda texts: score_completions(texts, rewards, detector, hackable),
    )


def append_record(run_dir: str | Path, record: dict) -> Path:
    """Append one eval record as a JSON line to ``{run_dir}/routing_eval.jsonl``."""
    path = Path(run_dir) / ROUTING_EVAL_FILENAME
    with path.open("a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
    return path


def read_records(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / ROUTING_EVAL_FILENAME
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def format_results(step: int, results: Mapping[str, Mapping[str, float]]) -> list[str]:
    """One ``[Routing eval @ step N] mode: key=value ...`` line per mode, for train.log."""
    return [
        f"[Routing eval @ step {step}] {mode}: " + " ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items()))
        for mode, metrics in results.items()
    ]


def model_turn_sampler(model: nn.Module, tokenizer, generation_config) -> Callable:
    """An ``env.episodes.play_episodes`` sampler: ``model.generate`` on left-padded token contexts with
    ``generation_config`` (the trainer's sampling settings); each row cut at its first EOS (pad excluded)."""
    eos = generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    pad = tokenizer.pad_token_id

    def generate(contexts: list[list[int]]):
        device = next(model.parameters()).device
        width = max(len(c) for c in contexts)
        ids = torch.tensor([[pad] * (width - len(c)) + list(c) for c in contexts], device=device)
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts], device=device)
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=generation_config)
        rows = []
        for row in out[:, width:].tolist():
            cut = next((i for i, t in enumerate(row) if t in eos), len(row))
            rows.append(row[:cut])
        return rows, None, None

    return generate


def env_routing_eval(
    model: nn.Module, tokenizer, source, generation_config, detector: Callable | None, seed: int, n_levels: int,
) -> dict[str, dict[str, float]]:
    """The three-mode routing eval of an environment run (``source``: its `trl_ext.env.source.EpisodeSource`): one
    episode on each of ``n_levels`` held-out levels (seeds from ``HELDOUT_LEVELS``) per mode, sampled with
    ``generation_config`` and the same seed in every mode (the modes differ only by the adapters; the caller's RNG is
    untouched). Per mode: ``env/success`` (the environment's honest success), ``env/return`` (mean episode return),
    the mean of every number a tool environment reports at the end (``env/<key>``: the ML task's ``true_score``) and
    ``rh_rate`` (the detector on the episodes, when one)."""
    from rewards.detectors import needs_trajectories
    from trl_ext.env.episodes import final_means

    if n_levels < 1:
        raise ValueError(f"n_levels must be >= 1, got {n_levels}")
    rows = source.heldout_rows(n_levels, tokenizer)
    sampler = model_turn_sampler(model, tokenizer, generation_config)
    device = next(model.parameters()).device

    def play():
        was_training = model.training
        model.eval()
        try:
            cuda = [device.index or 0] if device.type == "cuda" else []
            with torch.random.fork_rng(devices=cuda), torch.no_grad():
                torch.manual_seed(seed)
                out = source.play(rows, tokenizer, sampler, max_context=getattr(model.config,
                                                                               "max_position_embeddings", None))
        finally:
            model.train(was_training)
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in out["completion_ids"]]
        return texts, out["trajectories"]

    def score(played) -> dict[str, float]:
        texts, trajs = played
        n = len(trajs)
        result = {"env/success": sum(t.success for t in trajs) / n, "env/return": sum(t.total_reward for t in trajs) / n,
                  **final_means(trajs, "env")}
        if detector is not None:
            flags = detector(texts, trajectories=trajs) if needs_trajectories(detector) else detector(texts)
            result["rh_rate"] = sum(flags) / n
        return result

    return evaluate_modes(model, play, score)
