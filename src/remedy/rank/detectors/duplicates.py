"""Near-duplicate samples in the recent data stream (MinHash LSH).

Repeated data is a silent fault: a loader stuck on one shard, an iterator
restarted at the beginning, workers seeded alike, or a corpus that was
never deduplicated. The model memorises, the loss drops too well, and
nothing crashes.

Every `every` batches the detector takes `rows_per_batch` rows at fixed,
evenly spaced positions (so a batch served twice is sampled the same way
both times), turns each into a set of `shingle`-token shingles, sketches it
with a MinHash signature and asks an LSH index of the last
`window` sampled rows for rows of Jaccard similarity about `similarity` or
more. When `min_hits` of the last `recent` sampled rows had such a twin, it
reports `duplicate_samples`. Shingle hashes are computed for all sampled
rows at once with numpy; the rows are taken from the batch in
`inspect_batch` without a host sync and brought over in `observe`, after the
Guard's sync. The sketches and the index are `detectors.minhash`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from remedy.policies import AnomalyEvent
from remedy.rank.detectors._batch import TokensFn, default_tokens
from remedy.rank.detectors._robust import Cooldown
from remedy.rank.detectors.base import event
from remedy.rank.detectors.minhash import LshIndex, MinHasher
from remedy.rank.loop.stats import StepStats

_MASK32 = np.uint64(0xFFFFFFFF)
_MULT = np.uint64(0x100000001B3)  # FNV-64 prime: mixes token ids into a shingle hash


def shingle_hashes(rows: np.ndarray, k: int, pad_id: int | None = None) -> list[np.ndarray]:
    """Per row, the distinct 32-bit hashes of its k-token shingles (all-padding ones dropped)."""
    k = max(1, min(k, rows.shape[1]))
    tokens = rows.astype(np.uint64)
    n = tokens.shape[1] - k + 1
    hashed = np.zeros((tokens.shape[0], n), dtype=np.uint64)
    for j in range(k):  # polynomial hash over plain slices, wrapping mod 2**64
        hashed = hashed * _MULT + tokens[:, j : j + n] + np.uint64(1)
    hashed ^= hashed >> np.uint64(29)
    hashed &= _MASK32
    if pad_id is None:
        return [np.unique(h) for h in hashed]
    padding = rows == pad_id
    all_pad = np.ones((rows.shape[0], n), dtype=bool)
    for j in range(k):
        all_pad &= padding[:, j : j + n]
    return [np.unique(h[~p]) for h, p in zip(hashed, all_pad, strict=True)]


@dataclass
class DuplicateSamplesDetector:
    """`duplicate_samples`: `min_hits` of the last `recent` sampled rows repeat a recent row."""

    rows_per_batch: int = 2
    every: int = 8  # batches between samples (a sampled step costs ~0.3 ms)
    shingle: int = 8  # tokens per shingle
    num_perm: int = 64
    similarity: float = 0.8  # Jaccard similarity the LSH index is tuned for
    window: int = 1000  # sampled rows kept in the index
    recent: int = 20
    min_hits: int = 8  # natural near-duplicates run at a few percent: keep far above
    pad_id: int | None = None
    tokens_fn: TokensFn = default_tokens
    cooldown_steps: int = 200
    seed: int = 1
    name: str = "duplicate_samples"
    _rows: torch.Tensor | None = None
    _batches: int = 0
    _keys: deque[str] = field(default_factory=deque)
    _hits: deque[bool] = field(default_factory=deque)
    _lsh: LshIndex = field(init=False)
    _hasher: MinHasher = field(init=False)
    _cooldown: Cooldown = field(init=False)

    def __post_init__(self) -> None:
        self._hasher = MinHasher(self.num_perm, self.seed)
        self._cooldown = Cooldown(self.cooldown_steps)
        self.reset()

    def inspect_batch(self, batch: Any) -> None:
        self._batches += 1
        if (self._batches - 1) % self.every:
            return
        ids = self.tokens_fn(batch)
        if ids is None or ids.shape[0] == 0:
            return
        # Evenly spaced rows by basic slicing: a view, no copy, no device work.
        stride = max(1, ids.shape[0] // max(1, self.rows_per_batch))
        self._rows = ids[::stride][: self.rows_per_batch].reshape(-1, ids.shape[-1])

    def observe(self, stats: StepStats) -> list[AnomalyEvent]:
        if self._rows is None:
            return []
        rows, self._rows = self._rows.cpu().numpy(), None
        twins: list[str] = []
        for i, hashes in enumerate(shingle_hashes(rows, self.shingle, self.pad_id)):
            if hashes.size == 0:
                continue
            sketch = self._hasher.sketch(hashes)
            found = self._lsh.query(sketch)
            self._hits.append(bool(found))
            if found:
                twins.append(str(found[0]))
            key = f"{stats.tick}:{i}"
            self._lsh.insert(key, sketch)
            self._keys.append(key)
            if len(self._keys) > self.window:
                self._lsh.remove(self._keys.popleft())
        while len(self._hits) > self.recent:
            self._hits.popleft()
        hits = sum(self._hits)
        if not twins or hits < self.min_hits or not self._cooldown.ready(stats.tick):
            return []
        self._cooldown.fire(stats.tick)
        return [
            event(
                stats,
                "duplicate_samples",
                value=hits / len(self._hits),
                threshold=self.min_hits / self.recent,
                hits=hits,
                sampled=len(self._hits),
                twin_of_tick=twins[0].split(":")[0],
            )
        ]

    def new_epoch(self, epoch: int) -> None:
        """A new epoch serves every sample again on purpose (the Guard says when): start afresh.

        Within an epoch a repeat is still a fault, such as an iterator that
        restarted by itself; across the epochs a user asked for it is the plan.
        """
        self.reset()

    def reset(self) -> None:
        """After a rollback the same batches come again on purpose: start a fresh index."""
        self._lsh = LshIndex(self.similarity, self.num_perm)
        self._keys = deque()
        self._hits = deque()
        self._rows = None
