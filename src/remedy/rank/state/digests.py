"""Cheap, exact fingerprints of tensors: what replays and replica checks compare.

A tensor's *bit sum* is the sum of its elements' bit patterns read as signed
integers of the element's width, accumulated in int64 (wrapping). Integer
addition is associative, so the number does not depend on the order a
kernel or a thread split adds in: two tensors with equal bits give equal
sums on any device and any thread count, and flipping any one bit of any one
element changes the sum (by ±2^k, never 0 modulo 2^64). Two flips that cancel
exactly would go unseen; silent corruption is not that tidy.

Beside it, float64 sums of the values and of their magnitudes let two
results be compared within a tolerance (non-deterministic kernels) and read
by a person. Both come from one pass per tensor and one host transfer.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from remedy.rank.state.sharding import local

_MASK = (1 << 64) - 1
# The signed integer type of each element width, to read a tensor's bits.
_BITS_AS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def bit_sums(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per tensor, the int64 (wrapping) sum of its elements' bit patterns, as one int64 vector
    on the first tensor's device (a DTensor counts its local shard)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int64)
    device = local(tensors[0]).device
    sums = []
    for t in tensors:
        flat = local(t).detach().reshape(-1)
        as_int = _BITS_AS.get(flat.element_size())
        if as_int is None:  # no such element width in torch's dtypes; counted as empty
            sums.append(torch.zeros((), dtype=torch.int64, device=device))
            continue
        if flat.dtype == torch.bool:
            flat = flat.to(torch.int8)
        sums.append(flat.view(as_int).sum(dtype=torch.int64).to(device))
    return torch.stack(sums)


def fold(values: Iterable[int]) -> int:
    """Several bit sums as one, modulo 2^64 (as an unsigned number)."""
    total = 0
    for v in values:
        total = (total + v) & _MASK
    return total


def hex64(value: int) -> str:
    """A bit sum as 16 hex digits: JSON carries integers only up to 2^53 exactly."""
    return f"{value & _MASK:016x}"


@dataclass(frozen=True)
class Digest:
    """The fingerprint of a list of tensors (a model's gradients, its state).

    `per_tensor`: each tensor's bit sum; `bits`: all of them folded; `total`,
    `magnitude`: float64 sums of the values and of their absolute values (NaN
    or inf when an element is).
    """

    per_tensor: tuple[int, ...]
    bits: int
    total: float
    magnitude: float

    @property
    def hex(self) -> str:
        return hex64(self.bits)

    def same(self, other: Digest, tolerance: float = 0.0) -> bool:
        """Bitwise equal (`tolerance` 0), else both sums within `tolerance`, relative."""
        if tolerance <= 0:
            return self.bits == other.bits
        return close(self.total, other.total, tolerance) and close(
            self.magnitude, other.magnitude, tolerance
        )

    def first_difference(self, other: Digest) -> int | None:
        """Index of the first tensor whose bits differ, or None."""
        for i, (a, b) in enumerate(zip(self.per_tensor, other.per_tensor, strict=False)):
            if a != b:
                return i
        return None


def digest(tensors: Sequence[torch.Tensor]) -> Digest:
    """The `Digest` of `tensors`, with one host transfer."""
    if not tensors:
        return Digest((), 0, 0.0, 0.0)
    device = local(tensors[0]).device
    floats = [local(t).detach() for t in tensors if local(t).is_floating_point()]
    sums = (
        torch.stack(
            [
                torch.stack(
                    [
                        f.sum(dtype=torch.float64),
                        torch.linalg.vector_norm(f, 1, dtype=torch.float64),
                    ]
                )
                for f in floats
            ]
        )
        .sum(0)
        .to(device)
        if floats
        else torch.zeros(2, dtype=torch.float64, device=device)
    )
    bits = bit_sums(tensors).tolist()
    total, magnitude = sums.tolist()
    return Digest(tuple(int(b) for b in bits), fold(bits), float(total), float(magnitude))


def close(a: float, b: float, tolerance: float) -> bool:
    """Equal, or within `tolerance` of each other relative to the larger; non-finite values
    are close only to the same non-finite value (any NaN to any NaN)."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= tolerance * max(abs(a), abs(b), 1e-30)


def same_number(a: float, b: float, tolerance: float = 0.0) -> bool:
    """Two losses: the same float (any NaN counts as the same), or `close` within `tolerance`."""
    if tolerance <= 0:
        return a == b or (math.isnan(a) and math.isnan(b))
    return close(a, b, tolerance)


def odd_ones(values: dict[int, Any], prefer: Sequence[int] = ()) -> list[int]:
    """Ranks whose value (a digest) differs from the majority's, in order.

    Without a strict majority (two replicas that disagree), the reference is the
    lowest rank outside `prefer` (ranks already suspected, such as those that saw
    the anomaly), else the lowest rank: two values cannot say which one changed,
    and the lowest rank is the one a restart adopts the state from, so replacing
    the other leaves every replica agreeing again.
    """
    if len(set(values.values())) <= 1:
        return []
    counts = Counter(values.values())
    top = max(counts.values())
    leaders = {v for v, c in counts.items() if c == top}
    if len(leaders) == 1:
        (reference,) = leaders
    else:
        calm = [r for r in sorted(values) if values[r] in leaders and r not in prefer]
        reference = values[calm[0] if calm else min(values)]
    return sorted(r for r, v in values.items() if v != reference)
