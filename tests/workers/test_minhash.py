"""The MinHash sketches and LSH index behind `duplicate_samples`: the band layout is the one that
best separates the threshold, signatures estimate Jaccard similarity, and the index finds
near-twins, misses unrelated sets and forgets what it removes."""

from __future__ import annotations

import numpy as np
import pytest

from remedy.rank.detectors.minhash import LshIndex, MinHasher, band_layout, similarity


def sets_with_jaccard(rng: np.random.Generator, j: float, size: int = 200) -> tuple:
    """Two sets of distinct 32-bit hashes, `size` each, whose Jaccard similarity is `j`."""
    shared = round(2 * size * j / (1 + j))
    pool = rng.choice(2**32, size=shared + 2 * (size - shared), replace=False).astype(np.uint64)
    a = pool[:size]
    b = np.concatenate([pool[:shared], pool[size:]])
    return a, b


@pytest.mark.parametrize(
    ("threshold", "num_perm", "layout"),
    [(0.8, 64, (5, 11)), (0.5, 128, (25, 5)), (0.9, 32, (2, 16)), (0.7, 64, (8, 8))],
)
def test_band_layout_is_the_best_separating_one(
    threshold: float, num_perm: int, layout: tuple
) -> None:
    """The standard choices: the layout that minimises the false-positive plus false-negative
    areas of the S-curve 1 - (1 - s**r)**b around the threshold."""
    assert band_layout(threshold, num_perm) == layout


def test_band_layout_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="threshold"):
        band_layout(1.0, 64)
    with pytest.raises(ValueError, match="num_perm"):
        band_layout(0.8, 0)


def test_signatures_estimate_jaccard_similarity() -> None:
    """Over 40 pairs per similarity, the estimate's mean is within 0.03 of the truth (the
    standard error of one 256-value estimate is at most 0.031)."""
    rng = np.random.default_rng(7)
    hasher = MinHasher(num_perm=256, seed=3)
    for j in (0.1, 0.5, 0.8, 0.95):
        estimates = [
            similarity(hasher.sketch(a), hasher.sketch(b))
            for a, b in (sets_with_jaccard(rng, j) for _ in range(40))
        ]
        assert abs(np.mean(estimates) - j) < 0.03, (j, np.mean(estimates))


def test_a_signature_depends_on_the_set_only() -> None:
    """Order and repeats do not matter; the same seed gives the same functions."""
    values = np.arange(100, 300, dtype=np.uint64)
    one, two = MinHasher(64, seed=1), MinHasher(64, seed=1)
    shuffled = np.random.default_rng(0).permutation(np.concatenate([values, values[:50]]))
    assert np.array_equal(one.sketch(values), two.sketch(shuffled))
    assert not np.array_equal(one.sketch(values), MinHasher(64, seed=2).sketch(values))
    with pytest.raises(ValueError, match="empty"):
        one.sketch(np.array([], dtype=np.uint64))


def test_index_finds_near_twins_and_misses_unrelated_sets() -> None:
    """At threshold 0.8 (5 bands of 11): a pair of similarity 0.95 is found nearly always
    (probability 1 - (1 - 0.95**11)**5 = 0.998), one of 0.3 nearly never (1e-5)."""
    rng = np.random.default_rng(11)
    hasher = MinHasher(64, seed=1)
    found = {0.95: 0, 0.3: 0}
    for j in found:
        for i in range(100):
            a, b = sets_with_jaccard(rng, j)
            index = LshIndex(0.8, 64)
            index.insert(f"a{i}", hasher.sketch(a))
            found[j] += index.query(hasher.sketch(b)) == [f"a{i}"]
    assert found[0.95] >= 97 and found[0.3] <= 1, found


def test_index_answers_oldest_first_and_forgets_removed_keys() -> None:
    hasher = MinHasher(64, seed=1)
    row = hasher.sketch(np.arange(50, dtype=np.uint64))
    other = hasher.sketch(np.arange(1000, 1050, dtype=np.uint64))
    index = LshIndex(0.8, 64)
    for key in ("t3", "t1", "t2"):
        index.insert(key, row)
    index.insert("x", other)
    assert index.query(row) == ["t3", "t1", "t2"]
    index.remove("t3")
    assert index.query(row) == ["t1", "t2"] and "t3" not in index and len(index) == 3
    index.remove("t1")
    index.remove("t2")
    assert index.query(row) == [] and index.query(other) == ["x"]
    with pytest.raises(ValueError, match="already"):
        index.insert("x", other)
    with pytest.raises(ValueError, match="64 values"):
        index.query(row[:10])
