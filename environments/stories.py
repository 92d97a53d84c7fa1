"""Story prompts: a deterministic simple-story generator and story-prefix prompt datasets.

``generate_stories`` writes short stories in the style of SimpleStories (Finke et al. 2025,
"Parameterized Synthetic Text Generation with SimpleStories"): named characters, places, objects,
actions and a dozen-plus feelings, 3-8 sentences of varied length ending in ``.``, ``!`` or ``?``.
Every feeling slot draws uniformly from ``FEELINGS`` and feeling slots occur anywhere in a story,
so a completion that continues a short prompt can itself contain a feeling word. About 17% of the
stories contain the word "happy" (a minority, so a "happy" reward has something to learn).

The builtin model's corpus is split once, by seed, into disjoint parts:

- pretraining corpus: ``generate_stories(n, seed=PRETRAIN_SEED)`` (used by ``trl_ext.models.builtin``);
- held-out stories: ``generate_stories(2 * HELDOUT_SPLIT_SIZE, seed=HELDOUT_SEED)``; indices
  ``[0, HELDOUT_SPLIT_SIZE)`` are the prompt split "train", the rest the prompt split "test".

``load_prompts`` gives the same interface for the builtin model and for hub models (whose prompts
come from the ``SimpleStories/SimpleStories`` dataset's "train" / "test" splits).
"""

from __future__ import annotations

import functools
import random
import re

import datasets

HUB_DATASET = "SimpleStories/SimpleStories"
HUB_TEXT_COLUMN = "story"
SPLITS = ("train", "test")
PRETRAIN_SEED = 0
HELDOUT_SEED = 1
HELDOUT_SPLIT_SIZE = 5000

FEELINGS = (
    "happy", "sad", "angry", "scared", "excited", "calm", "proud",
    "nervous", "curious", "lonely", "tired", "surprised", "worried", "shy",
)  # fmt: skip
GIRLS = ("Mia", "Lily", "Ava", "Zoe", "Nora", "Ella", "Ruby", "Lucy", "Emma", "Rosa", "Anna", "Ivy")
BOYS = ("Leo", "Sam", "Tom", "Ben", "Max", "Kai", "Finn", "Jack", "Owen", "Eli", "Noah", "Luke")
ANIMALS = ("cat", "dog", "bird", "fox", "bear", "frog", "rabbit", "owl", "duck", "mouse", "turtle", "lion")
KINDS = ("little", "small", "old", "young", "kind", "clever", "brave", "tiny", "big", "gentle", "quiet")
PLACES = (
    "park", "forest", "garden", "beach", "school", "river", "village", "farm", "castle", "lake",
    "hill", "meadow", "kitchen", "library", "market", "cave", "zoo", "island", "field", "town",
)  # fmt: skip
OBJECTS = (
    "ball", "kite", "book", "box", "hat", "map", "key", "boat", "toy", "cake", "flower", "shell",
    "stone", "lamp", "bike", "drum", "apple", "cookie", "star", "feather", "letter", "basket",
    "blanket", "bell", "cup", "coin", "seed", "sock", "clock", "ring",
)  # fmt: skip
LOOKS = ("red", "blue", "shiny", "old", "new", "soft", "tiny", "round", "golden", "green", "striped", "funny")
TIMES = ("morning", "day", "evening", "summer day", "rainy day", "winter night", "sunny afternoon")
WEATHER = ("the sun was warm", "the wind was strong", "it started to rain", "the sky was gray",
           "the birds were singing", "snow covered the ground", "the moon was bright")  # fmt: skip
GAMES = ("played tag", "built a fort", "sang songs", "drew pictures", "raced to the tree",
         "looked for bugs", "read a book", "baked a pie", "jumped in puddles", "danced in a circle")  # fmt: skip
DOINGS = ("climbed a tree", "walked by the water", "ran across the grass", "sat under a tree",
          "looked behind a rock", "opened the door", "followed a path", "counted the clouds")  # fmt: skip

OPENINGS = (
    "Once upon a time, there was a {kind} {animal} named {name}.",
    "{Name} was a {kind} {animal} who lived near the {place}.",
    "One {time}, {name} went to the {place}.",
    "There once was a {kind} girl named {name}.",
    "There once was a {kind} boy named {name}.",
    "{Name} loved to play at the {place}.",
    "In a {kind} {place}, a {animal} named {name} woke up {feel}.",
    "{Name} felt {feel} when {he} woke up one {time}.",
    "Every {time}, {name} visited the {place} with {his} friend {friend}.",
    "Long ago, in a {kind} village, lived a {animal} named {name}.",
)
MIDDLES = (
    "{He} found a {look} {obj} near the {place}.",
    "{Name} felt {feel}.",
    "{He} was {feel}.",
    "{He} was {feel} because the {obj} was gone.",
    "{Name} and {friend} {game}.",
    "{Friend} looked {feel} and said nothing.",
    "Where was the {look} {obj}?",
    "Who could help {him}?",
    "What was inside the {obj}?",
    "Then {he} {doing}.",
    "It was a {look} {obj}!",
    "The {obj} was {look} and {look2}.",
    "{Name} felt {feel} and a little {feel2}.",
    "When {he} saw the {obj}, {he} felt {feel}.",
    "That day, {weather}.",
    "{Friend} came to the {place} and they {game}.",
    "{His} friend {friend} was {feel} too.",
    "{He} gave the {obj} to {friend}, and {friend} was {feel}.",
    "Suddenly, {weather}!",
    "{Name} did not know what to do.",
    "{He} {doing} and found a {look} {obj}.",
    "The {animal} looked at {him} and seemed {feel}.",
    "It made {him} feel {feel}.",
    "{He} smiled.",
    "{Name} wanted to find the {obj} before night came.",
    "{He} was so {feel} that {he} {doing}.",
    "Everyone at the {place} felt {feel}.",
    "{Friend} asked if {he} was {feel}.",
    "{He} said yes.",
    "They walked to the {place} together.",
    "{Name} was {feel} about the {obj}.",
    "The {look} {obj} made {name} {feel}.",
    "{He} felt {feel} all day long.",
    "Why was {friend} so {feel}?",
    "The {animal} was {feel} to see {name}.",
    "{Friend} felt {feel} when the {obj} fell.",
)
ENDINGS = (
    "In the end, {name} felt {feel}.",
    "From that day on, {name} and {friend} were best friends.",
    "{Name} went home feeling {feel}.",
    "{He} smiled and went to sleep.",
    "They were {feel} and sleepy after a long day.",
    "What a {feel} day it was!",
    "{Name} learned that friends help each other.",
    "That night, {name} dreamed about the {look} {obj}.",
    "Would they play again tomorrow?",
    "{Friend} hugged {him}, and both of them felt {feel}.",
)


MOOD_TITLE = "A {mood} story."  # the title of a mood story: "A happy story.", "An angry story."
_AN = re.compile(r"\b([Aa]) ([aeiou])")


def _cap(text: str) -> str:
    return text[0].upper() + text[1:]


class _Slots(dict):
    """A template's slots, each also capitalised under its capitalised name (``{Name}``), made on use."""

    def __missing__(self, key: str) -> str:
        value = _cap(self[key[0].lower() + key[1:]]) if key[:1].isupper() else None
        if value is None:
            raise KeyError(key)
        return value


def _story(rng: random.Random, mood: str | None = None, mood_weight: float = 0.0) -> str:
    """One story. With ``mood``, each sentence's first feeling slot is ``mood`` w.p. ``mood_weight``
    (the other slot stays a different feeling); without it the random stream is exactly the plain one."""
    girl = rng.random() < 0.5
    name = rng.choice(GIRLS if girl else BOYS)
    friend = rng.choice([n for n in GIRLS + BOYS if n != name])
    he, him, his = ("she", "her", "her") if girl else ("he", "him", "his")
    opening = rng.choice([o for o in OPENINGS if ("girl" not in o or girl) and ("boy" not in o or not girl)])
    templates = [opening, *(rng.choice(MIDDLES) for _ in range(rng.randint(1, 6))), rng.choice(ENDINGS)]
    sentences = []
    for template in templates:
        look, look2 = rng.sample(LOOKS, 2)
        feel, feel2 = rng.sample(FEELINGS, 2)
        if mood is not None and rng.random() < mood_weight:
            feel, feel2 = mood, (feel if feel2 == mood else feel2)
        slots = dict(
            name=name, friend=friend, he=he, him=him, his=his, look=look, look2=look2, feel=feel, feel2=feel2,
            kind=rng.choice(KINDS), animal=rng.choice(ANIMALS), place=rng.choice(PLACES), obj=rng.choice(OBJECTS),
            time=rng.choice(TIMES), weather=rng.choice(WEATHER), game=rng.choice(GAMES), doing=rng.choice(DOINGS),
        )  # fmt: skip
        sentences.append(_cap(template.format_map(_Slots(slots))))
    return _AN.sub(r"\1n \2", " ".join(sentences))


def generate_stories(n: int, seed: int) -> list[str]:
    """``n`` stories; story ``i`` depends only on ``(seed, i)``, so prefixes of the list agree across ``n``."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return [_story(_rng(seed, i)) for i in range(n)]


def generate_mood_stories(n: int, seed: int, titled_fraction: float, mood_weight: float) -> list[str]:
    """``generate_stories(n, seed)`` where a ``titled_fraction`` of the stories carry a mood.

    A titled story starts with ``MOOD_TITLE`` for a uniformly drawn feeling, and its feeling slots
    follow that mood w.p. ``mood_weight`` (``_story``). The choice of story and mood uses its own
    random stream, so every untitled story equals the plain story of the same index.
    """
    stories = []
    for i in range(n):
        pick = random.Random(f"mood-{seed}-{i}")
        if pick.random() < titled_fraction:
            mood = pick.choice(FEELINGS)
            title = _AN.sub(r"\1n \2", MOOD_TITLE.format(mood=mood))
            stories.append(title + " " + _story(_rng(seed, i), mood, mood_weight))
        else:
            stories.append(_story(_rng(seed, i)))
    return stories


def _rng(seed: int, index: int) -> random.Random:
    return random.Random(f"stories-{seed}-{index}")


@functools.cache
def heldout_stories(split: str) -> tuple[str, ...]:
    """The builtin model's held-out stories of prompt split ``split`` ("train" or "test")."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    offset = 0 if split == "train" else HELDOUT_SPLIT_SIZE
    return tuple(_story(_rng(HELDOUT_SEED, offset + i)) for i in range(HELDOUT_SPLIT_SIZE))


def story_prefix(text: str, tokenizer, prompt_length: int) -> str | None:
    """The text of ``text``'s first ``prompt_length`` tokens, or None when the story is shorter.

    The prefix is cut from the original text at the character offset where token ``prompt_length``
    ends, so it keeps the story's own casing and spacing (decoding the ids would lowercase and
    re-space it, e.g. "it ' s"). It must re-tokenize (``add_special_tokens=False``) to exactly the
    first ``prompt_length`` ids; anything else raises.
    """
    return story_prefixes([text], tokenizer, prompt_length)[0]


def story_prefixes(texts: list[str], tokenizer, prompt_length: int) -> list[str | None]:
    """`story_prefix` of each of ``texts``, the tokenizer called once per list (a batch is what makes a fast
    tokenizer fast)."""
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    prefixes = [text[: offsets[prompt_length - 1][1]] if len(ids) >= prompt_length else None
                for text, ids, offsets in zip(texts, enc["input_ids"], enc["offset_mapping"], strict=True)]  # fmt: skip
    kept = [i for i, p in enumerate(prefixes) if p is not None]
    if kept:
        again = tokenizer([prefixes[i] for i in kept], add_special_tokens=False)["input_ids"]
        for i, ids in zip(kept, again, strict=True):
            if ids != enc["input_ids"][i][:prompt_length]:
                raise ValueError(f"prompt does not re-tokenize to its own ids: {prefixes[i]!r} -> {ids} != "
                                 f"{enc['input_ids'][i][:prompt_length]}")  # fmt: skip
    return prefixes


PREFIX_BATCH = 512
"""Stories `load_prompts` tokenizes per call."""
BUILTIN_PROMPTS = "builtin"
"""``load_prompts`` source of the project's own held-out stories (``--prompts builtin``; the builtin models' prompts)."""


def load_prompts(model: str, tokenizer, prompt_length: int, split: str, n: int, seed: int) -> datasets.Dataset:
    """``n`` story prefixes of exactly ``prompt_length`` tokens as a Dataset with one column "prompt".

    ``model == "builtin"``: prefixes of the builtin model's held-out stories of ``split``; otherwise
    prefixes of ``SimpleStories/SimpleStories`` stories of ``split`` ("train" for training, "test" for
    evaluation). Stories are visited in an order shuffled by ``seed``; stories shorter than
    ``prompt_length`` tokens are skipped; fewer than ``n`` usable stories raises.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if prompt_length < 1 or n < 1:
        raise ValueError(f"prompt_length and n must be >= 1, got prompt_length={prompt_length}, n={n}")
    if model == BUILTIN_PROMPTS:
        stories = datasets.Dataset.from_dict({HUB_TEXT_COLUMN: list(heldout_stories(split))})
        source = f"builtin held-out stories ({split})"
    else:
        stories = datasets.load_dataset(HUB_DATASET, split=split)
        source = f"{HUB_DATASET} ({split})"
    prompts, shuffled = [], stories.shuffle(seed=seed)
    for start in range(0, len(shuffled), PREFIX_BATCH):  # in the shuffled order, a batch of stories at a time
        texts = shuffled[start : start + PREFIX_BATCH][HUB_TEXT_COLUMN]
        for prefix in story_prefixes(texts, tokenizer, prompt_length):
            if prefix is not None:
                prompts.append(prefix)
                if len(prompts) == n:
                    return datasets.Dataset.from_dict({"prompt": prompts})
    raise ValueError(
        f"only {len(prompts)} of {len(stories)} stories in {source} have >= {prompt_length} tokens; "
        f"{n} prompts requested"
    )

