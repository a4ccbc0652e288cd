"""The watch on the supervisor's answers (`supervisor.liveness`), without Ray: bounds, the kill,
the outage notes and how the supervisor merges them."""

from __future__ import annotations

import subprocess
import time

import psutil
import pytest

from remedy.rank.link import liveness
from remedy.rank.link.liveness import Identity, SilenceWatch, merge_outages, valid_note


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_the_bound_comes_from_the_heartbeat_unless_given() -> None:
    assert liveness.silence_bound(0.5) == 10.0  # the floor: 20 heartbeats are 10 s
    assert liveness.silence_bound(2.0) == 40.0
    assert liveness.silence_bound(0.5, configured=3.0) == 3.0


def test_a_silence_past_the_bound_is_killed_once_then_noted_when_answers_come_back() -> None:
    clock = Clock()
    watch = SilenceWatch("rank 1", bound_s=10.0, clock=clock)
    assert watch.check(None) is None  # nothing outstanding: nothing to judge
    clock.t = 1009.9
    assert watch.check(1000.0) is None
    clock.t = 1010.0
    assert watch.check(1000.0) == "kill"
    watch.killed("killed its process (pid 7, SIGKILL)")
    clock.t = 1015.0
    assert watch.check(1000.0) is None  # killed already: waiting for Ray's restart
    clock.t = 1020.0
    watch.answered(1000.0)
    (note,) = watch.take_notes()
    assert note == {
        "began": 1000.0, "noticed": 1010.0, "noticed_by": "rank 1", "killed": 1010.0,
        "how": "killed its process (pid 7, SIGKILL)", "ended": 1020.0, "duration_s": 20.0,
        "silent": "supervisor",
    }  # fmt: skip
    assert watch.take_notes() == [] and watch.outage is None


def test_a_supervisor_not_back_after_its_kill_is_given_up_with_a_sentence() -> None:
    clock = Clock()
    watch = SilenceWatch("driver", bound_s=10.0, restart_s=120.0, clock=clock)
    clock.t = 1010.0
    assert watch.check(1000.0) == "kill"
    watch.killed("killed its process (pid 7, SIGKILL)")
    clock.t = 1129.0
    assert watch.check(1000.0) is None
    clock.t = 1130.0
    assert watch.check(1000.0) == "give_up"
    assert watch.gave_up is not None and "not restarted within 120 s of its kill" in watch.gave_up
    assert watch.check(1000.0) is None  # said once


def test_a_failed_kill_counts_the_restart_bound_from_the_notice() -> None:
    """A process already gone (someone else killed it, or Ray lost it): no kill time to count from."""
    clock = Clock()
    watch = SilenceWatch("rank 0", bound_s=10.0, restart_s=60.0, clock=clock)
    clock.t = 1010.0
    assert watch.check(1000.0) == "kill"
    watch.killed("pid 7 had already ended")
    assert watch.outage is not None and watch.outage.killed is None
    clock.t = 1070.0
    assert watch.check(1000.0) == "give_up"


@pytest.mark.parametrize(("silent_s", "noted"), [(1.0, False), (2.5, True)])
def test_a_short_silence_is_noted_only_past_note_s(silent_s: float, noted: bool) -> None:
    clock = Clock()
    watch = SilenceWatch("rank 0", bound_s=10.0, clock=clock)
    clock.t = 1000.0 + silent_s
    assert watch.check(1000.0) is None
    watch.answered(1000.0)
    notes = watch.take_notes()
    assert bool(notes) is noted
    if noted:
        assert notes[0]["how"] == "answered again on its own"
        assert notes[0]["duration_s"] == silent_s


def test_a_silence_is_noted_as_seen_up_to_the_last_look_not_the_late_one() -> None:
    """A caller that did not look for a while gives its previous look as `at`: the silence it
    saw (sent at 1000, still unanswered at 1001.5) is not an outage; one still missing at 1003
    is, and lasts until then."""
    clock = Clock()
    watch = SilenceWatch("rank 0", bound_s=10.0, clock=clock)
    clock.t = 1006.0
    watch.answered(1000.0, at=1001.5)
    assert watch.take_notes() == []
    watch.answered(1000.0, at=1003.0)
    (note,) = watch.take_notes()
    assert note["duration_s"] == 3.0 and note["ended"] == 1003.0


@pytest.fixture
def stopped_process() -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(["sleep", "60"])
    proc.send_signal(19)  # SIGSTOP: alive, answering nothing, as a hung supervisor
    yield proc
    proc.kill()
    proc.wait(timeout=10)


def test_kill_ends_the_stopped_process_it_was_told_about(
    stopped_process: subprocess.Popen[bytes],
) -> None:
    ident = Identity("here", stopped_process.pid, psutil.Process(stopped_process.pid).create_time())
    how = liveness.kill(ident, None, here="here", may_ray_kill=False)
    assert how == f"killed its process (pid {stopped_process.pid}, SIGKILL)"
    assert stopped_process.wait(timeout=10) == -9
    again = liveness.kill(ident, None, here="here", may_ray_kill=False)
    assert again == f"pid {stopped_process.pid} had already ended"


def test_kill_spares_another_process_with_the_same_pid(
    stopped_process: subprocess.Popen[bytes],
) -> None:
    """The pid was reused (the supervisor restarted): its start time differs, so it lives."""
    created = psutil.Process(stopped_process.pid).create_time()
    ident = Identity("here", stopped_process.pid, created - 5.0)
    how = liveness.kill(ident, None, here="here", may_ray_kill=False)
    assert "is another process now" in how
    time.sleep(0.1)
    assert stopped_process.poll() is None


def test_kill_on_another_node_is_left_to_the_driver_and_rank_0() -> None:
    how = liveness.kill(Identity("other", 1, 0.0), None, here="here", may_ray_kill=False)
    assert how.startswith("left to the driver and rank 0")


def _note(began: float, ended: float, by: str, killed: float | None = None) -> dict[str, object]:
    how = "killed its process (pid 7, SIGKILL)" if killed else "pid 7 had already ended"
    return {"began": began, "noticed": began + 10, "noticed_by": by, "killed": killed,
            "how": how, "ended": ended, "duration_s": ended - began}  # fmt: skip


def test_notes_of_one_outage_from_several_watchers_merge_into_one() -> None:
    notes = [
        _note(1000.0, 1020.0, "rank 0"),
        _note(1000.5, 1021.0, "rank 1", killed=1010.5),
        _note(999.8, 1022.0, "driver"),
        _note(2000.0, 2003.0, "rank 0") | {"how": "answered again on its own", "noticed": 2003.0},
    ]
    first, second = merge_outages(notes)
    assert first["began"] == 999.8 and first["ended"] == 1022.0
    assert first["duration_s"] == pytest.approx(22.2)
    assert sorted(first["noticed_by"]) == ["driver", "rank 0", "rank 1"]
    assert first["how"] == "killed its process (pid 7, SIGKILL) by rank 1"
    assert second["how"] == "answered again on its own" and second["noticed_by"] == ["rank 0"]


@pytest.mark.parametrize(
    "bad",
    [
        None,
        [],
        {"began": 1.0},
        _note(1000.0, 1020.0, "rank 0") | {"began": float("nan")},
        _note(1000.0, 1020.0, "rank 0") | {"began": True},
        _note(1000.0, 1020.0, "rank 0") | {"how": "x" * 201},
        _note(1000.0, 1020.0, "rank 0") | {"noticed": 10.0},  # noticed before it began
        _note(1000.0, 1020.0, "rank 0") | {"noticed_by": 3},
    ],
)
def test_a_malformed_note_is_refused(bad: object) -> None:
    assert valid_note(bad) is None


def test_a_good_note_is_kept_as_plain_data() -> None:
    note = _note(1000.0, 1020.0, "rank 0")
    assert valid_note(note) == {**note, "duration_s": 20.0, "silent": "supervisor"}
    assert valid_note(note | {"silent": "agent"})["silent"] == "agent"  # type: ignore[index]
    assert valid_note(note | {"silent": "the moon"}) is None


def test_a_ranks_watch_on_its_agent_notes_the_agents_silence_not_the_supervisors() -> None:
    """Under node agents a rank's reports go to its agent: a silence of the agent (killed and
    restarted by Ray) is the agent's in its note and in what the supervisor merges, and a
    supervisor outage at the same time stays the supervisor's alone."""
    clock = Clock()
    watch = SilenceWatch("rank 3", bound_s=10.0, clock=clock, silent="agent")
    clock.t = 1004.0
    watch.answered(1000.0)  # 4 s without an answer: noted
    (note,) = watch.take_notes()
    assert note["silent"] == "agent" and valid_note(note) is not None
    notes = [note, _note(1001.0, 1006.0, "driver")]
    (agents,) = merge_outages(notes, silent="agent")
    (supervisor,) = merge_outages(notes)
    assert agents["noticed_by"] == ["rank 3"] and agents["duration_s"] == 4.0
    assert supervisor["noticed_by"] == ["driver"] and supervisor["duration_s"] == 5.0
    clock.t = 1100.0
    assert watch.check(1050.0) == "kill"
    clock.t = 1300.0
    assert watch.check(1050.0) == "give_up"
    assert watch.gave_up is not None and watch.gave_up.startswith("the node agent has not answered")


def test_status_says_how_long_a_silent_supervisor_has_not_written(tmp_path: object) -> None:
    """`remedy status` of a run whose supervisor does not answer: for how long, from its run dir."""
    import os  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from remedy.cli.run_access import RunRef  # noqa: PLC0415
    from remedy.cli.run_commands import silent_supervisor  # noqa: PLC0415

    run_dir = Path(str(tmp_path))
    (run_dir / "journal.wal").write_text("{}\n")
    old = time.time() - 42
    os.utime(run_dir / "journal.wal", (old, old))
    line = silent_supervisor(RunRef("r1", {"run_dir": str(run_dir)}))
    assert line.startswith("run r1: supervisor not answering for 42 s (its last write")
    assert silent_supervisor(RunRef("r2", {})).startswith("run r2: supervisor not answering; ")
