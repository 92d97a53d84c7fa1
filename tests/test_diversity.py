import pytest

from trl_ext.diversity import jaccard, mean_pairwise_jaccard, unique_fraction


def test_unique_fraction():
    assert unique_fraction(["a b", "a b", "c"]) == 2 / 3
    assert unique_fraction(["x"]) == 1.0
    # Exact string equality: case and spacing count.
    assert unique_fraction(["Happy", "happy", "happy "]) == 1.0
    with pytest.raises(ValueError):
        unique_fraction([])


def test_jaccard_sets():
    assert jaccard({"a", "b"}, {"b", "c"}) == 1 / 3
    assert jaccard(set(), set()) == 1.0
    assert jaccard({"a"}, set()) == 0.0


def test_mean_pairwise_jaccard_by_hand():
    # Word sets: {the, cat, sat}, {the, cat}, {a, dog}.
    # Pairs: (1,2) -> 2/3, (1,3) -> 0/5, (2,3) -> 0/4; mean = (2/3) / 3 = 2/9.
    texts = ["The cat sat", "the  CAT", "a dog"]
    assert mean_pairwise_jaccard(texts) == pytest.approx(2 / 9, abs=1e-15)


def test_mean_pairwise_jaccard_collapse_and_sets():
    assert mean_pairwise_jaccard(["happy happy", "Happy"] * 2) == 1.0
    # Repeated words count once: {a, b} vs {a} -> 1/2.
    assert mean_pairwise_jaccard(["a a b", "a"]) == 0.5
    # Two empty completions are identical.
    assert mean_pairwise_jaccard(["", " "]) == 1.0


def test_mean_pairwise_jaccard_needs_two_texts():
    for texts in ([], ["only one"]):
        with pytest.raises(ValueError, match="at least two"):
            mean_pairwise_jaccard(texts)
