"""Hardware anomalies from the NVML sampler, stamped with this rank's step.

The sampler thread (`workers.hardware`) has no idea which step training is
at; this detector does. Each step it tells the sampler that training is
progressing (so utilization drops are judged only while it is) and turns the
sampler's findings into `AnomalyEvent`s with source `hardware`. It costs a
lock and a list swap per step. Where no NVIDIA driver is present the
sampler is off and so is this.

It also works as a background event source
(`GuardConfig(event_sources=[HardwareMonitor(rank=r)])`): `drain()`, which
the Guard calls once per step, stamps events with the last step `observe`
saw, or, used as a source alone, with the number of drains so far (the
executed-step count, since the Guard drains once per step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from remedy.policies import AnomalyEvent
from remedy.rank.loop.stats import StepStats

if TYPE_CHECKING:
    from remedy.rank.loop.hardware import HardwareSampler, Subscription


@dataclass
class HardwareMonitor:
    """Events from the process's NVML sampler (started on first use)."""

    sampler: HardwareSampler | None = field(default=None, repr=False)
    rank: int = 0  # for `drain()` used as an event source; `observe` reads it from the step
    name: str = "hardware"
    _sub: Subscription | None = field(default=None, repr=False)
    _off: bool = False
    _seen: tuple[int, int, int] | None = None  # rank, step, tick of the last observed step
    _drains: int = 0

    def _subscribe(self) -> Subscription | None:
        if self.sampler is None:
            from remedy.rank.loop.hardware import get_sampler  # noqa: PLC0415 - avoids an import cycle

            self.sampler = get_sampler()
        if not self.sampler.available:
            self._off = True
            return None
        self._sub = self.sampler.subscribe()
        return self._sub

    def observe(self, stats: StepStats) -> list[AnomalyEvent]:
        self._seen = (stats.rank, stats.step, stats.tick)
        return self._collect(stats.rank, stats.step, stats.tick)

    def drain(self) -> list[AnomalyEvent]:
        """The event-source form: findings since the last call, stamped as the class says."""
        self._drains += 1
        rank, step, tick = self._seen or (self.rank, self._drains - 1, self._drains - 1)
        return self._collect(rank, step, tick)

    def _collect(self, rank: int, step: int, tick: int) -> list[AnomalyEvent]:
        if self._off:
            return []
        sub = self._sub or self._subscribe()
        if sub is None:
            return []
        sub.note_activity()
        found = sub.drain()
        if not found:
            return []
        now = time.time()
        out = []
        for gpu, uuid, f in found:
            details: dict[str, Any] = {"gpu": gpu, **f.details}
            if uuid:
                details["uuid"] = uuid
            out.append(
                AnomalyEvent(
                    kind=f.kind,
                    rank=rank,
                    step=step,
                    tick=tick,
                    value=f.value,
                    threshold=f.threshold,
                    severity=f.severity,
                    source="hardware",
                    ts=now,
                    details=details,
                )
            )
        return out

    def reset(self) -> None:
        """Hardware state does not roll back."""
