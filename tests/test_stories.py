"""Story generator and prompt datasets (no model needed; a tokenizer trained on 300 stories)."""

from __future__ import annotations

import re

import datasets
import pytest

from environments import stories
from environments.stories import (
    FEELINGS,
    HELDOUT_SPLIT_SIZE,
    generate_mood_stories,
    generate_stories,
    heldout_stories,
    load_prompts,
    story_prefix,
)
from trl_ext.models.builtin import train_tokenizer

SENTENCE = re.compile(r"[^.!?]+[.!?]")


def words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(generate_stories(300, seed=99))


@pytest.fixture(scope="module")
def corpus():
    return generate_stories(2000, seed=0)


def test_generator_is_deterministic_and_prefix_stable():
    assert generate_stories(30, seed=7) == generate_stories(30, seed=7)
    assert generate_stories(10, seed=7) == generate_stories(30, seed=7)[:10]
    assert generate_stories(30, seed=7) != generate_stories(30, seed=8)
    assert generate_stories(0, seed=7) == []
    with pytest.raises(ValueError, match="n must be >= 0"):
        generate_stories(-1, seed=7)


def test_story_format(corpus):
    for story in corpus:
        sentences = SENTENCE.findall(story)
        assert "".join(sentences).replace(" ", "") == story.replace(" ", ""), story  # nothing after the last end
        assert 3 <= len(sentences) <= 8, story
        assert all(s.strip()[0].isupper() for s in sentences), story
    lengths = {len(words(s)) for story in corpus for s in SENTENCE.findall(story)}
    assert min(lengths) <= 3 and max(lengths) >= 10  # varied sentence lengths
    endings = {s[-1] for story in corpus for s in SENTENCE.findall(story)}
    assert endings == {".", "!", "?"}


def test_feelings_occur_everywhere_in_stories(corpus):
    vocab = {w for story in corpus for w in words(story)}
    assert set(FEELINGS) <= vocab and len(FEELINGS) >= 12
    assert {"happily", "unhappy"}.isdisjoint(vocab)  # "happy" only as a whole word
    later = [any(f in words(" ".join(SENTENCE.findall(s)[2:])) for f in FEELINGS) for s in corpus]
    assert sum(later) / len(corpus) >= 0.6  # feelings also after the second sentence


def test_happy_is_in_a_clear_minority_of_stories(corpus):
    frac = sum("happy" in words(s) for s in corpus) / len(corpus)
    assert 0.15 <= frac <= 0.25


def test_heldout_splits_are_disjoint_from_each_other_and_from_pretraining():
    train, test = heldout_stories("train"), heldout_stories("test")
    assert len(train) == len(test) == HELDOUT_SPLIT_SIZE
    assert set(train).isdisjoint(test)
    assert set(generate_stories(2000, seed=stories.PRETRAIN_SEED)).isdisjoint(train + test)
    with pytest.raises(ValueError, match="split must be one of"):
        heldout_stories("validation")


def test_story_prefix_cuts_the_original_text(tok):
    # Cut from the original text (casing kept); decoding the ids would give "mia do not".
    assert story_prefix("Mia do not play. She felt happy.", tok, 3) == "Mia do not"
    assert story_prefix("Mia felt happy. She smiled.", tok, 4) == "Mia felt happy."
    assert story_prefix("Mia smiled.", tok, 4) is None  # 3 tokens: mia, smiled, .


def test_story_prefix_fails_loudly_when_prefix_does_not_retokenize():
    class LengthDependentTokenizer:  # id of every word depends on the whole text's length; a batch as HF's
        def __call__(self, texts, add_special_tokens, return_offsets_mapping=False):
            spans = [[m.span() for m in re.finditer(r"\S+", text)] for text in texts]
            out = {"input_ids": [[len(text)] * len(s) for text, s in zip(texts, spans)]}
            if return_offsets_mapping:
                out["offset_mapping"] = spans
            return out

    with pytest.raises(ValueError, match="does not re-tokenize"):
        story_prefix("a b c d", LengthDependentTokenizer(), 2)


def test_builtin_prompts_have_exact_length_and_come_from_the_split(tok):
    ds = load_prompts("builtin", tok, prompt_length=8, split="train", n=50, seed=3)
    assert ds.column_names == ["prompt"] and len(ds) == 50
    train = heldout_stories("train")
    for prompt in ds["prompt"]:
        assert len(tok(prompt, add_special_tokens=False)["input_ids"]) == 8
        assert any(story.startswith(prompt) for story in train)


def test_builtin_prompts_deterministic_by_seed_and_splits_disjoint(tok):
    a = list(load_prompts("builtin", tok, 30, "train", 40, seed=1)["prompt"])
    assert a == list(load_prompts("builtin", tok, 30, "train", 40, seed=1)["prompt"])
    assert a != list(load_prompts("builtin", tok, 30, "train", 40, seed=2)["prompt"])
    test = list(load_prompts("builtin", tok, 30, "test", 40, seed=1)["prompt"])
    assert set(a).isdisjoint(test)  # 30-token prefixes identify their stories


def test_builtin_prompts_raise_when_too_few(tok):
    with pytest.raises(ValueError, match="prompts requested"):
        load_prompts("builtin", tok, 8, "test", HELDOUT_SPLIT_SIZE + 1, seed=0)
    with pytest.raises(ValueError, match="only 0 of"):
        load_prompts("builtin", tok, 500, "test", 1, seed=0)  # no story has 500 tokens
    with pytest.raises(ValueError, match="split must be one of"):
        load_prompts("builtin", tok, 8, "validation", 1, seed=0)


def test_hub_prompts_use_simplestories_split_column_and_skip_short(monkeypatch, tok):
    calls = []
    rows = ["Mia felt happy. She smiled.", "Mia smiled.", "Leo was sad. He did not know what to do."]

    def fake_load_dataset(name, split):
        calls.append((name, split))
        return datasets.Dataset.from_dict({"story": rows, "topic": ["a", "b", "c"]})

    monkeypatch.setattr(stories.datasets, "load_dataset", fake_load_dataset)
    ds = load_prompts("SimpleStories/SimpleStories-1.25M", tok, 4, "test", 2, seed=0)
    assert calls == [("SimpleStories/SimpleStories", "test")]
    assert ds.column_names == ["prompt"]
    assert sorted(ds["prompt"]) == ["Leo was sad.", "Mia felt happy."]  # "Mia smiled." has 3 tokens
    with pytest.raises(ValueError, match=r"only 2 of 3 stories .* 3 prompts requested"):
        load_prompts("SimpleStories/SimpleStories-1.25M", tok, 4, "train", 3, seed=0)


def test_mood_stories_keep_plain_stories_and_title_the_rest():
    plain = generate_stories(400, seed=0)
    mood = generate_mood_stories(400, seed=0, titled_fraction=0.5, mood_weight=1.0)
    titled = [i for i, s in enumerate(mood) if s != plain[i]]
    assert 150 <= len(titled) <= 250  # about half
    assert generate_mood_stories(400, seed=0, titled_fraction=0.0, mood_weight=1.0) == plain
    title = re.compile(r"^An? (\w+) story\. ")
    for i in titled:
        m = title.match(mood[i])
        assert m and m.group(1) in FEELINGS, mood[i]
        body = mood[i][m.end() :]
        # every sentence's first feeling slot is the mood (weight 1): at least one mood word after the title
        assert m.group(1) in words(body) or not set(FEELINGS) & set(words(body)), mood[i]
    assert not any(title.match(plain[i]) for i in range(400))


def test_mood_title_raises_its_feeling_and_nothing_else():
    n = 3000
    mood = generate_mood_stories(n, seed=3, titled_fraction=1.0, mood_weight=0.8)
    happy_titled = [s for s in mood if s.startswith("A happy story.")]
    sad_titled = [s for s in mood if s.startswith("A sad story.")]
    body = lambda s: words(s.split(". ", 1)[1])  # noqa: E731
    rate = lambda docs, w: sum(w in body(s) for s in docs) / len(docs)  # noqa: E731
    plain_rate = sum("happy" in words(s) for s in generate_stories(n, seed=3)) / n
    assert rate(happy_titled, "happy") >= 0.8 > 0.3 >= plain_rate  # measured 0.89 vs 0.17
    assert rate(sad_titled, "happy") <= plain_rate + 0.05  # other moods do not add "happy"
    assert any(s.startswith("An angry story.") for s in mood)  # the article follows the mood
