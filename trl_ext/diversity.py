"""Text diversity of a set of samples (small-rl's eval_run checks: unique samples, Jaccard similarity).

Template collapse shows as a low unique fraction and a high mean pairwise Jaccard similarity.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations


def unique_fraction(texts: Sequence[str]) -> float:
    """Distinct texts / texts (exact string equality)."""
    if not texts:
        raise ValueError("unique_fraction needs at least one text")
    return len(set(texts)) / len(texts)


def jaccard(a: set[str], b: set[str]) -> float:
    """|a & b| / |a | b|; two empty sets are identical (1.0)."""
    union = a | b
    return len(a & b) / len(union) if union else 1.0


def mean_pairwise_jaccard(texts: Sequence[str]) -> float:
    """Mean Jaccard similarity of the lower-cased whitespace-split word sets over all unordered pairs.

    Defined for two or more texts; fewer has no pair and raises ValueError.
    """
    if len(texts) < 2:
        raise ValueError(f"mean_pairwise_jaccard needs at least two texts, got {len(texts)}")
    words = [set(t.lower().split()) for t in texts]
    pairs = list(combinations(words, 2))
    return sum(jaccard(a, b) for a, b in pairs) / len(pairs)
