"""The goodput ledger: executions counted across rewinds and restarts, and where the time went."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from remedy.control.goodput import REWINDING_ACTIONS, UNATTRIBUTED, GoodputLedger
from remedy.rundir.journals import goodput_of

STEP_S = 0.1


def rec(step: int, tick: int, end: float, **kw: Any) -> dict[str, Any]:
    return {"step": step, "tick": tick, "rank": 0, "step_time_s": STEP_S, "loader_time_s": 0.0,
            "t_end": end, "optimizer_skipped": False, **kw}  # fmt: skip


def feed(ledger: GoodputLedger, steps: range, tick0: int, t0: float) -> tuple[int, float]:
    """Steps back to back from `t0`; returns (next tick, end time)."""
    t, tick = t0, tick0
    for s in steps:
        t += STEP_S
        ledger.record(0, rec(s, tick, t))
        tick += 1
    return tick, t


def row(summary: dict[str, Any], what: str, cause: str | None) -> dict[str, Any]:
    [r] = [r for r in summary["time_lost"] if r["what"] == what and r["cause"] == cause]
    return r


def test_a_full_restart_from_a_checkpoint_counts_the_replayed_steps_and_its_stall() -> None:
    """Steps 0-24, a rank lost at 25 (3 s stalled), every rank resumes from checkpoint 20:
    45 executions, 40 kept; the 5 discarded and the stall are lost to rank_dead."""
    g = GoodputLedger()
    _, t = feed(g, range(25), 0, 100.0)
    g.disrupted(t + 0.5, "rank_dead")
    g.expect_rewind(t + 1.0, "rank_dead")
    _, end = feed(g, range(20, 40), 20, t + 3.0)  # the new process takes the checkpoint's tick
    s = g.summary(started=99.0, ended=end + 1.0, completed=40)
    assert (s["steps_executed"], s["steps_kept"], s["goodput"]) == (45, 40, round(40 / 45, 4))
    assert row(s, "discarded_steps", "rank_dead") == {
        "what": "discarded_steps", "cause": "rank_dead", "steps": 5, "seconds": 0.5,
    }  # fmt: skip
    assert row(s, "stalled", "rank_dead")["seconds"] == pytest.approx(3.0)
    assert s["time_lost_by_cause"] == {"rank_dead": pytest.approx(3.5)}
    assert s["time_kept_s"] == pytest.approx(4.0)
    # The wall time is accounted for: kept + every row, to the rounding.
    total = s["time_kept_s"] + sum(r["seconds"] for r in s["time_lost"])
    assert total == pytest.approx(end + 1.0 - 99.0, abs=0.01)
    assert s["ettr"] == pytest.approx(4.0 / (end + 1.0 - 99.0), abs=1e-3)


def test_a_rollback_in_process_is_lost_to_its_anomaly_and_skipped_updates_to_theirs() -> None:
    """A NaN at step 12 (update skipped) rolled back to step 5: 8 steps discarded to
    nonfinite_loss; a later OOM-skipped step stays in the timeline, lost to oom."""
    g = GoodputLedger()
    tick, t = feed(g, range(12), 0, 0.0)
    g.record(0, rec(12, tick, t + STEP_S, optimizer_skipped=True))
    g.event(12, "nonfinite_loss")
    g.expect_rewind(t + 0.15, "nonfinite_loss")
    tick, t = feed(g, range(5, 20), tick + 1, t + 0.3)
    g.record(0, rec(20, tick, t + STEP_S, optimizer_skipped=True))
    g.event(20, "oom")
    s = g.summary(started=0.0, ended=t + STEP_S, completed=21)
    assert (s["steps_executed"], s["steps_kept"], s["updates_skipped"]) == (29, 20, 1)
    assert row(s, "discarded_steps", "nonfinite_loss")["steps"] == 8
    assert row(s, "skipped_updates", "oom") == {
        "what": "skipped_updates", "cause": "oom", "steps": 1, "seconds": 0.1,
    }  # fmt: skip
    assert row(s, "stalled", "nonfinite_loss")["seconds"] == pytest.approx(0.2)
    assert g.lost_by_cause() == pytest.approx({"nonfinite_loss": 1.0, "oom": 0.1})


def test_records_that_never_came_count_as_executed_and_kept() -> None:
    """The lead's process died before reporting steps 8-9; its replacement reports step 10."""
    g = GoodputLedger()
    _, t = feed(g, range(8), 0, 0.0)
    g.disrupted(t + 1.0, "rank_dead")
    feed(g, range(10, 12), 10, t + 2.0)
    s = g.summary(started=0.0, ended=t + 2.2, completed=12)
    assert (s["steps_executed"], s["steps_kept"], s["steps_unreported"]) == (12, 12, 2)
    # The two unreported steps' typical time is not counted as stalled.
    assert row(s, "stalled", "rank_dead")["seconds"] == pytest.approx(1.8)


def test_steps_a_killed_lead_never_reported_are_executed_then_discarded_by_the_restart() -> None:
    """The lead reported steps 0-27, then hung in step 33's broken collective; its ping said
    33 steps executed just before a full-group restart from checkpoint 30 killed it. Steps
    28-32 ran unreported, and 30-32 were discarded by the restart: 33 + 10 executions."""
    g = GoodputLedger()
    _, t = feed(g, range(28), 0, 100.0)
    killed = t + 1.0
    g.expect_rewind(killed, "rank_dead")
    g.expect_reach(killed, 33)
    _, end = feed(g, range(30, 40), 30, killed + 2.0)
    s = g.summary(started=100.0, ended=end, completed=40)
    assert (s["steps_executed"], s["steps_kept"], s["steps_unreported"]) == (43, 40, 5)
    assert row(s, "discarded_steps", "rank_dead")["steps"] == 3
    # The five unreported steps' typical time is not counted as stalled.
    assert row(s, "stalled", "rank_dead")["seconds"] == pytest.approx(3.0 - 5 * STEP_S)


def test_a_record_sent_before_the_restart_and_taken_after_it_counts_as_reported() -> None:
    """Step 28's record was in flight when the lead said 30 steps: it is taken as reported
    (it started before the restart), and only step 29 is filled in."""
    g = GoodputLedger()
    _, t = feed(g, range(28), 0, 0.0)
    g.expect_reach(t + 1.0, 30)
    g.record(0, rec(28, 28, t + STEP_S))
    assert (g.executed, g.unreported) == (29, 0)
    feed(g, range(30, 32), 30, t + 2.0)
    assert (g.executed, g.unreported) == (32, 1)
    # A reach below what was reported already adds nothing.
    g.expect_reach(t + 3.0, 5)
    feed(g, range(32, 33), 32, t + 4.0)
    assert (g.executed, g.unreported) == (33, 1)


def test_a_record_seen_twice_counts_once_and_a_rewind_without_a_cause_is_unattributed() -> None:
    g = GoodputLedger()
    feed(g, range(5), 0, 0.0)
    g.record(0, rec(4, 4, 0.5))  # the same record again (a batch re-sent after a restart)
    assert g.executed == 5
    g.record(0, rec(2, 5, 1.0))
    s = g.summary(started=0.0, ended=1.0, completed=3)
    assert row(s, "discarded_steps", UNATTRIBUTED)["steps"] == 3
    assert s["steps_executed"] == 6


def test_records_that_arrive_after_newer_ones_are_no_rewind() -> None:
    """A restarted supervisor gets steps 5-7 re-sent after step 8 had come: they ran before
    it, so nothing was discarded (they were counted as unreported when step 8 came)."""
    g = GoodputLedger()
    _, t = feed(g, range(5), 0, 0.0)
    g.record(0, rec(8, 8, t + 0.4))
    for s_ in range(5, 8):
        g.record(0, rec(s_, s_, t + 0.1 * (s_ - 4)))
    feed(g, range(9, 12), 9, t + 0.4)
    s = g.summary(started=0.0, ended=t + 0.8, completed=12)
    assert (s["steps_executed"], s["steps_kept"]) == (12, 12)
    assert not [r for r in s["time_lost"] if r["what"] == "discarded_steps"]
    assert g.late == 3


def test_a_replay_rewinds_the_ranks_and_its_steps_are_lost_to_the_anomaly() -> None:
    """A replay_step command comes 4 steps after a NaN at step 10: the ranks go back to the
    boundary before step 10, and the 4 steps trained meanwhile are lost to the NaN."""
    assert "replay_step" in REWINDING_ACTIONS
    g = GoodputLedger()
    _, t = feed(g, range(14), 0, 0.0)
    g.expect_rewind(t + 0.01, "nonfinite_loss")
    _, end = feed(g, range(10, 20), 14, t + 0.2)
    s = g.summary(started=0.0, ended=end, completed=20)
    assert row(s, "discarded_steps", "nonfinite_loss")["steps"] == 4


def test_other_ranks_records_do_not_count() -> None:
    g = GoodputLedger()
    g.record(1, rec(0, 0, 1.0) | {"rank": 1})
    assert g.executed == 0
    s = g.summary(started=0.0, ended=2.0, completed=3, fallback_executed=4, fallback_skipped=1)
    assert (s["steps_executed"], s["steps_kept"], s["goodput"], s["ettr"]) == (4, 2, 0.5, None)


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_replay_from_the_run_directory_matches_the_live_ledger(tmp_path: Path) -> None:
    """A restarted supervisor rebuilds the same ledger from metrics.jsonl, journal.wal and
    anomalies.jsonl: the rollback's decision time and the lost rank's detection time."""
    live = GoodputLedger()
    records: list[dict[str, Any]] = []
    t = 1000.0
    for s in range(10):
        t += STEP_S
        records.append(rec(s, s, t))
    decided = t + 0.05
    for i, s in enumerate(range(4, 10)):
        t += STEP_S + (0.5 if i == 0 else 0.0)
        records.append(rec(s, 10 + i, t))
    live.expect_rewind(decided, "loss_spike")
    for r in records:
        live.record(0, r)
    _jsonl(tmp_path / "metrics.jsonl", records)
    _jsonl(tmp_path / "journal.wal", [
        {"type": "decided", "ts": "1970-01-01T00:16:41.050000Z",  # 1001.05 s
         "decision": {"action": "rollback", "anomaly": {"kind": "loss_spike"}}},
    ])  # fmt: skip
    _jsonl(tmp_path / "anomalies.jsonl", [])
    again = goodput_of(tmp_path)
    kw = {"started": 1000.0, "ended": t, "completed": 10}
    assert again.summary(**kw) == live.summary(**kw)
    assert row(live.summary(**kw), "discarded_steps", "loss_spike")["steps"] == 6


def test_replay_counts_the_steps_a_full_restart_record_says_the_lead_executed(
    tmp_path: Path,
) -> None:
    """history.jsonl's full_restart record keeps the lead's ping (`lead_executed`): a restarted
    supervisor counts the steps it never reported as the live ledger did."""
    live = GoodputLedger()
    records = [rec(s, s, 1000.0 + STEP_S * (s + 1)) for s in range(8)]
    records += [rec(s, s, 1002.0 + STEP_S * (s - 5)) for s in range(6, 10)]
    live.expect_rewind(1001.0, "rank_hang")
    live.expect_reach(1001.0, 10)
    for r in records:
        live.record(0, r)
    _jsonl(tmp_path / "metrics.jsonl", records)
    _jsonl(tmp_path / "history.jsonl", [
        {"type": "full_restart", "ts": "1970-01-01T00:16:41Z", "cause": "rank_hang",  # 1001 s
         "lead_executed": 10},
    ])  # fmt: skip
    _jsonl(tmp_path / "anomalies.jsonl", [])
    kw = {"started": 1000.0, "ended": 1002.5, "completed": 10}
    assert goodput_of(tmp_path).summary(**kw) == live.summary(**kw)
    assert (live.executed, live.unreported) == (14, 2)
    assert row(live.summary(**kw), "discarded_steps", "rank_hang")["steps"] == 4


def test_replay_reads_a_lost_rank_from_anomalies_jsonl_stamped_in_iso(tmp_path: Path) -> None:
    """anomalies.jsonl stamps each line's `ts` as ISO 8601 (the journal's own clock): a rank
    the supervisor found lost inside a gap still makes that gap a stall of rank_hang."""
    records = [rec(0, 0, 1000.1), rec(1, 1, 1000.2), rec(2, 2, 1003.3)]
    _jsonl(tmp_path / "metrics.jsonl", records)
    _jsonl(tmp_path / "anomalies.jsonl", [
        {"kind": "rank_hang", "source": "supervisor", "step": 2, "ts": "1970-01-01T00:16:41.500000Z"},
    ])  # fmt: skip
    s = goodput_of(tmp_path).summary(started=1000.0, ended=1003.3, completed=3)
    assert row(s, "stalled", "rank_hang")["seconds"] == pytest.approx(3.0)


# ------------------------------------------------ every second to its cause


def booked(s: dict[str, Any], started: float, ended: float) -> dict[tuple[str, str | None], float]:
    """The rows of `s` by (what, cause), after checking the wall time is a partition: every row
    non-negative, and the kept time plus the rows is the wall time."""
    assert all(r["seconds"] >= 0 for r in s["time_lost"]), s["time_lost"]
    total = s["time_kept_s"] + sum(r["seconds"] for r in s["time_lost"])
    assert total == pytest.approx(ended - started, abs=0.01)
    return {(r["what"], r["cause"]): r["seconds"] for r in s["time_lost"]}


def test_a_hang_stall_is_the_hangs_from_the_last_step_including_its_detection() -> None:
    """The lead's step 20 ends at t; rank 1 hangs; found 4 s later; the group steps again 2 s
    after that: all 6 s are rank_hang's, none overhead."""
    g = GoodputLedger()
    _, t = feed(g, range(20), 0, 0.0)
    g.disrupted(t + 4.0, "rank_hang")  # the hang check names it
    g.disrupted(t + 4.01, "rank_hang")  # the restart_rank decided on it
    _, end = feed(g, range(20, 30), 20, t + 6.0)
    s = g.summary(started=0.0, ended=end, completed=30)
    rows = booked(s, 0.0, end)
    assert rows[("stalled", "rank_hang")] == pytest.approx(6.0)
    assert ("overhead", None) not in rows and ("other", None) not in rows


def test_a_killed_rank_found_before_the_leads_last_record_still_owns_the_stall() -> None:
    """rank_dead is found while the lead's failed step's record is on its way (that record
    ends after the detection): the stall after it is rank_dead's, not overhead."""
    g = GoodputLedger()
    _, t = feed(g, range(30), 0, 0.0)
    g.disrupted(t + 0.05, "rank_dead")
    g.record(0, rec(30, 30, t + 0.1))  # its step ran on to the broken collective
    _, end = feed(g, range(31, 40), 31, t + 3.1)
    rows = booked(g.summary(started=0.0, ended=end, completed=40), 0.0, end)
    assert rows[("stalled", "rank_dead")] == pytest.approx(3.0)
    assert ("overhead", None) not in rows


def test_a_full_restart_from_the_last_step_is_its_causes_though_nothing_is_rewound() -> None:
    """Every rank restarted for a lost node from a checkpoint of the lead's last step: no step
    is discarded, and the 40 s restart is node_lost's, not overhead."""
    g = GoodputLedger()
    _, t = feed(g, range(20), 0, 0.0)
    g.restarting(t + 1.0, "node_lost")
    tick, t = feed(g, range(20, 25), 20, t + 40.0)
    # The restart's rewind was not taken by any record: a later rewind is not its.
    _, end = feed(g, range(23, 25), tick, t)
    s = g.summary(started=0.0, ended=end, completed=25)
    rows = booked(s, 0.0, end)
    assert rows[("stalled", "node_lost")] == pytest.approx(40.0)
    assert row(s, "discarded_steps", UNATTRIBUTED)["steps"] == 2
    assert ("overhead", None) not in rows


def test_a_restart_rank_for_any_anomaly_owns_its_stall_live_and_replayed(tmp_path: Path) -> None:
    """A policy's restart_rank for an oom: the stall until the group steps again is oom's,
    in the live ledger and in one rebuilt from journal.wal's decided record."""
    live = GoodputLedger()
    records = [rec(s, s, 1000.0 + STEP_S * (s + 1)) for s in range(10)]
    records += [rec(s, s, 1005.0 + STEP_S * (s - 9)) for s in range(10, 15)]
    live.disrupted(1001.5, "oom")
    for r in records:
        live.record(0, r)
    _jsonl(tmp_path / "metrics.jsonl", records)
    _jsonl(tmp_path / "journal.wal", [
        {"type": "decided", "ts": "1970-01-01T00:16:41.500000Z",  # 1001.5 s
         "decision": {"action": "restart_rank", "anomaly": {"kind": "oom"}}},
    ])  # fmt: skip
    _jsonl(tmp_path / "anomalies.jsonl", [])
    kw = {"started": 1000.0, "ended": 1005.5, "completed": 15}
    assert goodput_of(tmp_path).summary(**kw) == live.summary(**kw)
    rows = booked(live.summary(**kw), 1000.0, 1005.5)
    assert rows[("stalled", "oom")] == pytest.approx(4.0)


def test_a_supervisor_outage_owns_only_a_stall_it_ends() -> None:
    """The ranks train on while the supervisor is away: no stall is booked to the outage;
    when the group waited for the supervisor to come back, that wait is supervisor_restart's."""
    g = GoodputLedger()
    _, t = feed(g, range(10), 0, 0.0)
    g.outage({"incarnation": 2, "down_since": t - 0.5, "back_at": t + 0.35, "down_s": 0.85})
    tick, t = feed(g, range(10, 20), 10, t)  # trained on through the outage
    g.outage({"incarnation": 3, "down_since": t, "back_at": t + 2.0, "down_s": 2.0})
    _, end = feed(g, range(20, 25), tick, t + 2.5)  # waited on it
    rows = booked(g.summary(started=0.0, ended=end, completed=25), 0.0, end)
    assert rows == {("stalled", "supervisor_restart"): pytest.approx(2.5)}


def test_a_rank_that_hung_while_the_supervisor_was_away_owns_the_whole_stall() -> None:
    """Rank 1 hangs after the lead's step 30; the supervisor dies, comes back 20 s later and
    finds the hang 1 s after: the 25 s stall is rank_hang's, none is the outage's."""
    g = GoodputLedger()
    _, t = feed(g, range(30), 0, 0.0)
    g.outage({"incarnation": 2, "down_since": t + 1.0, "back_at": t + 21.0, "down_s": 20.0})
    g.disrupted(t + 22.0, "rank_hang")
    _, end = feed(g, range(30, 35), 30, t + 25.0)
    s = g.summary(started=0.0, ended=end, completed=35)
    rows = booked(s, 0.0, end)
    assert rows == {("stalled", "rank_hang"): pytest.approx(25.0)}
    assert s["time_lost_by_cause"] == {"rank_hang": pytest.approx(25.0)}
    assert [o["down_s"] for o in s["supervisor_downtime"]] == [20.0]


def test_overlapping_records_and_unreported_steps_never_make_a_negative_row() -> None:
    """Records whose loader wait reaches back over the one before, and more unreported steps
    than their gap holds at the typical step time: counted once, fitted into the gap; the
    rows are non-negative and sum to the wall time with no residue."""
    g = GoodputLedger()
    _, t = feed(g, range(10), 0, 0.0)
    for s_ in range(10, 15):  # each claims 0.3 s though they end 0.1 s apart
        t += STEP_S
        g.record(0, rec(s_, s_, t, loader_time_s=0.2))
    g.expect_reach(t + 0.01, 30)  # 15 steps unreported, in a 0.2 s gap
    g.restarting(t + 0.02, "rank_dead")
    _, end = feed(g, range(30, 35), 30, t + 0.2)
    s = g.summary(started=0.0, ended=end, completed=35)
    rows = booked(s, 0.0, end)
    assert ("other", None) not in rows
    assert s["steps_unreported"] == 15
    assert s["time_kept_s"] == pytest.approx(end)


def test_the_end_of_a_run_that_waited_for_a_returning_supervisor_is_the_outages() -> None:
    """The ranks finished while the supervisor was away; the run ended when it came back 8 s
    later: those 8 s of the shutdown are supervisor_restart's, the rest the shutdown's."""
    g = GoodputLedger()
    _, t = feed(g, range(30), 0, 0.0)
    g.outage({"incarnation": 2, "down_since": t - 1.0, "back_at": t + 8.0, "down_s": 9.0})
    s = g.summary(started=0.0, ended=t + 8.5, completed=30)
    rows = booked(s, 0.0, t + 8.5)
    assert rows[("shutdown", "supervisor_restart")] == pytest.approx(8.0)
    assert rows[("shutdown", None)] == pytest.approx(0.5)
    assert s["time_lost_by_cause"] == {"supervisor_restart": pytest.approx(8.0)}


def test_a_restart_stall_ended_by_a_rollbacks_rewound_step_is_the_restarts() -> None:
    """A rollback for a loss spike is decided; rank 2 dies before it is applied, and its cold
    replacement takes 23 s; the first step after it is the rollback's rewound one: the 23 s
    are rank_dead's, the discarded steps loss_spike's."""
    g = GoodputLedger()
    _, t = feed(g, range(66), 0, 0.0)
    g.expect_rewind(t - 0.5, "loss_spike")
    g.disrupted(t + 0.2, "rank_dead")
    g.disrupted(t + 0.3, "rank_dead")  # its restart_rank
    _, end = feed(g, range(60, 90), 66, t + 23.0)
    s = g.summary(started=0.0, ended=end, completed=90)
    rows = booked(s, 0.0, end)
    assert rows[("stalled", "rank_dead")] == pytest.approx(23.0)
    assert row(s, "discarded_steps", "loss_spike")["steps"] == 6
    assert ("stalled", "loss_spike") not in rows


def test_replay_takes_only_a_lost_rank_of_the_supervisors_anomalies_as_a_stall(
    tmp_path: Path,
) -> None:
    """A straggler the supervisor found stops nothing: the gap after it stays overhead, as
    the live ledger (told only of lost ranks) books it."""
    records = [rec(0, 0, 1000.1), rec(1, 1, 1000.2), rec(2, 2, 1000.4)]
    _jsonl(tmp_path / "metrics.jsonl", records)
    _jsonl(tmp_path / "anomalies.jsonl", [
        {"kind": "straggler", "source": "supervisor", "step": 1, "ts": "1970-01-01T00:16:40.150000Z"},
    ])  # fmt: skip
    s = goodput_of(tmp_path).summary(started=1000.0, ended=1000.4, completed=3)
    assert row(s, "overhead", None)["seconds"] == pytest.approx(0.1)
    assert s["time_lost_by_cause"] == {}
