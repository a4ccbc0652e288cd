"""The controller finds stragglers in the ranks' step-time metrics and answers them like any anomaly."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remedy.control.decide import Controller
from remedy.control.straggler import StragglerWatch
from remedy.policies import AnomalyEvent, Decision, Engine, load_policy
from remedy.rundir.writer import RunDir, read_jsonl
from tests.supervisor.core.carried import Carried

FAST_S = 0.1
SLOW_S = 0.3  # 3x the others: a straggler by the default ratio (1.5x) and excess (50 ms)

Times = Callable[[int, int], dict[str, Any]]  # (rank, step) -> the timing fields of a record


def make_controller(tmp_path: Path, world_size: int, **kwargs: Any) -> Controller:
    engine = Engine(load_policy("default"), run_id="r")
    return Carried(engine, world_size=world_size, files=RunDir(tmp_path, "r"), **kwargs)


def wall(slow: int | None) -> Times:
    """Plain step times: rank `slow` takes SLOW_S, the others FAST_S."""
    return lambda rank, _step: {"step_time_s": SLOW_S if rank == slow else FAST_S}


def record(rank: int, step: int, times: Times, *, tick: int | None = None) -> dict[str, Any]:
    tick = step if tick is None else tick
    return {"step": step, "tick": tick, "rank": rank, "loss": 1.0, **times(rank, step)}


def report(controller: Controller, rank: int, metrics: list[dict[str, Any]]) -> None:
    """One report batch from `rank`, as the Guard sends it (step: the next step to run)."""
    step, tick = metrics[-1]["step"] + 1, metrics[-1]["tick"] + 1
    controller.ingest({"rank": rank, "step": step, "tick": tick, "metrics": metrics})


def run_steps(controller: Controller, world: int, steps: range, times: Times) -> None:
    """Every rank reports each step in turn, one record per batch."""
    for step in steps:
        for rank in range(world):
            report(controller, rank, [record(rank, step, times)])


def stragglers(tmp_path: Path) -> list[dict[str, Any]]:
    return [a for a in read_jsonl(tmp_path / "anomalies.jsonl") if a["kind"] == "straggler"]


@pytest.mark.parametrize(("world", "slow"), [(2, 0), (2, 1), (4, 2)])
def test_slow_rank_is_reported(tmp_path: Path, world: int, slow: int) -> None:
    """A rank 3x slower than its peers is one straggler event, in anomalies.jsonl and the counts."""
    controller = make_controller(tmp_path, world)
    run_steps(controller, world, range(12), wall(slow))
    (event,) = stragglers(tmp_path)
    assert (event["rank"], event["source"], event["severity"]) == (slow, "supervisor", "warning")
    assert event["value"] == pytest.approx(SLOW_S)
    assert event["details"]["peer_median_s"] == pytest.approx(FAST_S)
    # Checked when rank 0 opens step s: 5 samples on every rank at s=5, three slow checks
    # in a row by s=7, stamped with the step every rank has reached.
    assert event["step"] == 6
    assert controller.anomaly_counts["straggler"] == 1


def test_time_in_collectives_is_not_compute(tmp_path: Path) -> None:
    """Wall times evened out by the all-reduce still show the slow rank once collective_s is taken out."""

    def times(rank: int, _step: int) -> dict[str, Any]:
        # The fast ranks spend 0.3 s of each 0.4 s step waiting for rank 1.
        return {"step_time_s": 0.4, "collective_s": 0.01 if rank == 1 else 0.3}

    controller = make_controller(tmp_path, 4)
    run_steps(controller, 4, range(12), times)
    (event,) = stragglers(tmp_path)
    assert event["rank"] == 1
    assert event["value"] == pytest.approx(0.39)


@pytest.mark.parametrize("timed", [True, False], ids=["ddp-timed", "untimed"])
def test_waiting_for_a_peers_phase_is_not_compute(tmp_path: Path, timed: bool) -> None:
    """Rank 0 logs before two steps in three (its phase: not in its step time) while rank 1
    waits 0.5 s for it in the step's collectives: rank 1 is no straggler, with the wait timed
    by the DDP hook (collective_s) or only known from the phase exchange (phase_wait_s)."""

    def times(rank: int, step: int) -> dict[str, Any]:
        if rank == 0 or step % 3 == 2:
            return {"step_time_s": FAST_S, **({"collective_s": 0.01} if timed else {})}
        waited = {"collective_s": 0.51} if timed else {}
        return {"step_time_s": FAST_S + 0.5, "phase_wait_s": 0.5, **waited}

    controller = make_controller(tmp_path, 2)
    run_steps(controller, 2, range(30), times)
    assert stragglers(tmp_path) == []


def test_default_policy_notifies_about_a_straggler(tmp_path: Path) -> None:
    """The bundled policy answers with its catch-all notify rule, journaled as applied."""
    controller = make_controller(tmp_path, 2)
    run_steps(controller, 2, range(12), wall(1))
    (decision,) = read_jsonl(tmp_path / "decisions.jsonl")
    assert (decision["rule"], decision["action"], decision["outcome"]) == (
        "notify-rest",
        "notify",
        "applied",
    )
    assert (decision["anomaly"]["kind"], decision["anomaly"]["rank"]) == ("straggler", 1)
    assert decision["reason"]
    assert controller.commands_for(0) == controller.commands_for(1) == []


MALFORMED: list[Any] = [
    {"step_time_s": "0.3"},
    {"step_time_s": float("nan")},
    {"step_time_s": float("inf")},
    {"step_time_s": -0.3},
    {"step_time_s": None},
    {"step_time_s": True},
    {"step_time_s": 10**400},
    {},
    {"step_time_s": 0.3, "collective_s": "0.1"},
    {"step_time_s": 0.3, "collective_s": float("nan")},
    {"step_time_s": 0.3, "collective_s": -1.0},
    {"step_time_s": 0.3, "phase_wait_s": "0.1"},
    {"step_time_s": 0.3, "phase_wait_s": float("inf")},
]


@pytest.mark.parametrize("fields", MALFORMED, ids=repr)
def test_malformed_times_are_ignored(tmp_path: Path, fields: dict[str, Any]) -> None:
    """A slow rank whose records carry no usable time is never reported, and nothing raises."""
    controller = make_controller(tmp_path, 2)
    run_steps(controller, 2, range(12), lambda r, _s: fields if r == 1 else {"step_time_s": FAST_S})
    assert stragglers(tmp_path) == []
    assert controller.anomaly_counts["straggler"] == 0


def test_garbage_records_do_not_hide_good_ones(tmp_path: Path) -> None:
    """Records with a bad step or tick or of the wrong type, or from a rank outside the job, are
    skipped and counted; valid ones in the same batch count."""
    controller = make_controller(tmp_path, 2)
    garbage: list[Any] = [
        "x",
        None,
        [1, 2],
        {"step": "3", "step_time_s": 9.0},
        {"step": None, "step_time_s": 9.0},
        {"step": True, "step_time_s": 9.0},
        {"step_time_s": 9.0},
    ]
    for step in range(12):
        for rank in (0, 1):
            good = record(rank, step, wall(1))
            bad_tick = {**good, "tick": "t"}
            controller.ingest(
                {"rank": rank, "step": step + 1, "metrics": [*garbage, bad_tick, good]}
            )
        report(controller, 5, [record(5, step, wall(5))])  # no rank 5 in a 2-rank job
    assert [e["rank"] for e in stragglers(tmp_path)] == [1]
    assert controller.rejected["metrics_invalid"] == 12 * 2 * (len(garbage) + 1)
    assert controller.rejected["batch_rank_outside_world"] == 12


@pytest.mark.parametrize(
    ("world", "times"),
    [
        (2, wall(None)),  # balanced
        (4, wall(None)),
        (1, wall(0)),  # one rank has no peers to lag behind
    ],
    ids=["balanced-2", "balanced-4", "single-rank"],
)
def test_no_straggler_no_event(tmp_path: Path, world: int, times: Times) -> None:
    """Balanced ranks, or a single rank however slow, give no straggler event."""
    controller = make_controller(tmp_path, world)
    run_steps(controller, world, range(30), times)
    assert stragglers(tmp_path) == []
    assert read_jsonl(tmp_path / "decisions.jsonl") == []


def test_watch_defaults_and_settings(tmp_path: Path) -> None:
    """A default watch with several ranks, none for one rank; `None` turns it off; settings apply."""
    assert make_controller(tmp_path, 1).straggler is None
    assert make_controller(tmp_path, 4).straggler == StragglerWatch()
    off = make_controller(tmp_path / "off", 2, straggler=None)
    run_steps(off, 2, range(12), wall(1))
    assert stragglers(tmp_path / "off") == []
    lenient = make_controller(tmp_path / "lenient", 2, straggler=StragglerWatch(ratio=5.0))
    run_steps(lenient, 2, range(12), wall(1))  # 3x is not 5x
    assert stragglers(tmp_path / "lenient") == []


def test_checked_once_per_step_not_per_batch(tmp_path: Path) -> None:
    """Many batches that bring no newer step do not add up to the watch's patience."""
    controller = make_controller(tmp_path, 4, straggler=StragglerWatch(patience=3))
    times = wall(3)
    # One check (newest step 5) while only rank 0 has history; the others add none.
    for rank in range(4):
        report(controller, rank, [record(rank, s, times) for s in range(6)])
    # Twelve more batches at the same newest step: no check.
    for _ in range(3):
        for rank in range(4):
            report(controller, rank, [record(rank, 5, times)])
    assert stragglers(tmp_path) == []
    run_steps(controller, 4, range(6, 8), times)  # slow checks 1 and 2
    assert stragglers(tmp_path) == []
    run_steps(controller, 4, range(8, 9), times)  # slow check 3
    assert [(e["rank"], e["step"]) for e in stragglers(tmp_path)] == [(3, 7)]


@pytest.mark.parametrize("slow_after", [None, 1])
def test_rollback_keeps_history(tmp_path: Path, slow_after: int | None) -> None:
    """Steps that go back after a rollback are no false alarm; a rank slow after it is still found."""
    controller = make_controller(tmp_path, 2)
    run_steps(controller, 2, range(20), wall(None))
    # Both ranks restore step 10; ticks keep counting (one process each).
    for step in range(10, 30):
        for rank in (0, 1):
            tick = step + 10
            report(controller, rank, [record(rank, step, wall(slow_after), tick=tick)])
    found = stragglers(tmp_path)
    if slow_after is None:
        assert found == []
    else:
        (event,) = found
        assert event["rank"] == slow_after and 10 <= event["step"] < 30


def restart_by_tick(controller: Controller) -> None:
    """The replacement process counts its ticks from zero again."""
    report(controller, 1, [record(1, 4, wall(1), tick=0)])


def restart_by_policy(controller: Controller) -> None:
    """The default policy restarts a hung rank through the worker group hook."""
    hang = AnomalyEvent("rank_hang", 1, 4, severity="critical", source="supervisor")
    controller.ingest({"rank": 1, "step": 4, "events": [hang.to_dict()]})
    report(controller, 1, [record(1, 4, wall(1))])


def replaced(_decision: Decision) -> tuple[str, str]:
    return "applied", "rank replaced"


@pytest.mark.parametrize("restart", [restart_by_tick, restart_by_policy])
def test_restarted_rank_starts_a_fresh_history(
    tmp_path: Path, restart: Callable[[Controller], None]
) -> None:
    """Samples from a replaced rank's old process are dropped: it needs `min_samples` new ones."""
    watch = StragglerWatch(window=5, min_samples=5, patience=1)
    controller = make_controller(tmp_path, 2, straggler=watch, group_action=replaced)
    run_steps(controller, 2, range(4), wall(1))  # rank 1 slow, one sample short of a verdict
    report(controller, 0, [record(0, 4, wall(1))])
    restart(controller)
    run_steps(controller, 2, range(5, 9), wall(1))
    assert stragglers(tmp_path) == []  # the old process's 4 samples no longer count
    run_steps(controller, 2, range(9, 10), wall(1))
    assert [e["rank"] for e in stragglers(tmp_path)] == [1]


_ENGINE = Engine(load_policy("default"), run_id="r")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 30), st.integers(0, 30), st.booleans()),
        max_size=40,
    )
)
def test_newest_step_counts_follow_every_rank(moves: list[tuple[int, int, int, bool]]) -> None:
    """The newest step the straggler check runs on (kept as counts per step) is the newest
    record's step of every rank, through rollbacks, restarts (ticks going back) and
    forgotten ranks."""
    controller = Controller(_ENGINE, world_size=4)  # the engine is not consulted here
    for rank, step, tick, forget in moves:
        if forget:
            controller.forget_rank(rank)
            continue
        assert controller.step_times is not None
        controller.step_times.add(rank, {"step": step, "tick": tick, "step_time_s": FAST_S})
        steps = controller.step_times.steps()
        assert +controller.step_times.newest_steps() == Counter(steps)
        assert max(controller.step_times.newest_steps()) == max(steps)
    assert controller.step_times is not None
    assert sum(controller.step_times.newest_steps().values()) == len(controller.step_times.steps())
