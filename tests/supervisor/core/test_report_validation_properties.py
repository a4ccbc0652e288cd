"""Property: valid report items mixed with invalid ones are decided exactly as they would be alone."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remedy.control.decide import Controller
from remedy.policies import AnomalyEvent, Decision, Engine, load_policy
from tests.supervisor.core.carried import Carried

KINDS = [
    "nonfinite_loss",
    "nonfinite_grad",
    "loss_spike",
    "grad_norm_explosion",
    "scaler_overflow",
    "data_stall",
    "oom",
    "rank_hang",
    "gpu_ecc",
    "memory_pressure",
]

# Invalid items, as functions of (rank, tick, world size); each is refused with one count.
BadItem = Callable[[int, int, int], Any]


def _ev(rank: int, tick: int, /, **fields: Any) -> dict[str, Any]:
    return {**AnomalyEvent("nonfinite_loss", rank, tick, severity="critical").to_dict(), **fields}


BAD_EVENTS: list[BadItem] = [
    lambda r, t, w: "x",
    lambda r, t, w: None,
    lambda r, t, w: [1],
    lambda r, t, w: _ev(r, t, kind="nonsense"),
    lambda r, t, w: _ev(r, t, kind=[1]),
    lambda r, t, w: _ev(r, t, value=10**400),
    lambda r, t, w: _ev(r, t, threshold="high"),
    lambda r, t, w: _ev(r, t, step="5"),
    lambda r, t, w: _ev(r, t, tick=-1),
    lambda r, t, w: _ev(r, t, rank=(r + 1) % w if w > 1 else 7),
    lambda r, t, w: _ev(r, t, tick=t + 1),
    lambda r, t, w: _ev(r, t, tick=10**12),
    lambda r, t, w: _ev(r, t, step=10**30, tick=t),
    lambda r, t, w: _ev(r, t, details={"blob": "z" * 10_000}),
    lambda r, t, w: _ev(r, t, colour="red"),
]
BAD_METRICS: list[BadItem] = [
    lambda r, t, w: "garbage",
    lambda r, t, w: {"step": "abc", "tick": t},
    lambda r, t, w: {"step": t, "tick": t, "rank": r, "loss": 10**400},
    lambda r, t, w: {"step": t, "tick": t, "rank": r + 1, "step_time_s": 9.0},
    lambda r, t, w: {"step": t, "tick": t + 5, "rank": r, "step_time_s": 9.0},
]
BAD_OUTCOMES: list[BadItem] = [
    lambda r, t, w: {"decision_id": ["x"], "rank": r, "outcome": "applied", "step": t, "tick": t},
    lambda r, t, w: {"decision_id": "nope", "rank": r, "outcome": "applied", "step": t, "tick": t},
    lambda r, t, w: {
        "decision_id": "r-d00001",
        "rank": r,
        "outcome": "maybe",
        "step": t,
        "tick": t,
    },
    lambda r, t, w: {"rank": r},
    lambda r, t, w: 3.5,
]
# Whole batches with an invalid header: refused with one count, whatever they hold.
BAD_BATCHES: list[BadItem] = [
    lambda r, t, w: {"rank": w + 3, "step": t, "tick": 10**12, "events": [_ev(w + 3, t)]},
    lambda r, t, w: {"rank": r, "step": t, "tick": "abc", "events": [_ev(r, t)]},
    lambda r, t, w: {"rank": r, "step": t, "tick": None, "events": [_ev(r, t)]},
    lambda r, t, w: {"rank": r, "step": t, "tick": [1], "events": [_ev(r, t)]},
    # From another rank, whose next genuine report comes later: its marks would stick till then.
    lambda r, t, w: {"rank": (r + 1) % w, "step": t, "tick": t + 10**9},
    lambda r, t, w: {"rank": (r + 1) % w, "step": t + 10**9, "tick": t},
    lambda r, t, w: {"rank": r, "step": 10**30, "tick": t},
    lambda r, t, w: {"rank": str(r), "step": t, "tick": t, "events": [_ev(r, t)]},
    lambda r, t, w: ["rank", r],
]


@dataclass
class Round:
    rank: int
    advance: int
    events: list[tuple[str, int]]  # (kind, how many ticks back)
    ack: bool
    fail_first: bool
    bad_events: list[int]
    bad_metrics: list[int]
    bad_outcomes: list[int]
    bad_batch: int | None
    seed: int


@st.composite
def rounds(draw: st.DrawFn, world: int) -> Round:
    def picks(table: list[BadItem]) -> list[int]:
        return draw(st.lists(st.integers(0, len(table) - 1), max_size=3))

    return Round(
        rank=draw(st.integers(0, world - 1)),
        advance=draw(st.integers(0, 3)),
        events=draw(st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 2)), max_size=3)),
        ack=draw(st.booleans()),
        fail_first=draw(st.booleans()),
        bad_events=picks(BAD_EVENTS),
        bad_metrics=picks(BAD_METRICS),
        bad_outcomes=picks(BAD_OUTCOMES),
        bad_batch=draw(st.none() | st.integers(0, len(BAD_BATCHES) - 1)),
        seed=draw(st.integers(0, 2**16)),
    )


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[int, list[Round]]:
    world = draw(st.integers(1, 3))
    return world, draw(st.lists(rounds(world), min_size=1, max_size=30))


def replaced(_decision: Decision) -> tuple[str, str]:
    return "applied", "rank replaced"


@dataclass
class Run:
    """One Controller fed a scenario, with or without the invalid items."""

    world: int
    mixed: bool
    now: list[float] = field(default_factory=lambda: [1000.0])
    controller: Controller = field(init=False)
    owed: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    replies: list[list[dict[str, Any]]] = field(default_factory=list)
    injected: int = 0

    def __post_init__(self) -> None:
        engine = Engine(load_policy("default"), run_id="r")
        self.controller = Carried(
            engine, world_size=self.world, group_action=replaced, started=self.now[0]
        )

    def play(self, rounds: list[Round]) -> None:
        ticks = dict.fromkeys(range(self.world), 0)
        for rnd in rounds:
            self.now[0] += 0.01
            r = rnd.rank
            ticks[r] += rnd.advance
            t = ticks[r]
            if self.mixed and rnd.bad_batch is not None:
                self.controller.ingest(
                    BAD_BATCHES[rnd.bad_batch](r, t, self.world), now=self.now[0]
                )
                self.injected += 1
            events: list[Any] = [
                AnomalyEvent(kind, r, max(t - back, 0), severity="critical").to_dict()
                for kind, back in rnd.events
            ]
            metrics: list[Any] = [
                {"step": t, "tick": t, "rank": r, "loss": 1.0, "step_time_s": 0.1}
            ]
            outcomes: list[Any] = []
            if rnd.ack:
                for i, cmd in enumerate(self.owed.get(r, [])):
                    result = "failed" if rnd.fail_first and i == 0 else "applied"
                    outcomes.append(
                        {
                            "decision_id": cmd["decision_id"],
                            "rank": r,
                            "outcome": result,
                            "step": t,
                            "tick": t,
                            "detail": "",
                        }
                    )
            batch: dict[str, Any] = {"rank": r, "step": t, "tick": t}
            if self.mixed:
                shuffle = random.Random(rnd.seed)
                events = _mix(
                    events, [BAD_EVENTS[i](r, t, self.world) for i in rnd.bad_events], shuffle
                )
                metrics = _mix(
                    metrics, [BAD_METRICS[i](r, t, self.world) for i in rnd.bad_metrics], shuffle
                )
                outcomes = _mix(
                    outcomes, [BAD_OUTCOMES[i](r, t, self.world) for i in rnd.bad_outcomes], shuffle
                )
                self.injected += len(rnd.bad_events) + len(rnd.bad_metrics) + len(rnd.bad_outcomes)
            batch.update(events=events, metrics=metrics, outcomes=outcomes)
            reply = self.controller.ingest(batch, now=self.now[0])
            self.owed[r] = reply
            self.replies.append(reply)

    def decided(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in d.items() if k != "latency_s"} for d in self.controller.decisions]


def _mix(valid: list[Any], bad: list[Any], rng: random.Random) -> list[Any]:
    """The valid items in their order, with the bad ones inserted at random places."""
    out = list(valid)
    for item in bad:
        out.insert(rng.randint(0, len(out)), item)
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_invalid_items_never_change_decisions(scenario: tuple[int, list[Round]]) -> None:
    """The valid items give the same replies, decisions and counts with or without invalid ones mixed in."""
    world, plan = scenario
    alone, mixed = Run(world, mixed=False), Run(world, mixed=True)
    alone.play(plan)
    mixed.play(plan)
    assert mixed.replies == alone.replies
    assert mixed.decided() == alone.decided()
    a, m = alone.controller, mixed.controller
    assert (m.anomaly_counts, m.action_counts, m.outcome_counts) == (
        a.anomaly_counts,
        a.action_counts,
        a.outcome_counts,
    )
    assert set(m.pending) == set(a.pending)
    assert (m.step_of, m.tick_of, m.abort_reason) == (a.step_of, a.tick_of, a.abort_reason)
    # Every invalid item or batch is counted once, under some reason.
    assert m.rejected.total() - a.rejected.total() == mixed.injected
