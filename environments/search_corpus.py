"""The search environment's encyclopedia: pages about the story world, questions, and BM25 retrieval.

A corpus is a pure function of ``(n_pages, seed)`` (``build_corpus``). Its pages are about the entities of the story
world (``environments.stories``' vocabulary):

- characters ``"Mia the fox"`` (a name and an animal; half the pages): a lead sentence (kind and animal), then where
  they live, their best friend, their favourite thing, how they feel most days;
- places ``"green meadow"`` (an adjective and a story place; a fifth): lead, keeper, what the animals there do
  together, how many trees grow there;
- objects ``"golden bell"`` (a look and a story object; the rest): lead, maker, where it is kept, its age.

Each page then carries ``FILLER_PER_PAGE`` distractor sentences that name other entities (a character was once near a
place with another character ...). Several characters live in the same place, several objects are kept in the same
place, and every character is named on other pages, so a query's words alone do not give an answer: the right page
does. Every fact is one sentence; an entity-valued fact links two entities, and no two sentences of the corpus name the
same two linked entities (generation redraws until they do not), so each question's fact is on exactly one page. The
lead (the search snippet) holds no asked fact.

Retrieval is ``bm25s`` (Lu 2024, "BM25S: Orders of magnitude faster lexical search via eager sparse scoring"; its
default Lucene BM25, k1 1.5, b 0.75, English stopwords) over each page's title and text; ties go to the earlier page.
"""

from __future__ import annotations

import functools
import os
import random
import re
import string
from dataclasses import dataclass

# bm25s runs a JAX op when imported where JAX is installed (bm25s/selection.py: jax.lax.top_k), and JAX then takes
# 75% of every GPU's memory for itself: a GPU run beside it fails with CUDA out of memory (seen on an H200 with JAX
# in the image). Retrieval here scores with numpy (``BM25.get_scores``), so JAX is kept on the CPU unless the caller
# chose its platforms.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import bm25s  # noqa: E402
import numpy as np  # noqa: E402

from .stories import ANIMALS, BOYS, DOINGS, FEELINGS, GIRLS, KINDS, LOOKS, OBJECTS, PLACES, TIMES

PLACE_WORDS = ("old", "green", "quiet", "sunny", "little", "big", "windy", "hidden", "misty", "bright", "far", "high")
ACTIVITIES = ("play tag", "build forts", "sing songs", "draw pictures", "bake pies", "dance in a circle",
              "look for bugs", "fly kites", "tell stories", "pick flowers")  # fmt: skip
FILLER_PER_PAGE = 2
MIN_PAGES = 40  # smaller corpora often have no free link or distractor (n_pages 24 failed on 1 seed of 100)
_MAX_DRAWS = 1000


def normalize(text: str) -> str:
    """SQuAD v1.1's answer normalisation (``normalize_answer`` of its official evaluation script): lower case, no
    punctuation, no articles (a, an, the), single spaces. Answers and titles are compared in this form."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


@dataclass(frozen=True)
class Page:
    title: str
    lead: str  # first sentence: the search snippet
    facts: tuple[str, ...]  # the sentences questions ask about
    filler: tuple[str, ...]  # distractor sentences naming other entities

    @property
    def sentences(self) -> tuple[str, ...]:
        return (self.lead, *self.facts, *self.filler)

    @property
    def text(self) -> str:
        return " ".join(self.sentences)


@dataclass(frozen=True)
class Question:
    text: str
    answer: str  # as the page words it ("the green meadow"); judged after ``normalize``
    title: str  # the page that holds the fact
    fact: str  # the sentence of that page stating it
    subject: str  # the entity asked about (the page's title)


@dataclass(frozen=True)
class Corpus:
    pages: tuple[Page, ...]
    questions: tuple[Question, ...]

    def page(self, title: str) -> Page | None:
        """The page whose title equals ``title`` after ``normalize``, or None."""
        return self._by_title.get(normalize(title))

    @functools.cached_property
    def _by_title(self) -> dict[str, Page]:
        return {normalize(p.title): p for p in self.pages}


def _shares(n_pages: int) -> tuple[int, int, int]:
    """Characters, places, objects of an ``n_pages`` corpus: a half, a fifth, the rest (3/10)."""
    places, objects = n_pages // 5, 3 * n_pages // 10
    return n_pages - places - objects, places, objects


def _fits(n_pages: int) -> bool:
    pools = (len(GIRLS + BOYS) * len(ANIMALS), len(PLACE_WORDS) * len(PLACES), len(LOOKS) * len(OBJECTS))
    return all(n <= pool for n, pool in zip(_shares(n_pages), pools))


MAX_PAGES = max(n for n in range(MIN_PAGES, 2000) if _fits(n))  # every kind's share fits its pool of names


def check_size(n_pages: int) -> None:
    if isinstance(n_pages, bool) or not isinstance(n_pages, int) or not MIN_PAGES <= n_pages <= MAX_PAGES:
        raise ValueError(f"search: n_pages must be an int in [{MIN_PAGES}, {MAX_PAGES}], got {n_pages!r}")


class _Builder:
    """Draws the facts first, each linking two entities no other fact links, then the distractors, none naming two
    linked entities: so no two sentences of the corpus state the same link."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.links: set[frozenset[str]] = set()  # entity pairs a fact links

    def pick(self, subject: str, pool: list[str]) -> str:
        """An entity of ``pool`` not yet linked to ``subject`` (and not ``subject``); the link is recorded."""
        for _ in range(_MAX_DRAWS):
            other = self.rng.choice(pool)
            if other != subject and frozenset((subject, other)) not in self.links:
                self.links.add(frozenset((subject, other)))
                return other
        raise ValueError(f"search corpus: no free link for {subject!r}; use a larger n_pages")

    def filler(self, make, subject: str, pools: list[list[str]]) -> str:
        """A distractor sentence ``make(subject, *others)``, one other entity drawn from each pool, all distinct and
        no two of them linked by a fact (so it states none)."""
        for _ in range(_MAX_DRAWS):
            names = [subject, *(self.rng.choice(pool) for pool in pools)]
            pairs = {frozenset((a, b)) for i, a in enumerate(names) for b in names[i + 1 :]}
            if all(len(p) == 2 for p in pairs) and not pairs & self.links:
                return make(*names)
        raise ValueError(f"search corpus: no distractor for {subject!r}; use a larger n_pages")


def _cap(text: str) -> str:
    return text[0].upper() + text[1:]


_AN = re.compile(r"\b([Aa]) ([aeiou])")  # "a island" -> "an island" (as ``stories``)


def _an(sentence: str) -> str:
    return _AN.sub(r"\1n \2", sentence)


@functools.cache
def build_corpus(n_pages: int, seed: int) -> Corpus:
    """The corpus of ``n_pages`` pages drawn from ``random.Random(f"search-corpus-{seed}")``; questions in page order."""
    check_size(n_pages)
    rng = random.Random(f"search-corpus-{seed}")
    n_chars, n_places, n_objects = _shares(n_pages)
    chars = [f"{n} the {a}" for n, a in rng.sample([(n, a) for n in GIRLS + BOYS for a in ANIMALS], n_chars)]
    places = [f"{w} {p}" for w, p in rng.sample([(w, p) for w in PLACE_WORDS for p in PLACES], n_places)]
    objects = [f"{w} {o}" for w, o in rng.sample([(w, o) for w in LOOKS for o in OBJECTS], n_objects)]
    b = _Builder(rng)
    drafts = []  # (title, lead, facts as (sentence, question, answer), distractor maker, its pools)
    for c in chars:
        home, friend, thing = b.pick(c, places), b.pick(c, chars), b.pick(c, objects)
        feeling = rng.choice(FEELINGS)
        drafts.append((c, f"{_cap(c)} is a {rng.choice(KINDS)} {c.split()[-1]}.", [
            (f"{_cap(c)} lives in the {home}.", f"Where does {_cap(c)} live?", f"the {home}"),
            (f"The best friend of {_cap(c)} is {_cap(friend)}.", f"Who is the best friend of {_cap(c)}?", _cap(friend)),
            (f"The favorite thing of {_cap(c)} is the {thing}.", f"What is the favorite thing of {_cap(c)}?",
             f"the {thing}"),
            (f"{_cap(c)} is {feeling} most days.", f"How does {_cap(c)} feel most days?", feeling),
        ], lambda s, p, o: f"Once, {_cap(s)} {rng.choice(DOINGS)} near the {p} with {_cap(o)}.", [places, chars]))
    for p in places:
        keeper, activity, trees = b.pick(p, chars), rng.choice(ACTIVITIES), rng.randint(2, 99)
        drafts.append((p, f"The {p} is a {p.split()[-1]} of the story world.", [
            (f"The keeper of the {p} is {_cap(keeper)}.", f"Who is the keeper of the {p}?", _cap(keeper)),
            (f"The animals of the {p} {activity} together.", f"What do the animals of the {p} do together?", activity),
            (f"There are {trees} trees in the {p}.", f"How many trees are there in the {p}?", str(trees)),
        ], lambda s, o: f"One {rng.choice(TIMES)}, {_cap(o)} visited the {s}.", [chars]))
    for o in objects:
        maker, kept, age = b.pick(o, chars), b.pick(o, places), rng.randint(2, 99)
        drafts.append((o, f"The {o} is a {o.split()[-1]} from the old days.", [
            (f"The {o} was made by {_cap(maker)}.", f"Who made the {o}?", _cap(maker)),
            (f"The {o} is kept in the {kept}.", f"Where is the {o} kept?", f"the {kept}"),
            (f"The {o} is {age} years old.", f"How many years old is the {o}?", str(age)),
        ], lambda s, c, q: f"{_cap(c)} once saw the {s} near the {q}.", [chars, places]))
    pages, questions = [], []
    for title, lead, facts, make, pools in drafts:
        filler = tuple(_an(b.filler(make, title, pools)) for _ in range(FILLER_PER_PAGE))
        facts = [(_an(f), q, a) for f, q, a in facts]
        pages.append(Page(title, _an(lead), tuple(f for f, _, _ in facts), filler))
        questions.extend(Question(q, a, title, f, title) for f, q, a in facts)
    corpus = Corpus(tuple(pages), tuple(questions))
    if len(corpus._by_title) != len(pages):
        raise AssertionError("search corpus: two titles normalise alike")
    return corpus


def heldout_titles(corpus: Corpus, share: float) -> frozenset[str]:
    """A fixed ``share`` of the pages (rounded), drawn from ``random.Random("search-heldout")``: the held-out pages."""
    titles = sorted(p.title for p in corpus.pages)
    return frozenset(random.Random("search-heldout").sample(titles, round(share * len(titles))))


class SearchIndex:
    """BM25 (``bm25s``) over the pages' titles and texts: ``search(query, k)`` -> the top ``k`` pages with a
    positive score, best first (ties: the earlier page)."""

    def __init__(self, corpus: Corpus):
        self.corpus = corpus
        docs = [f"{p.title}. {p.text}" for p in corpus.pages]
        self.retriever = bm25s.BM25()
        self.retriever.index(bm25s.tokenize(docs, stopwords="en", return_ids=False, show_progress=False),
                             show_progress=False)  # fmt: skip

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every page for ``query`` (zeros when no query word is in the index)."""
        tokens = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)[0]
        tokens = [t for t in tokens if t in self.retriever.vocab_dict]
        if not tokens:
            return np.zeros(len(self.corpus.pages), dtype=np.float32)
        return self.retriever.get_scores(tokens)

    def search(self, query: str, k: int) -> list[Page]:
        scores = self.scores(query)
        order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
        return [self.corpus.pages[i] for i in order[:k] if scores[i] > 0]


@functools.cache
def search_index(n_pages: int, seed: int) -> SearchIndex:
    """The (cached) index of ``build_corpus(n_pages, seed)``: environments of one corpus share it."""
    return SearchIndex(build_corpus(n_pages, seed))
