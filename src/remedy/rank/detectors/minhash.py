"""MinHash signatures of hash sets, and a banded LSH index that finds near-twins among them.

A set of 32-bit hashes is sketched by `num_perm` hash functions of the
multiply-add-shift family, h(x) = ((a*x + b) mod 2**64) >> 32 with `a` odd:
two sets agree on one signature value with probability about their Jaccard
similarity. The index cuts a signature into `bands` bands of `rows` values and
keeps one bucket table per band, so two sets of similarity s share a bucket
in some band with probability 1 - (1 - s**rows)**bands, an S-curve that rises
around the threshold. The layout is the one that minimises the sum of the
areas of false positives (below the threshold) and false negatives (above
it), the usual choice (Leskovec, Rajaraman and Ullman, *Mining of Massive
Datasets*, ch. 3).

Written here, in numpy, because the library that offers it imports scipy to
choose the layout: 0.5-0.9 s added to the start of every rank, which a
replacement rank pays on its way to its first step.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

_SHIFT = np.uint64(32)


@lru_cache(maxsize=16)
def band_layout(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows), bands * rows <= num_perm, whose S-curve best separates `threshold`."""
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"threshold must be in (0, 1), got {threshold}")
    if num_perm < 1:
        raise ValueError(f"num_perm must be positive, got {num_perm}")
    below = np.linspace(0.0, threshold, 513)
    above = np.linspace(threshold, 1.0, 513)
    best, layout = float("inf"), (1, 1)
    for bands in range(1, num_perm + 1):
        for rows in range(1, num_perm // bands + 1):
            false_pos = np.trapezoid(1.0 - (1.0 - below**rows) ** bands, below)
            false_neg = np.trapezoid((1.0 - above**rows) ** bands, above)
            if false_pos + false_neg < best:
                best, layout = float(false_pos + false_neg), (bands, rows)
    return layout


class MinHasher:
    """`num_perm` hash functions drawn from `seed`; `sketch` turns a hash set into a signature."""

    def __init__(self, num_perm: int = 64, seed: int = 1) -> None:
        if num_perm < 1:
            raise ValueError(f"num_perm must be positive, got {num_perm}")
        draw = np.random.default_rng(seed)
        self.num_perm = num_perm
        self._a = draw.integers(0, 2**64, size=num_perm, dtype=np.uint64) | np.uint64(1)
        self._b = draw.integers(0, 2**64, size=num_perm, dtype=np.uint64)

    def sketch(self, hashes: np.ndarray) -> np.ndarray:
        """The signature (num_perm uint32 values) of a non-empty set of 32-bit hashes."""
        if hashes.size == 0:
            raise ValueError("an empty set has no MinHash signature")
        values = hashes.astype(np.uint64).reshape(-1, 1)
        mixed = (values * self._a + self._b) >> _SHIFT  # wraps mod 2**64, as meant
        return mixed.min(axis=0).astype(np.uint32)


def similarity(a: np.ndarray, b: np.ndarray) -> float:
    """The Jaccard similarity two signatures estimate: the share of values they agree on."""
    return float(np.mean(a == b))


class LshIndex:
    """Keys by signature; `query` gives the keys likely `threshold`-similar, oldest first."""

    def __init__(self, threshold: float = 0.8, num_perm: int = 64) -> None:
        self.num_perm = num_perm
        self.bands, self.rows = band_layout(threshold, num_perm)
        self._tables: list[dict[bytes, dict[str, None]]] = [{} for _ in range(self.bands)]
        self._buckets: dict[str, list[bytes]] = {}  # insertion order: oldest first

    def __len__(self) -> int:
        return len(self._buckets)

    def __contains__(self, key: object) -> bool:
        return key in self._buckets

    def _band_keys(self, signature: np.ndarray) -> list[bytes]:
        if signature.shape != (self.num_perm,):
            raise ValueError(f"a signature of {self.num_perm} values, got shape {signature.shape}")
        r = self.rows
        return [signature[i * r : (i + 1) * r].tobytes() for i in range(self.bands)]

    def insert(self, key: str, signature: np.ndarray) -> None:
        if key in self._buckets:
            raise ValueError(f"key {key!r} is in the index already")
        buckets = self._band_keys(signature)
        self._buckets[key] = buckets
        for table, bucket in zip(self._tables, buckets, strict=True):
            table.setdefault(bucket, {})[key] = None

    def query(self, signature: np.ndarray) -> list[str]:
        found: set[str] = set()
        for table, bucket in zip(self._tables, self._band_keys(signature), strict=True):
            found.update(table.get(bucket, ()))
        return [key for key in self._buckets if key in found] if found else []

    def remove(self, key: str) -> None:
        for table, bucket in zip(self._tables, self._buckets.pop(key), strict=True):
            members = table[bucket]
            del members[key]
            if not members:
                del table[bucket]
