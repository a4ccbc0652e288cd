"""The pure parts of deciding once for a launched group: merged reports, restarts, resume points."""

from __future__ import annotations

from pathlib import Path

import pytest

from remedy.rank.link import group_decide, launcher
from remedy.rank.link.context import get_context


def test_merge_keeps_every_event_and_outcome_and_the_newest_header() -> None:
    """Reports kept between exchanges merge: events and outcomes all kept, metrics never."""
    held = group_decide.merge(
        None,
        {"rank": 1, "step": 3, "tick": 3, "events": [{"kind": "a"}], "outcomes": [],
         "metrics": [{"step": 2}]},
    )  # fmt: skip
    held = group_decide.merge(
        held,
        {"rank": 1, "step": 4, "tick": 4, "events": [{"kind": "b"}], "outcomes": [{"o": 1}],
         "metrics": [{"step": 3}], "ending": True},
    )  # fmt: skip
    assert (held["step"], held["tick"], held["ending"]) == (4, 4, True)
    assert held["events"] == [{"kind": "a"}, {"kind": "b"}]
    assert held["outcomes"] == [{"o": 1}]
    assert held["metrics"] == []


def test_only_rank_zero_holds_the_controller() -> None:
    """A group reporter refuses a controller on a rank other than 0, and none on rank 0."""
    with pytest.raises(ValueError, match="only rank 0"):
        group_decide.GroupReporter(None, rank=0, world_size=2, group=None)


def test_no_process_group_means_no_launched_context() -> None:
    """Without an initialised process group a process is alone: no context is made up."""
    assert launcher.detect() is None
    assert get_context() is None


@pytest.mark.parametrize(("value", "count"), [(None, 0), ("0", 0), ("2", 2), ("x", 0)])
def test_restart_count_reads_torchelastic(
    monkeypatch: pytest.MonkeyPatch, value: str | None, count: int
) -> None:
    """TORCHELASTIC_RESTART_COUNT says how often the group was restarted (junk reads as 0)."""
    if value is None:
        monkeypatch.delenv(launcher.RESTART_ENV, raising=False)
    else:
        monkeypatch.setenv(launcher.RESTART_ENV, value)
    assert launcher.restart_count() == count


def test_a_restart_resumes_at_the_newest_checkpoint_on_disk(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A restarted group asks for the newest step any rank wrote (the ranks then agree on the
    newest every rank committed); a first start, or no run directory, resumes nothing."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for name in (
        "step-00000010.rank0.json",
        "step-00000020.rank0.json",
        "step-00000010.rank1.json",
    ):
        (folder / name).write_text("{}")
    del monkeypatch
    assert launcher.resume_step(tmp_path, 0) is None
    assert launcher.resume_step(tmp_path, 1) == 20
    assert launcher.resume_step(None, 1) is None
    assert launcher.resume_step(tmp_path / "empty", 1) == 0


def test_the_start_line_says_what_only_a_supervisor_does() -> None:
    """Rank 0's one line at start names the launcher and what needs `remedy run`."""
    from remedy.rank.link.context import WorkerContext  # noqa: PLC0415

    line = launcher.start_line(WorkerContext(rank=0, world_size=4, launcher="torchrun"))
    assert "\n" not in line
    assert "4 ranks started by torchrun" in line
    assert "warm spare" in line
    assert "REMEDY_COLLECTIVE_TIMEOUT_S" in line
