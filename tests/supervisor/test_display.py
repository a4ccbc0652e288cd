"""`remedy run` shows decisions and the ranks' own output live on a terminal, and JSON lines elsewhere."""

from __future__ import annotations

import io
import json
import math
import os
import re
import sys
import threading
from pathlib import Path

import pytest

from remedy.cli.display import JsonLinesDisplay, LiveDisplay, make_display
from remedy.cli.main import main
from remedy.rundir.writer import read_jsonl
from remedy.supervisor.feed import Feed
from tests.supervisor.runs import TARGET

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")


def chaos_file(tmp_path: Path) -> Path:
    path = tmp_path / "chaos.yaml"
    path.write_text("faults:\n  - {kind: nan_loss, at_step: 30, rank: 0}\n")
    return path


def run_args(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "run",
        TARGET,
        "--chaos",
        str(chaos_file(tmp_path)),
        "--run-dir",
        str(tmp_path / "run"),
        *extra,
        "--",
        "--steps",
        "60",
    ]


def test_live_display_on_a_terminal_shows_decisions_and_user_output(
    ray_cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a pseudo-terminal: the user's prints prefixed by rank, one line per decision, the summary."""
    master, slave = os.openpty()
    terminal = open(slave, "w", encoding="utf-8", buffering=1, closefd=True)  # noqa: SIM115
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # the terminal's other end closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    monkeypatch.setattr(sys, "stdout", terminal)
    probe = make_display()
    assert isinstance(probe, LiveDisplay), "a terminal gets the live display"
    probe.close({}, "")
    code = main(run_args(tmp_path))
    monkeypatch.undo()
    terminal.close()
    reader.join(timeout=10)
    os.close(master)
    screen = ANSI.sub("", b"".join(chunks).decode("utf-8", "replace"))
    assert code == 0
    assert "[rank 0] user: training starts" in screen, "stderr of the rank reaches the terminal"
    assert "[rank 0] user: step 10 loss" in screen, "stdout of the rank reaches the terminal"
    decisions = read_jsonl(tmp_path / "run" / "decisions.jsonl")
    assert {d["action"] for d in decisions} >= {"rollback", "shrink_lr"}
    for d in decisions:
        assert f"step {d['step']}: {d['rule']} -> {d['action']} [{d['outcome']}]" in screen
    assert "step" in screen and "/60" in screen, "the progress bar shows step / total"
    assert "report: " in screen and (tmp_path / "run" / "report.html").is_file()


def test_plain_mode_emits_one_json_object_per_line(
    ray_cluster: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without a terminal (or with --quiet) every stdout line is JSON: output, decisions, report, summary."""
    code = main(run_args(tmp_path, "--quiet"))
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    events = [json.loads(line) for line in lines]  # every line parses
    kinds = [e["event"] for e in events]
    assert kinds[-2:] == ["report", "summary"] and events[-1]["status"] == "completed"
    said = [e["line"] for e in events if e["event"] == "output" and e["rank"] == 0]
    assert "user: training starts" in said and any(s.startswith("user: step 50") for s in said)
    journal = read_jsonl(tmp_path / "run" / "decisions.jsonl")
    shown = [e for e in events if e["event"] == "decision"]
    assert sorted(e["decision_id"] for e in shown) == sorted(d["decision_id"] for d in journal)
    assert any(e["event"] == "anomaly" and e["kind"] == "nonfinite_loss" for e in events)
    assert any(e["event"] == "progress" for e in events)


def test_feed_progress_reports_total_rate_and_rank_state() -> None:
    """The feed turns report batches into progress: step/total, samples per second, ETA, rank state."""
    now = [0.0]
    feed = Feed(world_size=2, clock=lambda: now[0])
    for tick in range(0, 30, 10):
        now[0] = float(tick)  # one executed step per second
        feed.observe({"rank": 0, "step": tick, "tick": tick, "max_steps": 100, "batch_size": 8,
                      "metrics": [{"loss": 1.5, "lr": 0.1}], "events": []})  # fmt: skip
    events, cursor = feed.since(0, {"step": {0: 20}, "state": "running"})
    progress = events[-1]
    assert progress["total"] == 100 and progress["steps_per_s"] == 1.0
    assert progress["samples_per_s"] == 16.0 and progress["eta_s"] == 80.0
    assert progress["ranks"] == {"0": "training", "1": "starting"}
    feed.output([{"rank": 1, "stream": "stdout", "line": "hi"}])
    later, _ = feed.since(cursor, {"step": {0: 20}})
    assert later[0] == {
        "seq": cursor, "event": "output", "rank": 1, "stream": "stdout", "line": "hi", "ts": 20.0
    }  # fmt: skip


def test_feed_orders_events_by_when_they_happened() -> None:
    """A line printed before a decision is shown before it, though it reached the feed after."""
    now = [100.0]
    feed = Feed(world_size=1, clock=lambda: now[0])
    feed.decisions([{"decision_id": "d1", "action": "rollback"}])
    now[0] = 100.3
    feed.output([{"rank": 0, "stream": "stdout", "line": "step 150", "ts": 99.9}])
    events, _ = feed.since(0, {"step": {}})
    assert [e["event"] for e in events] == ["output", "decision", "progress"]


def test_json_lines_display_throttles_progress_only() -> None:
    """Progress is emitted at most every few seconds; output and decisions always."""
    out = io.StringIO()
    display = JsonLinesDisplay(out)
    for _ in range(3):
        display.handle({"event": "progress", "step": 1})
        display.handle({"event": "output", "rank": 0, "stream": "stdout", "line": "x", "seq": 1})
    kinds = [json.loads(line)["event"] for line in out.getvalue().splitlines()]
    assert kinds == ["progress", "output", "output", "output"]


def test_feed_keeps_its_own_keys_and_ignores_numbers_no_display_can_use() -> None:
    """An event's `seq`/`event` keys, a step total or batch size no float holds, and a rank
    outside the world change nothing a poller gets; `since` still answers."""
    now = [0.0]
    feed = Feed(world_size=1, clock=lambda: now[0])
    for tick in (0, 10):
        now[0] = float(tick)
        feed.observe({"rank": 0, "step": tick, "tick": tick, "max_steps": 10**400,
                      "batch_size": 2**80, "metrics": [], "events": []})  # fmt: skip
    feed.observe({"rank": 5, "step": 1, "tick": 1, "max_steps": 7})
    feed.observe({"rank": True, "step": 1, "tick": 1, "max_steps": 7})
    feed.output([{"rank": 0, "line": "x", "seq": "abc", "event": "decision", "ts": math.nan}])
    events, cursor = feed.since(0, {"step": {0: 10}})
    assert [(e["event"], e["seq"]) for e in events[:-1]] == [("output", 0)] and cursor == 1
    assert events[0]["ts"] == 10.0
    assert events[-1]["total"] is None and events[-1]["samples_per_s"] is None
    assert 5 not in feed.last_seen and feed.total is None


def test_the_ranks_line_counts_the_ranks_of_a_large_run_and_names_the_odd_ones() -> None:
    """Up to 16 ranks each is named; beyond, the line counts each state and names the ranks
    not in the most common one, so 4,096 ranks fit on one line."""
    from remedy.cli.display import ranks_line  # noqa: PLC0415

    few = {"ranks": {"0": "training", "1": "starting"}}
    assert ranks_line(few) == "ranks: 0:training  1:starting"
    many = {str(r): "training" for r in range(4096)}
    many["7"], many["300"] = "quiet 12s", "quiet 9s"
    many["9"] = "recovering"
    assert ranks_line({"ranks": many}) == (
        "ranks: 4,093 training; 2 quiet; 1 recovering (7:quiet 12s, 9:recovering, 300:quiet 9s)"
    )
    lost = {str(r): ("lost" if r < 20 else "training") for r in range(100)}
    line = ranks_line({"ranks": lost})
    assert line.startswith("ranks: 80 training; 20 lost (0:lost, 1:lost,")
    assert line.endswith("15:lost, +4 more)")
