"""``--eval_baseline``: before training, the student (prompt) and the teacher (context + prompt) sampled on held-out
prompts and scored by the task reward and the RH detector (seed 002's ``eval_baseline``)."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import torch
from trl.trainer.utils import pad

from trl_ext.compat import tokenize_prompts, trl_tokenizer


@torch.no_grad()
def eval_baseline(trainer, prompts: list[str], scorers: dict[str, callable]) -> dict[str, dict[str, float]]:
    """Student (prompt) vs teacher (context + prompt): one sample per prompt each, with the trainer's generation
    config, scored by every ``scorers`` entry (``list[str] -> list[float | bool]``, mean reported). Seeded by
    ``--seed`` without touching the training RNG. Prints one line per side and writes
    ``{output_dir}/eval_baseline.json``."""
    policy = trainer.accelerator.unwrap_model(trainer.model)
    ids = [torch.tensor(row, dtype=torch.long) for row in tokenize_prompts(trainer, prompts)[0]]
    device = trainer.accelerator.device
    prompt_ids = pad(ids, padding_value=trl_tokenizer(trainer).pad_token_id, padding_side="left").to(device)
    prompt_mask = pad([torch.ones_like(row) for row in ids], padding_value=0, padding_side="left").to(device)
    results = {}
    was_training = policy.training
    policy.eval()
    try:
        for side in ("student", "teacher"):
            teacher_side = side == "teacher"
            distill = trainer.components.distill
            scope = distill.teacher_scope() if teacher_side else nullcontext(policy)
            x, m = distill.teacher_prompt_ids(prompt_ids, prompt_mask) if teacher_side else (prompt_ids, prompt_mask)
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), scope as model:
                torch.manual_seed(trainer.args.seed)
                out = model.generate(input_ids=x, attention_mask=m, generation_config=trainer.generation_config)
            texts = trainer.processing_class.batch_decode(out[:, x.size(1):], skip_special_tokens=True)
            results[side] = {name: sum(float(v) for v in fn(texts)) / len(texts) for name, fn in scorers.items()}
            print(f"eval_baseline {side}: " + " ".join(f"{k}={v:.4f}" for k, v in results[side].items())
                  + f" | sample: {prompts[0]} ||| {texts[0]}", flush=True)
    finally:
        policy.train(was_training)
    Path(trainer.args.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(trainer.args.output_dir) / "eval_baseline.json").write_text(json.dumps(results, indent=2))
    return results


def run_eval_baseline(trainer, run, reward_config, source: str) -> dict[str, dict[str, float]]:
    """`eval_baseline` on ``--eval_baseline_prompts`` held-out prompts (``load_prompts(source, ...)``, split
    'test') with the task reward and the RH detector."""
    from environments.stories import load_prompts

    cfg = trainer.args
    prompts = load_prompts(source, trainer.processing_class, run.prompt_length, "test", cfg.eval_baseline_prompts,
                           cfg.seed)
    scorers = {f"task/{run.reward}": reward_config.reward(run.reward)}
    detector = getattr(cfg, "rh_detector", None) or reward_config.default_detector(run.reward)
    if detector is not None:
        scorers[f"rh/{detector}"] = reward_config.detector(detector)
    return eval_baseline(trainer, list(prompts["prompt"]), scorers)
