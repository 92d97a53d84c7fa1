"""``--model builtin_search``: the builtin_env recipe pretrained on imperfect search episodes, for RL on search.

builtin_env never saw the search environment: after SFT on the scripted trajectories it still solved none of the
held-out questions, so RL had no reward to climb. This variant is the builtin_env recipe (same WordPiece pipeline with
the line-break token, same Llama, same schedule) with a corpus and length fitted to search episodes:

- ``STORIES`` stories (the builtin corpus' seed) and ``EPISODES`` search episodes (the environment's defaults:
  ``k`` 3, 400 pages) on training levels from ``LEVEL_SEED_BASE`` (never the held-out levels);
- each episode is played by an imperfect scripted agent (``noisy_episode``): it searches the question's entity with
  probability ``P_SEARCH`` (else a random title), reads the first result, and answers the asked fact with
  probability ``P_ANSWER`` when it read the right page (else the answer of another question about the page it read,
  ``NO_FACT`` on a page no question asks about). The model learns the action format and the retrieval pattern
  but copies the asked fact less often than the agent: RL starts at 0.12-0.21 sampled success on training levels
  (measured over 18 runs' first 20 steps) and 0.095 greedy on 400 held-out levels; which fact answers which
  question is what RL has to learn;
- ``SEQ_LEN`` 384 tokens per pretraining window (an episode is about 300), ``STEPS`` 1200 steps.

Cached in ``<cache>/builtin-search-<VERSION>/``; the build takes about 20 minutes on 2 cores, so no test builds it.
CLI: ``uv run python -m trl_ext.models.builtin_search [--rebuild]``.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from trl_ext.models import builtin as bm

BUILTIN_SEARCH = "builtin_search"  # the --model value that selects this model
VERSION = "v1"
STORIES = 2000
EPISODES = 12_000
LEVEL_SEED_BASE = 50_000  # training levels (below environments.base.HELDOUT_LEVELS)
CORPUS_SEED = 0
SHUFFLE_SEED = 1
P_SEARCH = 0.9  # searches the question's entity (else a random title)
P_ANSWER = 0.5  # on the right page: answers the asked fact (else another fact of the page)
MAX_TURNS = 3  # search, read, answer
NO_FACT = "nothing"  # the answer after reading a page no question asks about
SEQ_LEN = 384
STEPS = 1200


def builtin_search_dir() -> Path:
    return bm.cache_dir() / f"builtin-search-{VERSION}"


def noisy_episode(env, level_seed: int, rng: random.Random):
    """One episode of the imperfect agent (see the module docstring), as a ``Trajectory``."""
    from environments.base import answer_text, run_episodes
    from environments.search_corpus import normalize

    titles = [p.title.lower() for p in env.corpus.pages]
    asked = {}  # page title -> the questions about it
    for q in env.corpus.questions:
        asked.setdefault(q.title.lower(), []).append(q)

    def policy(trajs):
        traj, q = trajs[0], env.question
        if not traj.turns:
            return [answer_text(f"search: {q.subject.lower() if rng.random() < P_SEARCH else rng.choice(titles)}")]
        info = traj.turns[-1].info
        if info.get("action_kind") == "search":
            results = info["results"]
            return [answer_text(f"read: {results[0].lower() if results else rng.choice(titles)}")]
        page = info["title"].lower()
        if page == q.title.lower() and rng.random() < P_ANSWER:
            return [answer_text(f"answer: {q.answer.lower()}")]
        others = asked.get(page, [])
        pool = [x for x in others if normalize(x.answer) != normalize(q.answer)] or others
        return [answer_text(f"answer: {rng.choice(pool).answer.lower() if pool else NO_FACT}")]

    return run_episodes([env], policy, [level_seed], MAX_TURNS)[0]


def corpus() -> list[str]:
    """``EPISODES`` episodes (as the policy sees them) and ``STORIES`` stories, shuffled deterministically."""
    from environments.base import HELDOUT_LEVELS, make_env
    from environments.stories import PRETRAIN_SEED, generate_stories

    if LEVEL_SEED_BASE + EPISODES > HELDOUT_LEVELS:
        raise ValueError("builtin_search: pretraining levels reach the held-out levels (whose questions stay unseen)")
    env = make_env("search")
    rng = random.Random(CORPUS_SEED)
    docs = [noisy_episode(env, LEVEL_SEED_BASE + i, rng).history_text() for i in range(EPISODES)]
    docs += generate_stories(STORIES, seed=PRETRAIN_SEED)
    random.Random(SHUFFLE_SEED).shuffle(docs)
    return docs


def build_into(out_dir: Path) -> dict:
    """builtin_env's tokenizer and pretraining on ``corpus()`` with ``SEQ_LEN`` and ``STEPS``."""
    import torch

    from trl_ext.models.builtin_env import env_tokenizer

    t0 = time.time()
    torch.set_num_threads(bm.NUM_THREADS)
    log = bm.build_logger("builtin_search", t0)
    docs = corpus()
    model, tokenizer, info = bm.pretrain_on(docs, env_tokenizer(docs), log, steps=STEPS, seq_len=SEQ_LEN)
    return bm.save_build(out_dir, model, tokenizer, {"version": VERSION, **info}, t0, log)


def ensure_builtin_search(rebuild: bool = False) -> Path:
    """The built variant's directory; built once (in a subprocess, under a file lock) when absent."""
    return bm.ensure_built(builtin_search_dir(), "trl_ext.models.builtin_search", rebuild, "the builtin_search model")


def main(argv: list[str] | None = None) -> None:
    bm.cli(argv, "Build (once) and show the builtin_search model.", ensure_builtin_search, build_into)


if __name__ == "__main__":
    main()
