"""Batches that are mostly padding: compute spent on nothing.

A bucketing bug, a collator padding to the model's maximum length instead of
the batch's, or a dataset of very short samples all show up as batches whose
tokens are mostly padding. The share is read from the batch's attention mask
when it has one (`mask_key`), else from the token ids compared with
`pad_id`; with neither there is nothing to measure and the detector stays
silent (the default `pad_id` is None because no token id is padding in
every vocabulary).

The share is computed in `inspect_batch` as a device tensor (no host sync
before the step) and read in `observe`, after the Guard's own sync, when the
number is long since ready.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from remedy.policies import AnomalyEvent
from remedy.rank.detectors._batch import TokensFn, attention_mask, default_tokens
from remedy.rank.detectors._robust import Cooldown
from remedy.rank.detectors.base import event
from remedy.rank.loop.stats import StepStats


@dataclass
class PaddingRatioDetector:
    """`padding_ratio`: more than `threshold` of a batch's tokens are padding."""

    pad_id: int | None = None
    threshold: float = 0.75
    mask_key: str | None = "attention_mask"
    tokens_fn: TokensFn = default_tokens
    cooldown_steps: int = 100
    name: str = "padding_ratio"
    _share: torch.Tensor | None = None
    _cooldown: Cooldown = field(init=False)

    def __post_init__(self) -> None:
        self._cooldown = Cooldown(self.cooldown_steps)

    def inspect_batch(self, batch: Any) -> None:
        self._share = None
        if self.pad_id is None and not isinstance(batch, Mapping):
            return  # nothing to measure: no mask, no pad id
        mask = attention_mask(batch, self.mask_key)
        if mask is not None and mask.numel():
            self._share = 1.0 - mask.float().mean()
            return
        if self.pad_id is None:
            return
        ids = self.tokens_fn(batch)
        if ids is not None and ids.numel():
            self._share = (ids == self.pad_id).float().mean()

    def observe(self, stats: StepStats) -> list[AnomalyEvent]:
        if self._share is None:
            return []
        share = float(self._share)
        self._share = None
        if share <= self.threshold or not self._cooldown.ready(stats.tick):
            return []
        self._cooldown.fire(stats.tick)
        return [
            event(
                stats,
                "padding_ratio",
                value=share,
                threshold=self.threshold,
                severity="info",
                batch_index=stats.batch_index,
            )
        ]

    def reset(self) -> None:
        self._share = None
