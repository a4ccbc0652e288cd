"""Memory trouble: a leak, running close to the limit, and a fragmented allocator.

The Guard reports, per step, the CUDA allocator's allocated and reserved
bytes and the device's capacity, or on CPU the process's resident set size.

- `memory_growth` fits a robust (Theil–Sen) slope to block minima of the
  allocated bytes. A block minimum ignores the transient peaks inside a step
  cycle; a leak raises the floor block after block. It must be steady (most
  blocks higher than the one before) and large over the window, and persist.
  The first `warmup_steps` are ignored: caches, the snapshot ring and the
  optimizer state fill up legitimately at the start (the ring alone holds
  `snapshot_ring` copies of model and optimizer state, which on CPU are in
  the RSS).
- `memory_pressure` compares allocated (and reserved) bytes with the
  capacity; on CPU the capacity is the machine's memory or the cgroup limit,
  whichever is smaller.
- `memory_fragmentation` is the share of reserved memory that sits free
  inside partly used allocator segments (`inactive_split_bytes` of
  `torch.cuda.memory_stats`): memory that can neither serve a large request
  nor be returned with `empty_cache`. Free whole segments (the activations a
  step just released) are the caching allocator working as designed, so they
  do not count. CUDA only; on CPU it stays silent.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from remedy.policies import AnomalyEvent
from remedy.rank.detectors._robust import Persistence, rising_fraction, theil_sen_slope
from remedy.rank.detectors.base import event
from remedy.rank.loop.stats import StepStats

_MiB = 1 << 20
_GiB = 1 << 30


@dataclass
class MemoryGrowthDetector:
    """`memory_growth`: the allocated floor rises steadily by `min_growth_bytes` over the window."""

    block: int = 10  # steps per block minimum
    window_blocks: int = 10  # the window: 100 steps by default
    min_growth_bytes: int = 64 * _MiB  # fitted growth over the window
    min_rising: float = 0.7  # share of blocks above the previous one
    patience: int = 2  # consecutive growing blocks before the event
    warmup_steps: int = 200
    cooldown_steps: int = 500
    name: str = "memory_growth"
    _floors: deque[float] = field(default_factory=deque)
    _current: list[int] = field(default_factory=list)
    _seen: int = 0
    _gate: Persistence = field(init=False)

    def __post_init__(self) -> None:
        self._gate = Persistence(self.patience, self.cooldown_steps)

    def observe(self, stats: StepStats) -> list[AnomalyEvent]:
        if stats.mem_bytes is None:
            return []
        self._seen += 1
        if self._seen <= self.warmup_steps:
            return []
        self._current.append(stats.mem_bytes)
        if len(self._current) < self.block:
            return []
        self._floors.append(min(self._current))
        self._current = []
        if len(self._floors) > self.window_blocks:
            self._floors.popleft()
        if len(self._floors) < self.window_blocks:
            return []
        floors = list(self._floors)
        per_step = theil_sen_slope(floors) / self.block
        growth = per_step * self.block * (len(floors) - 1)
        growing = growth >= self.min_growth_bytes and rising_fraction(floors) >= self.min_rising
        if not self._gate.update(growing, stats.tick):
            return []
        return [
            event(
                stats,
                "memory_growth",
                value=growth,
                threshold=float(self.min_growth_bytes),
                bytes_per_step=round(per_step),
                window_steps=self.block * len(floors),
                mem_bytes=stats.mem_bytes,
            )
        ]

    def reset(self) -> None:
        """A rollback moves memory around (the ring drops snapshots): refill the window."""
        self._floors.clear()
        self._current = []
        self._gate.reset()
        self._seen = min(self._seen, self.warmup_steps)


@functools.lru_cache(maxsize=1)
def host_memory_bytes() -> int | None:
    """Physical memory available to this process: MemTotal, or the cgroup limit if smaller."""
    total: int | None = None
    with contextlib.suppress(AttributeError, ValueError, OSError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as fh:
                raw = fh.read().strip()
        except OSError:
            continue
        if raw.isdigit() and (total is None or int(raw) < total):
            total = int(raw)  # "max" (no limit) and huge sentinels are ignored
    return total


@dataclass
class MemoryPressureDetector:
    """`memory_pressure`: allocated or reserved bytes above `threshold` of the capacity."""

    threshold: float = 0.92
    patience: int = 3  # consecutive steps above the threshold
    cooldown_steps: int = 200
    capacity_bytes: int | None = None  # override; default: the device's, or host memory on CPU
    name: str = "memory_pressure"
    _gate: Persistence = field(init=False)

    def __post_init__(self) -> None:
        self._gate = Persistence(self.patience, self.cooldown_steps)

    def observe(self, stats: StepStats) -> list[AnomalyEvent]:
        used = max(stats.mem_bytes or 0, stats.mem_reserved_bytes or 0)
        capacity = self.capacity_bytes or stats.mem_capacity_bytes or host_memory_bytes()
        if not used or not capacity:
            return []
        share = used / capacity
        if not self._gate.update(share > self.threshold, stats.tick):
            return []
        return [
            event(
                stats,
                "memory_pressure",
                value=share,
                threshold=self.threshold,
                severity="critical" if share > (1 + self.threshold) / 2 else "warning",
                used_bytes=used,
                capacity_bytes=capacity,
            )
        ]

    def reset(self) -> None:
        self._gate.reset()


def _cuda_allocator_stats() -> Mapping[str, int]:
    return torch.cuda.memory_stats()


@dataclass
class MemoryFragmentationDetector:
    """`memory_fragmentation`: over `threshold` of reserved memory is stranded in split segments.

    `measure="reserved_free"` uses the plain `1 - allocated / reserved` from
    the step's numbers instead (cheaper, but it counts the cache of freed
    activations as waste). The allocator statistics are read every `every`
    steps; the condition must hold for `patience` reads in a row.
    """

    threshold: float = 0.30
    min_reserved_bytes: int = _GiB
    every: int = 10
    patience: int = 3
    cooldown_steps: int = 500
    measure: Literal["inactive_split", "reserved_free"] = "inactive_split"
    stats_fn: Callable[[], Mapping[str, int]] = _cuda_allocator_stats
    name: str = "memory_fragmentation"
    _gate: Persistence = field(init=False)

    def __post_init__(self) -> None:
        self._gate = Persistence(self.patience, self.cooldown_steps)

    def observe(self, stats: StepStats) -> list[AnomalyEvent]:
        if stats.mem_reserved_bytes is None or stats.step % self.every:
            return []  # no caching allocator (CPU), or not a reading step
        share, reserved = self._share(stats)
        if reserved < self.min_reserved_bytes:
            self._gate.reset()
            return []
        if not self._gate.update(share > self.threshold, stats.tick):
            return []
        return [
            event(
                stats,
                "memory_fragmentation",
                value=share,
                threshold=self.threshold,
                reserved_bytes=reserved,
                measure=self.measure,
            )
        ]

    def _share(self, stats: StepStats) -> tuple[float, int]:
        if self.measure == "reserved_free":
            reserved = stats.mem_reserved_bytes or 0
            return (1 - (stats.mem_bytes or 0) / reserved if reserved else 0.0), reserved
        raw = self.stats_fn()
        reserved = int(raw.get("reserved_bytes.all.current", 0))
        stranded = int(raw.get("inactive_split_bytes.all.current", 0))
        return (stranded / reserved if reserved else 0.0), reserved

    def reset(self) -> None:
        self._gate.reset()
