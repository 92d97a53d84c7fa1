"""Search: answer a question about the story world with a search engine over a generated encyclopedia.

A miniature of search-augmented question answering (Search-R1, Jin et al. 2025, "Search-R1: Training LLMs to Reason
and Leverage Search Engines with Reinforcement Learning"; its reward is the exact match of the normalised answer).
The corpus (``environments.search_corpus``: ``n_pages`` pages, a pure function of ``corpus_seed``) is the same in every
episode; ``reset(seed)`` draws one of its questions uniformly. The fact a question asks for is on exactly one page and
not in the question, so the agent must find and read that page. The observation is the question.

Held-out questions: a fixed ``HELDOUT_SHARE`` of the pages (``heldout_titles``) is asked about only on the held-out
levels (seeds from ``HELDOUT_LEVELS``: SFT validation, the routing eval), every other page only on
training levels; so a held-out success rate is not a recall of answers trained on (with one shared pool, 1000
training levels would already cover 52% of the questions of held-out levels). Every page stays searchable and readable.

Actions (``<answer>ACTION</answer>`` in the environments' RAGEN format, one per turn; the verb is case-insensitive and
the colon may have spaces around it, as a WordPiece decode prints it):

- ``search: QUERY`` -> the ``k`` best pages by BM25 (``bm25s``) with a positive score, one line each:
  ``title: first sentence``; ``results: none`` when no page matches. Reward 0.
- ``read: TITLE`` -> ``page: title`` and the page text, cut after ``page_chars`` characters at a word boundary
  (`` ...`` marks a cut). Titles match after SQuAD's normalisation (case, punctuation, articles). Reward 0.
- ``answer: TEXT`` -> ends the episode: reward 1 when ``TEXT`` equals the answer after SQuAD's normalisation
  (``success``), else 0.

Anything else (no verb, an empty argument, an unknown title) is invalid: the episode goes on with the question shown
again, and the step costs ``invalid_penalty`` (-1, as the other environments), as RAGEN's multi-turn environments do.
``page_chars`` may not cut an asked fact: below the longest lead-plus-facts prefix of the corpus it is refused.

SFT (``--mode sft``): ``scripted_actions`` is search (the entity's title) -> read (its page) -> answer. It is not the
shortest play (the question names the page, so reading it directly is one turn shorter); it is the retrieval pattern
the environment is for; on the default corpus the search puts the page first for every title (tested).
"""

from __future__ import annotations

import random
import re

from .base import HELDOUT_LEVELS, Environment, register_env
from .search_corpus import Corpus, check_size, heldout_titles, normalize, search_index

ACTIONS = ("search", "read", "answer")
DEFAULT_K = 3
DEFAULT_PAGES = 400
DEFAULT_CORPUS_SEED = 0
DEFAULT_PAGE_CHARS = 400  # whole pages of the default corpus (the longest is 394 characters)
CUT_MARK = " ..."
HELDOUT_SHARE = 0.2  # of the pages, asked about on held-out levels only
_ACTION = re.compile(r"(search|read|answer)\s*:(.*)", re.IGNORECASE | re.DOTALL)


def min_page_chars(corpus: Corpus) -> int:
    """The smallest ``page_chars`` that shows every page's lead and facts whole."""
    return max(len(" ".join((p.lead, *p.facts))) for p in corpus.pages)


def visible_text(text: str, page_chars: int) -> str:
    """``text`` cut to at most ``page_chars`` characters at a word boundary, plus ``CUT_MARK`` when cut."""
    if len(text) <= page_chars:
        return text
    return text[: page_chars + 1].rsplit(" ", 1)[0] + CUT_MARK


def _int_param(name: str, value, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"search: {name} must be an int {bound}, got {value!r}")
    return value


@register_env
class SearchEnv(Environment):
    name = "search"
    max_turns_default = 5  # search, read, answer with two turns to spare
    action_words = ACTIONS
    has_solver = True
    instructions = (
        "Answer the question with the help of a search engine over an encyclopedia of the story world. Each turn, "
        "give one action. search: words shows the best page titles with their first sentence. read: title shows "
        "that page. answer: text ends the game, with reward 1 if the answer is right. "
        "Format: <think>...</think><answer>action</answer>."
    )

    def __init__(self, k: int = DEFAULT_K, n_pages: int = DEFAULT_PAGES, corpus_seed: int = DEFAULT_CORPUS_SEED,
                 page_chars: int = DEFAULT_PAGE_CHARS, invalid_penalty: float | None = None):  # fmt: skip
        super().__init__(invalid_penalty)
        check_size(n_pages)
        self.k = _int_param("k", k, 1, n_pages)
        self.corpus_seed = _int_param("corpus_seed", corpus_seed, 0)
        self.index = search_index(n_pages, self.corpus_seed)
        self.corpus = self.index.corpus
        least = min_page_chars(self.corpus)
        self.page_chars = _int_param("page_chars", page_chars, least)  # below: some asked fact would be cut
        held = heldout_titles(self.corpus, HELDOUT_SHARE)
        self.questions = {split: tuple(q for q in self.corpus.questions if (q.title in held) == split)
                          for split in (False, True)}  # fmt: skip  # True: the held-out levels' questions

    def _reset(self, rng: random.Random) -> None:
        self.question = rng.choice(self.questions[self.seed >= HELDOUT_LEVELS])
        self.view = self._question_view()

    def _question_view(self) -> str:
        return f"question: {self.question.text}"

    def parse_action(self, answer: str) -> str | None:
        """``verb: argument`` -> ``"verb: argument"`` in lower case with single spaces (``read``: the page's title);
        None for another form, an empty argument or an unknown title."""
        match = _ACTION.fullmatch(answer.strip())
        if not match:
            return None
        verb, arg = match.group(1).lower(), " ".join(match.group(2).split()).lower()
        if not arg:
            return None
        if verb == "read":
            page = self.corpus.page(arg)
            return None if page is None else f"read: {page.title.lower()}"
        return f"{verb}: {arg}"

    def _apply(self, action: str) -> tuple[float, bool, dict]:
        verb, arg = action.split(": ", 1)
        if verb == "search":
            pages = self.index.search(arg, self.k)
            lines = [f"{p.title}: {p.lead}" for p in pages]
            self.view = "\n".join(["results:", *lines]) if lines else "results: none"
            return 0.0, False, {"action_kind": verb, "results": [p.title for p in pages]}
        if verb == "read":
            page = self.corpus.page(arg)
            self.view = f"page: {page.title}\n{visible_text(page.text, self.page_chars)}"
            return 0.0, False, {"action_kind": verb, "title": page.title}
        correct = normalize(arg) == normalize(self.question.answer)
        self.view = f"the answer is {'correct' if correct else 'wrong'}."
        return float(correct), True, {"action_kind": verb, "success": correct, "expected": self.question.answer}

    def _noop(self) -> tuple[float, bool, dict]:
        """An invalid action shows the question again; reward 0 (the penalty is added by ``step``), not done."""
        self.view = self._question_view()
        return 0.0, False, {}

    def format_observation(self) -> str:
        return self.view

    def scripted_actions(self) -> list[str]:
        """The SFT script from the current question: search its entity, read its page, answer (canonical actions)."""
        q = self.question
        return [f"search: {q.subject.lower()}", f"read: {q.title.lower()}", f"answer: {q.answer.lower()}"]

