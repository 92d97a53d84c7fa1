"""``--model builtin_mood``: the builtin model's variant whose stories can carry a mood.

The builtin corpus draws every feeling word independently, so no preceding text changes what the
builtin model writes: a context-distillation teacher ("A happy story." + prompt) would be the
student itself. This variant is built like ``trl_ext.models.builtin`` (same tokenizer pipeline,
Llama shape, pretraining loop and schedule shape, same corpus size and seed; ``STEPS`` steps) from
``environments.stories.generate_mood_stories``: ``TITLED_FRACTION`` of the stories start with a
title "A <feeling> story." and their feeling slots follow it w.p. ``MOOD_WEIGHT``; all other
stories are the builtin corpus' stories of the same index. Prompts are the builtin held-out
stories (untitled), so the student without a title writes like the builtin model, while the same
weights given the title become a teacher with that mood.

``build_info.json`` reports the happy rate of samples with and without ``TEACHER_CONTEXT``.
Cached in ``<cache>/builtin-mood-<VERSION>/``. CLI: ``uv run python -m trl_ext.models.builtin_mood [--rebuild]``.
"""

from __future__ import annotations

import time
from pathlib import Path

from trl_ext.models import builtin as bm

BUILTIN_MOOD = "builtin_mood"  # the --model value that selects this model
VERSION = "v1"
TITLED_FRACTION = 0.5
MOOD_WEIGHT = 1.0
STEPS = 400  # twice the builtin's: attending back to the title takes longer to learn than the stories
TEACHER_CONTEXT = "A happy story."  # the context the build info measures (the distillation experiment's)


def builtin_mood_dir() -> Path:
    return bm.cache_dir() / f"builtin-mood-{VERSION}"


def build_into(out_dir: Path) -> dict:
    """``builtin_model``'s build on ``generate_mood_stories``; build info with and without the title."""
    import torch

    from environments.stories import PRETRAIN_SEED, generate_mood_stories

    t0 = time.time()
    torch.set_num_threads(bm.NUM_THREADS)
    log = bm.build_logger("builtin_mood", t0)
    docs = generate_mood_stories(bm.CORPUS_STORIES, PRETRAIN_SEED, TITLED_FRACTION, MOOD_WEIGHT)
    model, tokenizer, info = bm.pretrain_on(docs, bm.train_tokenizer(docs), log, STEPS)
    teacher = bm.sample_stats(model, tokenizer, context=TEACHER_CONTEXT)
    info = {"version": VERSION, **info, **bm.sample_stats(model, tokenizer),
            "teacher_context": TEACHER_CONTEXT, "teacher_sample_happy_rate": teacher["sample_happy_rate"]}  # fmt: skip
    return bm.save_build(out_dir, model, tokenizer, info, t0, log)


def ensure_builtin_mood(rebuild: bool = False) -> Path:
    """The built variant's directory; built once (in a subprocess, under a file lock) when absent."""
    return bm.ensure_built(builtin_mood_dir(), "trl_ext.models.builtin_mood", rebuild, "the builtin_mood model")


def main(argv: list[str] | None = None) -> None:
    bm.cli(argv, "Build (once) and show the builtin_mood model.", ensure_builtin_mood, build_into)


if __name__ == "__main__":
    main()
