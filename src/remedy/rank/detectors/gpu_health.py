"""Judging a GPU's health from its NVML readings (pure: no NVML, no threads).

`workers.hardware` samples each local GPU about once a second into a
`GpuReading`; a `GpuHealth` per GPU turns the stream of readings into
findings, which the `HardwareMonitor` detector stamps with the training
step. Keeping the judgement here, apart from the sampling, lets it be tested
with plain numbers.

- `gpu_thermal`: above `temp_limit_c`, or `temp_jump_c` above the median of
  the last `temp_window_s` of training (a cooling failure). Jumps only count
  after `temp_warmup_s` of training: every GPU warms up when a job starts.
- `gpu_throttle`: the clock-event reasons include hardware slowdown, thermal
  slowdown (software or hardware) or the power brake for
  `throttle_samples` readings in a row. The software power cap is left out:
  it is how a busy GPU normally runs.
- `gpu_ecc`: new uncorrected ECC errors since sampling started (critical),
  or at least `ecc_corrected_min` new corrected ones (warning).
- `gpu_util_drop`: while training, utilization below `util_drop_frac` of its
  recent median (itself at least `util_min_median` %) for `drop_samples`
  readings in a row.
- `pcie_throughput_drop`: likewise for PCIe TX+RX throughput (median at
  least `pcie_min_median_kbps`), or the link trained to fewer lanes than it
  has.
- `nvlink_error`: an NVLink CRC, replay or recovery counter went up.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Clock-event reason bits (nvml.h): which ones mean "the hardware is slowing down".
HW_SLOWDOWN = 0x8
SW_THERMAL_SLOWDOWN = 0x20
HW_THERMAL_SLOWDOWN = 0x40
HW_POWER_BRAKE_SLOWDOWN = 0x80
_THROTTLE_NAMES = {
    HW_SLOWDOWN: "hw_slowdown",
    SW_THERMAL_SLOWDOWN: "sw_thermal",
    HW_THERMAL_SLOWDOWN: "hw_thermal",
    HW_POWER_BRAKE_SLOWDOWN: "power_brake",
}


@dataclass(frozen=True)
class GpuReading:
    """One sample of one GPU; a field is None where the GPU does not report it."""

    index: int
    ts: float  # seconds, monotonic
    active: bool = True  # was training progressing when the sample was taken
    uuid: str | None = None
    temperature_c: float | None = None
    throttle_reasons: int | None = None
    ecc_corrected: int | None = None
    ecc_uncorrected: int | None = None
    util_pct: float | None = None
    pcie_kbps: float | None = None  # TX + RX
    pcie_width: int | None = None
    pcie_max_width: int | None = None
    nvlink_errors: Mapping[str, int] | None = None  # "link3.replay" -> running count


@dataclass(frozen=True)
class Finding:
    """A hardware anomaly before it is stamped with a rank and a step."""

    kind: str
    value: float | None
    threshold: float | None
    severity: str
    details: Mapping[str, Any]


@dataclass
class GpuThresholds:
    """Every hardware threshold, with its default."""

    temp_limit_c: float = 85.0
    temp_jump_c: float = 15.0
    temp_window_s: float = 300.0
    temp_warmup_s: float = 300.0
    throttle_mask: int = (
        HW_SLOWDOWN | SW_THERMAL_SLOWDOWN | HW_THERMAL_SLOWDOWN | HW_POWER_BRAKE_SLOWDOWN
    )
    throttle_samples: int = 3
    ecc_corrected_min: int = 10
    util_drop_frac: float = 0.5
    util_min_median: float = 50.0
    pcie_drop_frac: float = 0.25
    pcie_min_median_kbps: float = 100_000.0
    history: int = 60  # readings in the medians (about a minute)
    drop_samples: int = 5
    cooldown_s: float = 300.0  # the same kind on the same GPU at most this often


@dataclass
class GpuHealth:
    """Rolling state for one GPU; `update(reading)` returns new findings."""

    limits: GpuThresholds = field(default_factory=GpuThresholds)
    _temps: deque[tuple[float, float]] = field(default_factory=deque)
    _active_since: float | None = None
    _throttled: int = 0
    _ecc_base: tuple[int | None, int | None] | None = None
    _ecc_seen: tuple[int, int] = (0, 0)
    _util: deque[float] = field(default_factory=deque)
    _util_low: int = 0
    _pcie: deque[float] = field(default_factory=deque)
    _pcie_low: int = 0
    _nvlink: dict[str, int] = field(default_factory=dict)
    _last: dict[str, float] = field(default_factory=dict)

    def update(self, r: GpuReading) -> list[Finding]:
        out: list[Finding] = []
        self._active_since = (self._active_since or r.ts) if r.active else None
        out += self._thermal(r) + self._throttle(r) + self._ecc(r)
        out += self._util_drop(r) + self._pcie_drop(r) + self._nvlink_errors(r)
        ready = []
        for f in out:
            last = self._last.get(f.kind)
            if last is None or r.ts - last >= self.limits.cooldown_s:
                self._last[f.kind] = r.ts
                ready.append(f)
        return ready

    def _thermal(self, r: GpuReading) -> list[Finding]:
        lim, t = self.limits, r.temperature_c
        if t is None:
            return []
        if t > lim.temp_limit_c:
            sev = "critical" if t > lim.temp_limit_c + 5 else "warning"
            return [Finding("gpu_thermal", t, lim.temp_limit_c, sev, {"reason": "limit"})]
        if not r.active:
            self._temps.clear()
            return []
        while self._temps and r.ts - self._temps[0][0] > lim.temp_window_s:
            self._temps.popleft()
        base = statistics.median(x for _, x in self._temps) if self._temps else t
        self._temps.append((r.ts, t))
        warmed = self._active_since is not None and r.ts - self._active_since >= lim.temp_warmup_s
        if warmed and t - base >= lim.temp_jump_c:
            details = {"reason": "jump", "baseline_c": base}
            return [Finding("gpu_thermal", t, base + lim.temp_jump_c, "warning", details)]
        return []

    def _throttle(self, r: GpuReading) -> list[Finding]:
        bits = (r.throttle_reasons or 0) & self.limits.throttle_mask
        self._throttled = self._throttled + 1 if bits else 0
        if self._throttled < self.limits.throttle_samples:
            return []
        reasons = [name for bit, name in _THROTTLE_NAMES.items() if bits & bit]
        return [Finding("gpu_throttle", float(bits), None, "warning", {"reasons": reasons})]

    def _ecc(self, r: GpuReading) -> list[Finding]:
        if self._ecc_base is None:
            self._ecc_base = (r.ecc_corrected, r.ecc_uncorrected)
            return []
        corrected = _since(r.ecc_corrected, self._ecc_base[0])
        uncorrected = _since(r.ecc_uncorrected, self._ecc_base[1])
        out = []
        if uncorrected > self._ecc_seen[1]:
            out.append(Finding("gpu_ecc", uncorrected, 0, "critical", {"type": "uncorrected"}))
        elif corrected >= self.limits.ecc_corrected_min and corrected > self._ecc_seen[0]:
            thr = self.limits.ecc_corrected_min
            out.append(Finding("gpu_ecc", corrected, thr, "warning", {"type": "corrected"}))
        self._ecc_seen = (max(corrected, self._ecc_seen[0]), max(uncorrected, self._ecc_seen[1]))
        return out

    def _util_drop(self, r: GpuReading) -> list[Finding]:
        lim = self.limits
        found, self._util_low = _drop(
            self._util, r.util_pct if r.active else None, self._util_low, lim.history,
            lim.util_drop_frac, lim.util_min_median, lim.drop_samples,
        )  # fmt: skip
        if found is None:
            return []
        value, median = found
        thr = lim.util_drop_frac * median
        return [Finding("gpu_util_drop", value, thr, "warning", {"median_pct": median})]

    def _pcie_drop(self, r: GpuReading) -> list[Finding]:
        lim = self.limits
        if r.active and r.pcie_width and r.pcie_max_width and r.pcie_width < r.pcie_max_width:
            details = {"reason": "link_width", "max_width": r.pcie_max_width}
            return [
                Finding("pcie_throughput_drop", r.pcie_width, r.pcie_max_width, "warning", details)
            ]
        found, self._pcie_low = _drop(
            self._pcie, r.pcie_kbps if r.active else None, self._pcie_low, lim.history,
            lim.pcie_drop_frac, lim.pcie_min_median_kbps, lim.drop_samples,
        )  # fmt: skip
        if found is None:
            return []
        value, median = found
        details = {"reason": "throughput", "median_kbps": median}
        return [
            Finding("pcie_throughput_drop", value, lim.pcie_drop_frac * median, "warning", details)
        ]

    def _nvlink_errors(self, r: GpuReading) -> list[Finding]:
        if r.nvlink_errors is None:
            return []
        grown = {
            k: v - self._nvlink[k] for k, v in r.nvlink_errors.items() if v > self._nvlink.get(k, v)
        }
        self._nvlink.update(r.nvlink_errors)
        if not grown:
            return []
        return [
            Finding("nvlink_error", float(sum(grown.values())), 0, "warning", {"counters": grown})
        ]


def _since(now: int | None, base: int | None) -> int:
    return 0 if now is None else now - (base or 0)


def _drop(
    history: deque[float],
    value: float | None,
    low_streak: int,
    keep: int,
    frac: float,
    min_median: float,
    persist: int,
) -> tuple[tuple[float, float] | None, int]:
    """Shared by the utilization and PCIe checks: (value, median) once low for `persist` readings."""
    if value is None:
        return None, 0
    median = statistics.median(history) if len(history) >= persist else None
    low = median is not None and median >= min_median and value < frac * median
    if not low:
        # Low readings stay out of the history so that a long drop does not become the new normal.
        history.append(value)
        if len(history) > keep:
            history.popleft()
        return None, 0
    assert median is not None
    low_streak += 1
    return ((value, median) if low_streak >= persist else None), low_streak
