"""The private Ray's logs kept in a run directory (`rundir.ray_logs`): the telling files first,
the tail of each, a total cap, an index; kept only for a run that failed or lost a supervisor."""

from __future__ import annotations

import json
from pathlib import Path

from remedy.report.deaths import death_lines
from remedy.rundir.ray_logs import keep_logs, read_index, survey, wants_logs


def _session(temp: Path) -> Path:
    """A private Ray's logs folder as Ray 2.60 lays it out: a supervisor, a rank, an idle
    worker, the raylet and the GCS."""
    logs = temp / "session_2026-12-07_19-37-02_1_881" / "logs"
    logs.mkdir(parents=True)
    (temp / "session_latest").symlink_to(logs.parent)
    for wid, pid, actor, err in (
        ("aa11", 1459, "SupervisorActor", "Traceback: supervisor boom\n"),
        ("bb22", 1460, "RankActor", "rank 0 says hello\n" * 50),
        ("cc33", 1500, None, ""),
    ):
        head = ":job_id:01000000\n" + (f":actor_name:{actor}\n" if actor else "")
        (logs / f"worker-{wid}-01000000-{pid}.out").write_text(head)
        (logs / f"worker-{wid}-01000000-{pid}.err").write_text(head + err)
        (logs / f"python-core-worker-{wid}_{pid}.log").write_text(f"core worker {pid}\n")
    (logs / "raylet.out").write_text("raylet: worker 1459 died\n")
    (logs / "raylet.err").write_text("")
    (logs / "gcs_server.out").write_text("gcs\n")
    (logs / "dashboard_agent.log").write_text("not kept\n")
    return logs


def test_the_supervisors_logs_come_first_then_the_ranks_then_rays(tmp_path: Path) -> None:
    """survey orders by role (Ray's `:actor_name:` line says which) and skips empty files."""
    logs = _session(tmp_path / "temp")
    found = survey(logs)
    roles = [f.role for f in found]
    assert roles == sorted(roles, key=("supervisor", "rank", "ray", "node_agent", "worker").index)
    by_name = {f.name: f for f in found}
    assert by_name["python-core-worker-aa11_1459.log"].role == "supervisor"
    assert by_name["worker-bb22-01000000-1460.err"].role == "rank"
    assert by_name["worker-cc33-01000000-1500.out"].role == "worker"
    assert "raylet.err" not in by_name and "dashboard_agent.log" not in by_name


def test_each_file_keeps_its_tail_and_says_what_was_cut(tmp_path: Path) -> None:
    """A file longer than the per-file bound keeps its last bytes, with a first line saying so."""
    _session(tmp_path / "temp")
    dest = keep_logs(tmp_path / "temp", tmp_path / "run", per_file=100)
    assert dest == tmp_path / "run" / "logs"
    text = (dest / "worker-bb22-01000000-1460.err").read_text()
    first, _, rest = text.partition("\n")
    assert first.startswith("[remedy: the first ") and first.endswith(" left out]"), first
    assert len(rest) == 100 and rest.endswith("rank 0 says hello\n")
    assert (dest / "worker-aa11-01000000-1459.err").read_text().endswith("supervisor boom\n")
    index = {f["name"]: f for f in read_index(tmp_path / "run")}
    assert index["worker-bb22-01000000-1460.err"]["kept"] == 100
    assert index["worker-bb22-01000000-1460.err"]["size"] > 100


def test_the_total_cap_leaves_the_least_telling_out_and_names_them(tmp_path: Path) -> None:
    """A file that no longer fits the total cap is not copied (the supervisor's, first, are); the
    index names it and why."""
    _session(tmp_path / "temp")
    keep_logs(tmp_path / "temp", tmp_path / "run", per_file=1000, total=250)
    index = read_index(tmp_path / "run")
    kept = [f for f in index if f["kept"]]
    left = [f for f in index if f["left_out"]]
    assert {f["name"] for f in index if f["role"] == "supervisor"} <= {f["name"] for f in kept}
    assert "worker-bb22-01000000-1460.err" in [f["name"] for f in left], left  # 900 bytes
    assert sum(f["kept"] for f in kept) <= 250
    for f in left:
        assert "over the 250 bytes" in f["left_out"]
        assert not (tmp_path / "run" / "logs" / f["name"]).exists()


def test_nothing_is_kept_where_there_are_no_logs(tmp_path: Path) -> None:
    """A temp dir without a session (or gone): no logs folder."""
    (tmp_path / "temp").mkdir()
    assert keep_logs(tmp_path / "temp", tmp_path / "run") is None
    assert keep_logs(tmp_path / "absent", tmp_path / "run") is None
    assert not (tmp_path / "run" / "logs").exists()


def test_logs_are_wanted_for_a_failure_or_a_supervisor_death(tmp_path: Path) -> None:
    """wants_logs: a failed run, one with no summary, one whose supervisor died; not a clean one."""
    run = tmp_path / "run"
    run.mkdir()
    assert wants_logs(run)  # no summary: it ended before writing one
    (run / "summary.json").write_text(json.dumps({"status": "failed"}))
    assert wants_logs(run)
    (run / "summary.json").write_text(json.dumps({"status": "completed"}))
    (run / "history.jsonl").write_text(json.dumps({"type": "supervisor_started"}) + "\n")
    assert not wants_logs(run)
    with (run / "history.jsonl").open("a") as f:
        f.write(json.dumps({"type": "supervisor_died", "incarnation": 1}) + "\n")
    assert wants_logs(run)


def test_explain_names_each_supervisor_death_and_its_kept_logs(tmp_path: Path) -> None:
    """death_lines: the reason of each death, the dead supervisor's own kept files, the folder."""
    _session(tmp_path / "temp")
    run = tmp_path / "run"
    keep_logs(tmp_path / "temp", run)
    died = {"type": "supervisor_died", "incarnation": 1, "pid": 1459, "cause": "signal",
            "reason": "pid 1459 ended without exiting: killed by a signal (SIGKILL) or a crash"}  # fmt: skip
    older = {"type": "supervisor_died", "incarnation": 2, "pid": 7, "exit_type": "SYSTEM_ERROR",
             "exit_detail": "Worker unexpectedly exits"}  # fmt: skip
    (run / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (died, older)))
    first, second, folder = death_lines(run)
    assert first.startswith("supervisor 1 (pid 1459) died: pid 1459 ended without exiting")
    assert "logs/worker-aa11-01000000-1459.err" in first
    assert second == "supervisor 2 (pid 7) died: Ray says SYSTEM_ERROR: Worker unexpectedly exits"
    assert folder.startswith(f"Ray logs of the run kept in {run / 'logs'}")
