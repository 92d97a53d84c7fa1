"""``--model builtin_env``: the builtin model's variant for the text environments.

The builtin model's tokenizer was trained on stories only: it has no ``<``, ``>``, ``_``, ``*``, ``#``
or digits, so environment observations and ``<answer>`` tags become [UNK]. This variant is built the
same way (``trl_ext.models.builtin``: same tokenizer pipeline and pruning, same SimpleStories-1.25M-shaped
Llama, same pretraining loop and schedule) from a corpus that adds environment transcripts to the stories:

- ``STORIES`` stories (``generate_stories``, the builtin corpus' seed);
- ``EPISODES_PER_ENV`` episodes of each of ``PRETRAIN_ENVS`` (the environments v4 was built with; search came
  later and is not in this model's corpus), on level seeds from ``LEVEL_SEED_BASE``
  on (far from the seeds that training, SFT and validation use), with the environments' default
  parameters (RAGEN's prompts: the ``<think>`` prefill, named bandit arms, slippery FrozenLake), played
  by a uniformly random policy that always answers ``<answer>action</answer>`` right after the prefill
  (arithmetic: a uniformly random integer in 0..``RANDOM_ANSWER_MAX``). The model thus learns the format and the observation layout, not a
  good policy: the environment experiments start from chance-level behaviour.

One deviation from the builtin tokenizer: its whitespace pre-tokenizer drops line breaks, which end
every observation and answer here, so a normalizer first rewrites ``"\n"`` to the token ``|`` (a
symbol no environment prints); without it the model cannot tell where an observation ends.

Cached in ``<cache>/builtin-env-<VERSION>/`` with the builtin model's lock and completeness check.
CLI: ``uv run python -m trl_ext.models.builtin_env [--rebuild]``.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from trl_ext.models import builtin as bm

BUILTIN_ENV = "builtin_env"  # the --model value that selects this model
VERSION = "v4"  # v3, v4: RAGEN prompts (issue 13; v4: the condensed bandit prompt)
NEWLINE = "|"  # the line-break token (see ``env_tokenizer``)
STORIES = 5000
EPISODES_PER_ENV = 2000
LEVEL_SEED_BASE = 1_000_000
CORPUS_SEED = 7
PRETRAIN_ENVS = ("arithmetic", "frozenlake", "prisoners_dilemma", "sokoban", "two_armed_bandit")  # in this order
RANDOM_ANSWER_MAX = 100


def builtin_env_dir() -> Path:
    return bm.cache_dir() / f"builtin-env-{VERSION}"


def random_episode_text(env, level_seed: int, rng: random.Random, max_turns: int) -> str:
    """One random-policy episode rendered as the policy sees it (``Trajectory.history_text``)."""
    from environments.base import answer_text, run_episode

    def policy(_history: str) -> str:
        if env.name == "arithmetic":
            return answer_text(str(rng.randint(0, RANDOM_ANSWER_MAX)))
        return answer_text(rng.choice(env.action_words))

    traj = run_episode(env, policy, level_seed, max_turns)
    if env.single_step:  # end right after the answer, so the model learns to stop there
        return traj.observation + "\n" + traj.prefill + traj.turns[0].agent
    return traj.history_text()


def corpus() -> list[str]:
    """Stories and environment transcripts, interleaved deterministically."""
    from environments.base import make_env
    from environments.stories import PRETRAIN_SEED, generate_stories

    rng = random.Random(CORPUS_SEED)
    docs = generate_stories(STORIES, seed=PRETRAIN_SEED)
    for name in PRETRAIN_ENVS:
        env = make_env(name)
        for i in range(EPISODES_PER_ENV):
            docs.append(random_episode_text(env, LEVEL_SEED_BASE + i, rng, env.max_turns_default))
    rng.shuffle(docs)
    return docs


def env_tokenizer(docs: list[str]):
    """``builtin_model.train_tokenizer`` on ``docs``, with line breaks kept as the ``NEWLINE`` token."""
    from tokenizers import normalizers

    tokenizer = bm.train_tokenizer([d.replace("\n", f" {NEWLINE} ") for d in docs])
    backend = tokenizer.backend_tokenizer
    backend.normalizer = normalizers.Sequence([normalizers.Replace("\n", f" {NEWLINE} "), backend.normalizer])
    return tokenizer


def build_into(out_dir: Path) -> dict:
    """Tokenizer + model + pretraining exactly as ``builtin_model._build``, on ``corpus()``."""
    import torch

    t0 = time.time()
    torch.set_num_threads(bm.NUM_THREADS)
    log = bm.build_logger("builtin_env", t0)
    docs = corpus()
    model, tokenizer, info = bm.pretrain_on(docs, env_tokenizer(docs), log)
    return bm.save_build(out_dir, model, tokenizer, {"version": VERSION, **info}, t0, log)


def ensure_builtin_env(rebuild: bool = False) -> Path:
    """The built variant's directory; built once (in a subprocess, under a file lock) when absent."""
    return bm.ensure_built(builtin_env_dir(), "trl_ext.models.builtin_env", rebuild, "the builtin_env model")


def main(argv: list[str] | None = None) -> None:
    bm.cli(argv, "Build (once) and show the builtin_env model.", ensure_builtin_env, build_into)


if __name__ == "__main__":
    main()
