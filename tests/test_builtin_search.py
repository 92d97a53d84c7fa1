"""The builtin_search model's recipe without building it (about 20 minutes): the imperfect agent's episodes, the
corpus, the registration and the pretraining window length."""

import random

import pytest

from environments.base import HELDOUT_LEVELS, make_env
from trl_ext.models import BUILTIN_MODELS, resolve_model_arg
from trl_ext.models import builtin as bm
from trl_ext.models import builtin_search as bs


@pytest.fixture(scope="module")
def episodes():
    env = make_env("search")
    rng = random.Random(0)
    out = []
    for i in range(1500):
        traj = bs.noisy_episode(env, bs.LEVEL_SEED_BASE + i, rng)
        out.append((env.question, traj))
    return env, out


def test_every_episode_is_search_read_answer(episodes):
    env, eps = episodes
    for q, t in eps:
        kinds = [turn.info["action_kind"] for turn in t.turns]
        assert kinds == ["search", "read", "answer"] and t.done and t.n_invalid == 0
        assert t.turns[1].info["title"].lower() == t.turns[0].info["results"][0].lower()  # reads the first result


def test_search_and_answer_rates_match_the_recipe(episodes):
    """Searches the entity with P_SEARCH; on the right page answers right with P_ANSWER, otherwise wrong with the
    answer of another question about the page read (NO_FACT where none is asked about it)."""
    env, eps = episodes
    n = len(eps)
    searched = sum(t.turns[0].info["action"] == f"search: {q.subject.lower()}" for q, t in eps)
    assert abs(searched / n - bs.P_SEARCH) < 3 * (bs.P_SEARCH * (1 - bs.P_SEARCH) / n) ** 0.5 + 1e-9
    right_page = [(q, t) for q, t in eps if t.turns[1].info["title"] == q.title]
    right = sum(t.success for _, t in right_page)
    m = len(right_page)
    assert m >= 0.85 * n  # the entity's search puts its page first
    assert abs(right / m - bs.P_ANSWER) < 3 * (bs.P_ANSWER * (1 - bs.P_ANSWER) / m) ** 0.5
    for q, t in eps:
        if t.turns[1].info["title"] != q.title:
            assert not t.success
        if not t.success:
            page = t.turns[1].info["title"]
            facts = {x.answer.lower() for x in env.corpus.questions if x.title == page}
            said = t.turns[2].info["action"].removeprefix("answer: ")
            assert said in facts or (not facts and said == bs.NO_FACT)


def test_corpus_is_deterministic_and_never_sees_heldout_levels(monkeypatch):
    monkeypatch.setattr(bs, "EPISODES", 40)
    monkeypatch.setattr(bs, "STORIES", 10)
    docs = bs.corpus()
    assert docs == bs.corpus() and len(docs) == 50
    assert sum(d.startswith("question: ") for d in docs) == 40
    assert bs.LEVEL_SEED_BASE + bs.EPISODES <= HELDOUT_LEVELS
    monkeypatch.setattr(bs, "LEVEL_SEED_BASE", HELDOUT_LEVELS - 10)
    with pytest.raises(ValueError, match="held-out"):
        bs.corpus()


def test_registered_and_cached_by_version():
    assert resolve_model_arg("builtin_search") == "builtin_search"
    assert BUILTIN_MODELS["builtin_search"] is bs.ensure_builtin_search
    assert bs.builtin_search_dir().name == f"builtin-search-{bs.VERSION}"


def test_pretrain_window_length():
    """``seq_len`` sets the pretraining window: tokens seen = steps x batch x seq_len (builtin keeps SEQ_LEN)."""
    from trl_ext.models.builtin_env import env_tokenizer

    docs = ["question: who is the keeper of the old park?"] * 20
    model, _, info = bm.pretrain_on(docs, env_tokenizer(docs), lambda msg: None, steps=1, seq_len=16)
    assert info["tokens_seen"] == bm.BATCH_SIZE * 16 and info["steps"] == 1
    assert bm.pretrain_on.__defaults__[-1] == bm.SEQ_LEN
