"""One incident, one remedy: anomalies that are the same fault are merged before the policy decides.

A NaN loss on one rank of a data-parallel job becomes a NaN gradient on every
rank through the all-reduce: one fault, seen as `nonfinite_loss` on one rank
and `nonfinite_grad` on all of them, at the same executed step (tick). Given
to the policy apart, each fires its own rule (a rollback and an LR cut).

`IncidentMerger` hands the policy one event per incident: the one closest to
the cause (`CAUSE_ORDER`, then the lowest rank), whose `details["merged"]`
lists the others, so the journal and `remedy explain` name them. Every kind
of the family, the cause included, is held at its tick until every rank has
reported that tick (or `hold_s` has passed, for a rank that stopped
reporting): the rank with the NaN loss reports at once, the others' NaN
gradients a moment later, and a decision taken on the first report alone
would be journaled without them. The wait is one report of the slowest
rank; the ranks skip the bad update themselves meanwhile. An event of the
family that comes for a tick already decided (after `hold_s`) joins that
incident and is not decided again. Other kinds pass straight through.

Pure: no I/O, no clock of its own (`now` is given), so it is tested alone.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from remedy.policies._events import AnomalyEvent

# Kinds a collective carries from the rank where a fault starts to the others, the
# nearest to the cause first: a bad loss makes bad gradients, not the other way round.
CAUSE_ORDER: tuple[str, ...] = ("nonfinite_loss", "nonfinite_grad", "grad_norm_explosion")
# Longest wait for the other ranks' reports of a tick. Healthy ranks report within a
# heartbeat (0.5 s) and release the hold at once; this bound only matters for a rank
# that stopped reporting. With 1 s, a 2-rank DDP NaN under load average 18 once gave
# two decision chains (a rank's report of the step came too late to be merged).
HOLD_S = 5.0
DECIDED_KEPT = 256  # ticks whose incident is remembered, for late arrivals


@dataclass
class IncidentMerger:
    """Merges the numerics anomalies of one tick, across ranks, into one incident."""

    world_size: int
    hold_s: float = HOLD_S
    _held: dict[int, list[AnomalyEvent]] = field(default_factory=dict)
    _since: dict[int, float] = field(default_factory=dict)
    _decided: OrderedDict[int, AnomalyEvent] = field(default_factory=OrderedDict)
    late: list[tuple[AnomalyEvent, AnomalyEvent]] = field(default_factory=list)

    def offer(
        self, events: Iterable[AnomalyEvent], *, ticks: Mapping[int, int], now: float
    ) -> list[AnomalyEvent]:
        """The events the policy should decide now, given one report's events.

        `ticks`: each rank's newest reported tick (a report's tick counts the steps
        it has finished, so a rank whose tick is above T has reported step T).
        """
        out: list[AnomalyEvent] = []
        by_tick: dict[int, list[AnomalyEvent]] = {}
        for ev in events:
            if ev.kind in CAUSE_ORDER:
                by_tick.setdefault(ev.tick, []).append(ev)
            else:
                out.append(ev)
        for tick, found in by_tick.items():
            if tick in self._decided:
                self.late.extend((ev, self._decided[tick]) for ev in found)
                del self.late[:-DECIDED_KEPT]
            else:
                self._held.setdefault(tick, []).extend(found)
                self._since.setdefault(tick, now)
        out.extend(self._release(ticks, now))
        return out

    def state(self) -> dict[str, Any]:
        """What a restarted supervisor needs: the held events (acknowledged to their ranks, so
        sent by nobody again) and the ticks already decided (a late event stays merged)."""
        return {
            "held": {str(t): [e.to_dict() for e in evs] for t, evs in self._held.items()},
            "decided": {str(t): e.to_dict() for t, e in self._decided.items()},
        }

    def restore(self, state: Mapping[str, Any] | None, *, now: float) -> None:
        """Take `state()` back; the held events wait afresh from `now`."""
        if not state:
            return
        self._held = {
            int(t): [AnomalyEvent.from_dict(e) for e in evs] for t, evs in state["held"].items()
        }
        self._since = dict.fromkeys(self._held, now)
        self._decided = OrderedDict(
            (int(t), AnomalyEvent.from_dict(e)) for t, e in state["decided"].items()
        )

    def rewound(self, tick: int) -> None:
        """Every rank restarted from `tick` (a full-group restart from a checkpoint, or from the
        start): the steps from there on run again, so an event of a tick at or after it is a
        new incident, not a late part of the one decided there before."""
        for t in [t for t in self._decided if t >= tick]:
            del self._decided[t]

    def flush(self) -> list[AnomalyEvent]:
        """Every held incident, merged: the run is ending."""
        return [self._merge(self._pop(tick)) for tick in sorted(self._held)]

    def holds_through(self, tick: int) -> bool:
        """Whether an incident of `tick`, or of an earlier one, is still held."""
        return any(t <= tick for t in self._held)

    @property
    def holding(self) -> int:
        return sum(len(v) for v in self._held.values())

    def _release(self, ticks: Mapping[int, int], now: float) -> list[AnomalyEvent]:
        ready = []
        for tick in sorted(self._held):
            everyone = all(ticks.get(r, -1) > tick for r in range(self.world_size))
            if everyone or now - self._since[tick] >= self.hold_s:
                ready.append(self._merge(self._pop(tick)))
        return ready

    def _pop(self, tick: int) -> list[AnomalyEvent]:
        del self._since[tick]
        return self._held.pop(tick)

    def _merge(self, events: list[AnomalyEvent]) -> AnomalyEvent:
        events = sorted(events, key=lambda e: (CAUSE_ORDER.index(e.kind), e.rank))
        root, others = events[0], events[1:]
        if others:
            details: dict[str, Any] = dict(root.details)
            details["merged"] = [
                {"kind": e.kind, "rank": e.rank, "step": e.step, "value": _finite(e.value)}
                for e in others
            ]
            root = dataclasses.replace(root, details=details)
        self._decided[root.tick] = root
        while len(self._decided) > DECIDED_KEPT:
            self._decided.popitem(last=False)
        return root


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def merged_text(anomaly: Mapping[str, Any]) -> str | None:
    """One line naming the events merged into a decision's anomaly (None if none were)."""
    merged = anomaly.get("merged")
    if merged is None:
        details = anomaly.get("details")
        merged = details.get("merged") if isinstance(details, Mapping) else None
    if not isinstance(merged, list) or not merged:
        return None
    parts = [f"{m.get('kind')} on rank {m.get('rank')}" for m in merged if isinstance(m, Mapping)]
    return (
        f"merged into this incident (the same fault at the same executed step, seen on "
        f"several ranks or through a collective): {', '.join(parts)}"
    )
