"""The search environment: its generated encyclopedia, BM25 retrieval, dynamics, rewards, SFT script, tokenizer
coverage on builtin_env, and a 2-step GRPO run."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from types import SimpleNamespace

import bm25s
import pytest

from environments.base import HELDOUT_LEVELS, TRAIN_LEVELS, answer_text, make_env, no_think_rewrite, run_episode
from environments.search import CUT_MARK, DEFAULT_PAGE_CHARS, HELDOUT_SHARE, min_page_chars, visible_text
from environments.search_corpus import (MAX_PAGES, MIN_PAGES, Corpus, Page, SearchIndex, build_corpus, heldout_titles,
                                        normalize)
from environments.solvers import sft_pairs
from trl_ext.registry import ConfigError


def _env(**params):
    return make_env("search", **params)


def _ask(env, seed: int):
    env.reset(seed)
    return env.question


def _padded(text: str) -> str:
    return f" {normalize(text)} "


# ---------------------------------------------------------------------------------------------------
# Corpus


def test_corpus_is_deterministic_and_sized():
    a, b = build_corpus(400, 0), build_corpus.__wrapped__(400, 0)  # the cached one and a fresh build
    assert a == b and a is not b
    assert build_corpus.__wrapped__(400, 1) != a
    kinds = [" the " in p.title for p in a.pages]
    assert len(a.pages) == 400 and kinds.count(True) == 200  # 200 characters, 80 places, 120 objects
    assert len(a.questions) == 200 * 4 + 80 * 3 + 120 * 3
    assert len({normalize(p.title) for p in a.pages}) == 400
    for n in (MIN_PAGES, 57, MAX_PAGES):
        assert len(build_corpus(n, 3).pages) == n
    for bad in (MIN_PAGES - 1, MAX_PAGES + 1, 40.0, True):
        with pytest.raises(ValueError, match="n_pages"):
            build_corpus(bad, 0)


@pytest.mark.parametrize("n_pages,seed", [(400, 0), (MAX_PAGES, 7)])
def test_each_fact_is_on_exactly_one_page_and_not_in_the_question(n_pages, seed):
    """A question's fact is a sentence of its page only; no other sentence of the corpus names both the subject and
    the answer; the answer is not in the question nor in the page's lead (the search snippet)."""
    corpus = build_corpus(n_pages, seed)
    sentences = [(p.title, _padded(s)) for p in corpus.pages for s in p.sentences]
    by_subject: dict[str, list] = {}
    for p in corpus.pages:
        key = _padded(p.title)
        by_subject[p.title] = [(t, s) for t, s in sentences if key in s]
    for q in corpus.questions:
        assert [p.title for p in corpus.pages if q.fact in p.sentences] == [q.title] and q.subject == q.title
        holders = [t for t, s in by_subject[q.subject] if _padded(q.answer) in s]
        assert holders == [q.title], (q, holders)
        assert _padded(q.answer) not in _padded(q.text), q
        assert _padded(q.answer) not in _padded(corpus.page(q.title).lead), q
    assert len({(q.text, q.answer) for q in corpus.questions}) == len(corpus.questions)


def test_heldout_levels_ask_about_heldout_pages_only():
    env = _env()
    held = heldout_titles(env.corpus, HELDOUT_SHARE)
    assert len(held) == 80 and held == heldout_titles(build_corpus.__wrapped__(400, 0), HELDOUT_SHARE)
    train = {_ask(env, s).title for s in range(TRAIN_LEVELS, TRAIN_LEVELS + 600)}
    heldout = {_ask(env, s).title for s in range(HELDOUT_LEVELS, HELDOUT_LEVELS + 300)}
    assert heldout <= held and not train & held and len(heldout) > 50 and len(train) > 250
    assert len(env.questions[False]) + len(env.questions[True]) == len(env.corpus.questions)
    env.reset(TRAIN_LEVELS)  # held-out pages stay searchable and readable on training levels
    assert env.step(answer_text(f"read: {sorted(held)[0]}")).info["valid"]


# ---------------------------------------------------------------------------------------------------
# Retrieval

SMALL = Corpus((
    Page("Mia the fox", "Mia the fox is a red fox.", ("Mia the fox lives in the old castle.",), ()),
    Page("Mia the owl", "Mia the owl is a quiet owl.", ("Mia the owl lives in the old castle.",), ()),
    Page("Leo the fox", "Leo the fox is a brave fox.", ("The best friend of Leo the fox is Mia the owl.",), ()),
    Page("old castle", "The old castle is a castle.", ("The keeper of the old castle is Leo the fox.",), ()),
), ())  # fmt: skip


def test_retrieval_on_a_fixed_small_corpus():
    index = SearchIndex(SMALL)
    for page in SMALL.pages:
        assert index.search(page.title, 4)[0] is page
    assert index.search("Where does Mia the fox live?", 2)[0].title == "Mia the fox"
    assert [p.title for p in index.search("owl", 4)] == ["Mia the owl", "Leo the fox"]  # only pages with a score
    assert index.search("zebra", 4) == [] and index.search("the ?", 4) == []
    # the ranking is bm25s's own
    query = bm25s.tokenize(["mia fox castle"], stopwords="en", return_ids=False, show_progress=False)
    docs, _ = index.retriever.retrieve(query, k=4, show_progress=False)
    assert [p.title for p in index.search("mia fox castle", 4)] == [SMALL.pages[i].title for i in docs[0]]


def test_the_entity_page_ranks_first_on_the_default_corpus():
    env = _env()
    assert all(env.index.search(p.title, 1)[0] is p for p in env.corpus.pages)
    assert all(env.index.search(q.text, 1)[0].title == q.title for q in env.corpus.questions)


# ---------------------------------------------------------------------------------------------------
# Dynamics and rewards


def test_search_read_answer():
    env = _env()
    obs = env.reset(0)
    q = env.question
    assert obs == f"question: {q.text}" and q.answer.lower() not in obs.lower()
    r = env.step(f"<think>find it</think><answer>search: {q.subject}</answer>")
    assert (r.reward, r.done, r.info["valid"], r.info["action"]) == (0.0, False, True, f"search: {q.subject.lower()}")
    lines = r.observation.split("\n")
    assert lines[0] == "results:" and len(lines) == 1 + env.k == 4 and r.info["results"][0] == q.title
    assert lines[1] == f"{q.title}: {env.corpus.page(q.title).lead}"
    r = env.step(f"<answer> READ : The {q.title.upper()} </answer>")  # case, article, spaces around the colon
    page = env.corpus.page(q.title)
    assert r.info["action"] == f"read: {q.title.lower()}" and r.info["title"] == q.title
    assert r.observation == f"page: {q.title}\n{page.text}" and q.fact in r.observation and not r.done
    r = env.step(f"<answer>answer: {q.answer.upper()}.</answer>")  # normalised exact match
    assert (r.reward, r.done, r.info["success"], r.observation) == (1.0, True, True, "the answer is correct.")
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("<answer>answer: x</answer>")


def test_wrong_answer_ends_with_zero():
    env = _env()
    env.reset(1)
    r = env.step("<answer>answer: the moon</answer>")
    assert (r.reward, r.done, r.info["success"], r.observation) == (0.0, True, False, "the answer is wrong.")
    assert r.info["expected"] == env.question.answer


@pytest.mark.parametrize("text", ["<answer>look: mia</answer>", "<answer>read: nobody here</answer>",
                                  "<answer>search:   </answer>", "<answer>answer:</answer>", "search mia",
                                  "<answer>read</answer>"])  # fmt: skip
def test_invalid_actions_cost_the_penalty_and_the_episode_goes_on(text):
    for penalty in (None, -0.25):
        env = _env(**({} if penalty is None else {"invalid_penalty": penalty}))
        obs = env.reset(2)
        env.step("<answer>search: castle</answer>")
        r = env.step(text)
        assert r.reward == (-1.0 if penalty is None else penalty) and not r.done and not r.info["valid"]
        assert r.info["shown_reward"] == 0.0 and r.observation == obs  # the question again
        assert env.step(answer_text(f"answer: {env.question.answer}")).reward == 1.0


def test_max_turns_ends_the_episode():
    env = _env()
    traj = run_episode(env, lambda h: "<answer>search: castle</answer>", seed=4, max_turns=3)
    assert len(traj.turns) == 3 and traj.truncated and not traj.done and traj.total_reward == 0.0
    assert env.max_turns_default == 5


def test_no_think_rewrite_and_strict_format():
    env = _env()
    env.reset(0)
    assert no_think_rewrite("<think>x</think><answer>Search :  Mia   the FOX </answer>", env) == \
        "<answer>search: mia the fox</answer>"  # fmt: skip
    title = env.question.title
    assert no_think_rewrite(f"<answer>read: The {title.upper()}?!</answer>", env) == f"<answer>read: {title.lower()}</answer>"
    assert no_think_rewrite("<answer>read: nobody</answer>", env) == "<answer>none</answer>"
    strict = _env(strict=True)
    strict.reset(0)
    assert strict.prefill == "" and not strict.step("search: mia").info["valid"]
    assert strict.step("<answer>search: mia</answer>").info["valid"]


def test_page_truncation():
    text = "one two three four"
    assert visible_text(text, 100) == text and visible_text(text, len(text)) == text
    assert visible_text(text, 7) == "one two" + CUT_MARK and visible_text(text, 9) == "one two" + CUT_MARK
    corpus = build_corpus(400, 0)
    least = min_page_chars(corpus)
    assert max(len(p.text) for p in corpus.pages) <= DEFAULT_PAGE_CHARS  # whole pages by default
    env = _env(page_chars=least)
    for seed in range(40):  # every asked fact stays visible at the smallest page_chars
        q = _ask(env, seed)
        shown = env.step(answer_text(f"read: {q.title}")).observation
        assert q.fact in shown and len(shown.split("\n", 1)[1]) <= least + len(CUT_MARK)
    assert any(shown.endswith(CUT_MARK) for shown in
               [visible_text(p.text, least) for p in corpus.pages])  # fmt: skip


@pytest.mark.parametrize("params, needle", [
    ({"k": 0}, "k must be an int in [1, 400]"), ({"k": 401}, "k must be"), ({"k": True}, "k must be"),
    ({"n_pages": 5}, f"n_pages must be an int in [{MIN_PAGES}, {MAX_PAGES}]"), ({"corpus_seed": -1}, "corpus_seed must be"),
    ({"page_chars": 100}, "page_chars must be an int >= "), ({"pages": 10}, "accepted: ['k', 'n_pages'"),
])  # fmt: skip
def test_bad_parameters(params, needle):
    with pytest.raises(ConfigError) as e:
        _env(**params)
    assert needle in str(e.value)


def test_bad_env_params_exit_2_at_parse_time(train_cli_error):
    assert "k must be" in train_cli_error("--env", "search", "--env_params", "k=0", "--model", "builtin_env")
    assert "page_chars must be" in train_cli_error("--env", "search", "--env_params", "page_chars=50",
                                                   "--model", "builtin_env")  # fmt: skip


def test_params_change_the_corpus_and_the_results():
    small = _env(n_pages=40, corpus_seed=2, k=2)
    assert len(small.corpus.pages) == 40 and small.corpus is build_corpus(40, 2)
    small.reset(0)
    assert len(small.step("<answer>search: the</answer>").observation.split("\n")) == 1  # stopwords only: none
    small.reset(0)
    assert len(small.step(answer_text(f"search: {small.question.subject}")).observation.split("\n")) == 3


# ---------------------------------------------------------------------------------------------------
# SFT


def test_sft_script_solves_its_questions():
    pairs = sft_pairs("search", n=30, seed=100)
    assert len(pairs) == 3 * 30
    env = _env()
    for level in range(30):
        steps = pairs[3 * level : 3 * level + 3]
        answers = iter(p["completion"] for p in steps)
        prompts = []
        traj = run_episode(env, lambda h: prompts.append(h) or next(answers), seed=100 + level, max_turns=5)
        assert traj.success and traj.total_reward == 1.0 and traj.done and len(traj.turns) == 3
        assert prompts == [p["prompt"] for p in steps]
        q = env.question
        assert [p["completion"] for p in steps] == [answer_text(f"search: {q.subject.lower()}"),
                                                    answer_text(f"read: {q.title.lower()}"),
                                                    answer_text(f"answer: {q.answer.lower()}")]  # fmt: skip
        assert traj.turns[0].info["results"][0] == q.title and q.fact in traj.turns[1].env


def test_first_action_metrics_count_verbs():
    from trl_ext.env.episodes import log_episodes

    env = _env()
    policy = iter(["<answer>search: mia</answer>", "<answer>read: nobody</answer>", "<answer>answer: x</answer>",
                   "<answer>search: leo</answer>"])  # fmt: skip
    trajs = [run_episode(env, lambda h: next(policy), seed=s, max_turns=1) for s in range(4)]
    metrics = defaultdict(list)
    trainer = SimpleNamespace(_metrics={"train": metrics}, model=SimpleNamespace(training=True),
                              accelerator=SimpleNamespace(num_processes=1))
    log_episodes(trainer, trajs, env.action_words)
    assert metrics["env/first_action/search"] == [0.5] and metrics["env/first_action/read"] == [0.0]
    assert metrics["env/first_action/answer"] == [0.25] and metrics["env/invalid_frac"] == [0.25]


# ---------------------------------------------------------------------------------------------------
# builtin_env tokenizer and an end-to-end run


@pytest.fixture(scope="module")
def env_model(builtin_cache):
    from trl_ext.models import builtin_env

    return builtin_env.ensure_builtin_env()


def test_builtin_env_tokenizer_covers_every_search_text(env_model):
    """Every page, question, result list, page view, verdict and SFT record tokenizes without [UNK]."""
    from trl_ext.models import load_tokenizer

    tok = load_tokenizer(env_model)
    env = _env()
    corpus = env.corpus
    texts = [p.text for p in corpus.pages] + [q.text + " " + q.answer for q in corpus.questions]
    texts += [env.instructions, *(p["prompt"] + p["completion"] for p in sft_pairs("search", 20, 0))]
    traj = run_episode(env, lambda h: "<answer>answer: x</answer>", seed=0, max_turns=1)
    texts += [traj.history_text(), visible_text(corpus.pages[0].text, min_page_chars(corpus))]
    unknown = {w for text in texts if tok.unk_token_id in tok(text, add_special_tokens=False)["input_ids"]
               for w in text.split() if tok.unk_token_id in tok(w, add_special_tokens=False)["input_ids"]}  # fmt: skip
    assert not unknown, sorted(unknown)


@pytest.mark.slow
def test_grpo_two_steps_on_search(env_model, tmp_path):
    import trl_ext.cli_train as cli

    argv = ["--env", "search", "--model", "builtin_env", "--max_turns", "3", "--max_completion_length", "32",
            "--batch_size", "8", "--num_generations", "4", "--max_steps", "2", "--logging_steps", "1",
            "--save_steps", "2", "--lr", "1e-4", "--no_wandb", "--output_dir", str(tmp_path)]  # fmt: skip
    assert cli.main(argv) == 0
    (run_dir,) = tmp_path.iterdir()
    state = json.loads((run_dir / "checkpoint-2" / "trainer_state.json").read_text())
    logs = [r for r in state["log_history"] if "loss" in r]
    assert [r["step"] for r in logs] == [1, 2] and all(math.isfinite(r["loss"]) for r in logs)
    assert all("env/first_action/search" in r and 1 <= r["env/turns"] <= 3 for r in logs)


@pytest.mark.parametrize(("preset", "expected"), [(None, "cpu"), ("cuda", "cuda")])
def test_bm25s_import_keeps_jax_off_the_gpu_unless_the_caller_chose(preset, expected):
    """bm25s runs a JAX op at import where JAX is installed, and JAX would then take 75% of the GPU's memory (a GPU
    run failed so with CUDA out of memory): the corpus module sets JAX_PLATFORMS=cpu first, keeping a caller's value."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    if preset is not None:
        env["JAX_PLATFORMS"] = preset
    code = "import os, environments.search_corpus; print(os.environ['JAX_PLATFORMS'])"
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected
