"""`remedy status`, `logs`, `stop` and `attach`: a run, found by id, from any shell.

Each finds the run through `remedy.cli.run_access`, talks to its
supervisor with the run's token, and falls back on the run directory once
the run has ended. Output: `status` prints one JSON object per run; `logs`
one line per event; `attach` the live display of `remedy run`.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from remedy.cli import registry, status_table
from remedy.cli.display import decision_line, make_display
from remedy.cli.run_access import (
    AccessError,
    RunRef,
    call_failed,
    find,
    gone,
    joined,
    live_supervisor,
    supervisor_of,
)
from remedy.control.record import DELTA, STATE
from remedy.protocol.spec import NAMESPACE
from remedy.rundir.journals import read_journal

EXIT_OK, EXIT_FAILED = 0, 1
STATUS_EXIT = {"completed": 0, "aborted": 3, "failed": 1, "stopped": 4, "degraded": 5}
# How long `status` waits for a supervisor to answer.
ASK_TIMEOUT_S = 30.0
# How often `logs -f` polls.
FOLLOW_POLL_S = 0.5
RECENT_DECISIONS = 5


def _print_error(message: str) -> None:
    print(f"remedy: error: {message}", file=sys.stderr)


# ------------------------------------------------------------------ status
def status(
    run_id: str | None, address: str | None, *, every: bool = False, as_json: bool = False
) -> int:
    """One run's status as a JSON line; with no run id, this user's recent runs in a table
    (`status_table`; `every`: all of them), or one JSON line each (`as_json`)."""
    try:
        if run_id is not None:
            print(json.dumps(_status_of(find(run_id, address)), default=str))
            return EXIT_OK
        if address is not None:
            return _status_on_cluster(address)
    except AccessError as exc:
        _print_error(str(exc))
        return exc.exit_code
    entries = registry.runs()
    if not entries:
        print("remedy: no supervised runs on this machine")
        return EXIT_OK
    for entry in entries:
        entry.setdefault("started", registry.written_at(str(entry["run_id"])))
    shown = status_table.newest_first(entries, None if every else status_table.RECENT)
    rows, now = [], time.time()
    for entry in shown:
        ref = RunRef(str(entry["run_id"]), entry)
        try:
            line = _status_of(ref)
        except AccessError as exc:
            line = {"run_id": ref.run_id, "state": "unreachable", "error": str(exc)}
        if as_json:
            print(json.dumps(line, default=str))
        else:
            rows.append(status_table.row(line, entry, now))
    if not as_json:
        print(status_table.render(rows, hidden=len(entries) - len(shown)))
    return EXIT_OK


def _status_of(ref: RunRef) -> dict[str, Any]:
    ended = ref.summary()
    if ended is not None:
        return _ended_status(ref, ended)
    import ray  # noqa: PLC0415 - only for a live run

    with supervisor_of(ref) as sup:
        if sup is None:
            ended = ref.summary()  # it may have ended just now
            if ended is None:
                raise gone(ref)
            return _ended_status(ref, ended)
        try:
            live: dict[str, Any] = ray.get(sup.status.remote(ref.token), timeout=ASK_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise AccessError(silent_supervisor(ref)) from None
        except (ray.exceptions.RayError, TimeoutError) as exc:
            raise call_failed(exc, ref.run_id, "did not answer") from None
    live.pop("slots", None)
    return {**live, "run_dir": str(ref.run_dir), "address": ref.address}


def silent_supervisor(ref: RunRef) -> str:
    """One line for a live run whose supervisor does not answer: for how long, as far as the run
    directory tells (a supervisor writes its journal at least every 30 s, metrics on each report)."""
    line = f"run {ref.run_id}: supervisor not answering"
    newest = 0.0
    run_dir = ref.run_dir
    if run_dir is not None:
        for name in ("journal.wal", "history.jsonl", "metrics.jsonl"):
            with contextlib.suppress(OSError):
                newest = max(newest, (run_dir / name).stat().st_mtime)
    if newest:
        line += f" for {time.time() - newest:.0f} s (its last write to the run directory)"
    return (
        f"{line}; no answer within {ASK_TIMEOUT_S:g} s. The ranks and the driver kill a "
        "supervisor that stays silent past their bound, and Ray restarts it"
    )


def _ended_status(ref: RunRef, summary: dict[str, Any]) -> dict[str, Any]:
    ranks = [r for r in summary.get("ranks") or [] if isinstance(r, dict)]
    decisions = _journaled_decisions(ref)
    return {
        "run_id": ref.run_id,
        "state": summary.get("status"),
        "step": {str(r.get("rank")): r.get("steps_completed") for r in ranks},
        "loss": summary.get("final_loss"),
        "anomalies": summary.get("anomalies", {}),
        "actions": summary.get("actions", {}),
        "decisions": summary.get("decisions"),
        "recent_decisions": [_brief(d) for d in decisions[-RECENT_DECISIONS:]],
        "policy": summary.get("policy"),
        "stop_reason": summary.get("stop_reason"),
        "nodes": summary.get("nodes", {}),
        "wall_s": summary.get("wall_s"),
        "run_dir": str(ref.run_dir),
        "ended": True,
        **_temp_dir_left(ref),
    }


def _temp_dir_left(ref: RunRef) -> dict[str, Any]:
    """The private Ray's temporary directory of an ended run, where it is still there (its
    driver and the driver's watchdog both killed): the user's to remove."""
    temp_dir = ref.entry.get("temp_dir")
    if isinstance(temp_dir, str) and temp_dir and Path(temp_dir).is_dir():
        return {"ray_temp_dir_left": temp_dir}
    return {}


def _brief(d: dict[str, Any]) -> dict[str, Any]:
    keys = ("decision_id", "step", "rule", "action", "outcome", "reason")
    return {k: d.get(k) for k in keys}


def _journaled_decisions(ref: RunRef) -> list[dict[str, Any]]:
    """decisions.jsonl of the run, in decision order; unreadable lines skipped."""
    if ref.run_dir is None:
        return []
    try:
        out = read_journal(ref.run_dir / "decisions.jsonl")
    except OSError:
        return []
    return sorted(out, key=lambda d: str(d.get("decision_id", "")))


def _status_on_cluster(address: str) -> int:
    """Every supervised run on the cluster at `address`; those started here in full."""
    import ray  # noqa: PLC0415

    from remedy.cli.cluster import ClusterError, choose  # noqa: PLC0415

    try:
        choice = choose(address)
    except ClusterError as exc:
        raise AccessError(str(exc), 2) from None
    if choice.mode == "local":
        raise AccessError("--address local names no cluster to list; omit it", 2)
    assert choice.address is not None
    names = []
    with joined(choice.address, exit_code=2):
        for actor in ray.util.list_named_actors(all_namespaces=True):
            name = actor.get("name", "") if isinstance(actor, dict) else str(actor)
            space = actor.get("namespace", NAMESPACE) if isinstance(actor, dict) else NAMESPACE
            if name.startswith("remedy-supervisor-") and space == NAMESPACE:
                names.append(name.removeprefix("remedy-supervisor-"))
    if not names:
        print("remedy: no supervised runs on this cluster")
        return EXIT_OK
    for run_id in sorted(names):
        entry = registry.lookup(run_id)
        if entry is None:
            line = {"run_id": run_id, "state": "unknown", "note": "started on another machine"}
        else:
            try:
                line = _status_of(RunRef(run_id, entry))
            except AccessError as exc:
                line = {"run_id": run_id, "state": "unreachable", "error": str(exc)}
        print(json.dumps(line, default=str))
    return EXIT_OK


# -------------------------------------------------------------------- logs
def logs(run_id: str, *, follow: bool, address: str | None = None) -> int:
    """The run's decisions, anomalies and the ranks' output; `follow` until the run ends."""

    try:
        ref = find(run_id, address)
        if ref.summary() is not None:
            return _logs_from_run_dir(ref)
        with supervisor_of(ref) as sup:
            if sup is None:
                if ref.summary() is None:
                    raise gone(ref)
                return _logs_from_run_dir(ref)
            try:
                with _sigterm_as_interrupt():
                    _print_events(sup, ref, follow=follow)
            except KeyboardInterrupt:
                print(f"remedy: stopped following run {run_id}; it goes on", flush=True)
                return EXIT_OK
    except AccessError as exc:
        _print_error(str(exc))
        return exc.exit_code
    if follow:
        summary = ref.summary()
        print(f"remedy: run {run_id} ended: {(summary or {}).get('status', 'unknown')}")
    return EXIT_OK


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM stops a `logs -f` like Ctrl-C. Set once connected: Ray's own handler, which
    prints its C++ stack, is installed when the driver connects."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals be
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _print_events(sup: Any, ref: RunRef, *, follow: bool) -> None:
    """The live feed's lines; with `follow`, until the run ends."""
    import ray  # noqa: PLC0415

    run_id = ref.run_id
    cursor = 0
    while True:
        try:
            events, cursor = ray.get(sup.events.remote(cursor, ref.token), timeout=ASK_TIMEOUT_S)
            ended = ray.get(sup.wait.remote(0), timeout=ASK_TIMEOUT_S) if follow else None
        except (ray.exceptions.RayError, TimeoutError) as exc:
            if follow and ref.summary() is not None:
                break  # it ended and went away between two polls
            raise call_failed(exc, run_id, "did not answer") from None
        for event in events:
            line = log_line(event)
            if line is not None:
                print(line, flush=True)
        if not follow or ended is not None:
            break
        time.sleep(FOLLOW_POLL_S)


def log_line(event: dict[str, Any]) -> str | None:
    """One line for one feed event; None for progress snapshots."""
    kind = event.get("event")
    if kind == "output":
        return f"[rank {event.get('rank')}] {event.get('line', '')}"
    if kind == "decision":
        return "remedy: " + decision_line(event)
    if kind == "anomaly":
        value = f" value {event['value']}" if event.get("value") is not None else ""
        return (
            f"anomaly: {event.get('kind')} on rank {event.get('rank')} "
            f"at step {event.get('step')}{value}"
        )
    if kind == "missed":
        return f"remedy: ({event.get('count')} earlier events no longer kept)"
    return None


def journal_line(record: dict[str, Any]) -> str:
    """One line for a history record: when, what, and its reason or its fields."""
    skip = {"run_id", "event", "ts", "type", "from", "to", "reason"}
    said = record.get("reason") or ", ".join(
        f"{k}={json.dumps(v, default=str)[:120]}" for k, v in record.items() if k not in skip
    )
    return f"journal: {record.get('ts', '')} {record.get('type')}: {said}"


def _logs_from_run_dir(ref: RunRef) -> int:
    """An ended run, from its run directory: the ranks' output, the anomalies, the decisions
    and what happened to the job, one readable line each, in time order."""
    assert ref.run_dir is not None
    entries: list[tuple[float, int, str]] = []

    def add(ts: Any, text: str | None) -> None:
        if text is not None:
            entries.append((_epoch(ts), len(entries), text))

    # The history; a run of remedy before state schema 8 kept it in journal.wal.
    for name in ("journal.wal", "history.jsonl"):
        for record in _jsonl(ref.run_dir / name):
            add(record.get("ts"), history_line(record))
    anomalies = _jsonl(ref.run_dir / "anomalies.jsonl")
    for a in anomalies:  # placed when its rank saw it, not when the supervisor wrote it
        add(a.get("detected_at", a.get("ts")), log_line({**a, "event": "anomaly"}))
    decisions = _journaled_decisions(ref)
    for d in decisions:
        add(d.get("ts"), "remedy: " + decision_line(d))
    output = _jsonl(ref.run_dir / "output.jsonl")
    for o in output:
        add(o.get("ts"), log_line({**o, "event": "output"}))
    for _, _, text in sorted(entries):
        print(text)
    summary = ref.summary() or {}
    kinds = Counter(str(a.get("kind")) for a in anomalies)
    seen = ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())) or "none"
    print(
        f"remedy: run {ref.run_id} ended: {summary.get('status', 'unknown')} "
        f"(anomalies: {seen}; {len(decisions)} decision(s))"
    )
    if not output:
        print(f"remedy: no output of the ranks was kept in {ref.run_dir / 'output.jsonl'}")
    return EXIT_OK


def _jsonl(path: Path) -> list[dict[str, Any]]:
    """The whole JSON objects of a JSON-lines file; torn or foreign lines skipped, unreadable: none."""
    try:
        return read_journal(path)
    except OSError:
        return []


def _epoch(ts: Any) -> float:
    """Seconds since the epoch of a record's `ts` (a number, or ISO 8601 as the journals
    write it); 0 for none, so undated lines come first."""
    if isinstance(ts, (int, float)) and not isinstance(ts, bool) and math.isfinite(ts):
        return float(ts)
    if isinstance(ts, str):
        with contextlib.suppress(ValueError):
            return datetime.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
    return 0.0


def history_line(record: dict[str, Any]) -> str | None:
    """A readable line for a history.jsonl record (or an older run's journal.wal record);
    None for the bookkeeping ones (state records, full or delta, and the decisions, which
    decisions.jsonl gives in full)."""
    kind = record.get("type")
    if kind in ("decided", "resolved", STATE, DELTA):
        return None
    if kind == "supervisor_started":
        n = record.get("incarnation")
        again = f" (restart {int(n) - 1})" if isinstance(n, int) and n > 1 else ""
        return f"remedy: supervisor started{again}, policy {record.get('policy', '?')}"
    if kind == "job_state":
        to = record["to"] if isinstance(record.get("to"), dict) else {}
        return f"remedy: job {to.get('phase', '?')}: {record.get('reason', '')}"
    if kind == "ranks_ended":
        results = record["results"] if isinstance(record.get("results"), dict) else {}
        said = "; ".join(
            f"rank {r}: {x.get('status')} at step {x.get('steps_completed')}"
            for r, x in results.items()
            if isinstance(x, dict)
        )
        return f"remedy: ranks ended: {said or 'none'}"
    if kind == "run_ended":
        return f"remedy: run ended: {record.get('status')}"
    return journal_line(record)


# -------------------------------------------------------------------- stop
def stop(run_id: str, *, address: str | None, timeout_s: float, reason: str) -> int:
    """Final checkpoint on every rank, then a clean end (status `stopped`); waits for the end."""
    import ray  # noqa: PLC0415

    try:
        ref = find(run_id, address)
        with live_supervisor(ref) as sup:
            try:
                answer = ray.get(sup.stop.remote(ref.token, reason), timeout=ASK_TIMEOUT_S)
                if not answer.get("stopping"):
                    print(f"remedy: run {run_id} is already ending ({answer.get('state')})")
                print(f"remedy: stopping run {run_id}: final checkpoint, then a clean end")
                summary = ray.get(sup.wait.remote(timeout_s), timeout=timeout_s + ASK_TIMEOUT_S)
            except (ray.exceptions.RayError, TimeoutError) as exc:
                summary = ref.summary()
                if summary is None:
                    raise call_failed(exc, run_id, "did not answer") from None
    except AccessError as exc:
        _print_error(str(exc))
        return exc.exit_code
    if summary is None:
        _print_error(f"run {run_id} has not ended within {timeout_s:g} s; it is still stopping")
        return EXIT_FAILED
    registry.update(run_id, state=summary.get("status"))
    print(
        f"remedy: run {run_id} {summary.get('status')} at step {summary.get('steps_completed')}; "
        f"summary in {ref.run_dir}/summary.json"
    )
    return EXIT_OK


# ------------------------------------------------------------------ attach
def attach(run_id: str, *, quiet: bool, address: str | None = None) -> int:
    """The live display of a run; Ctrl-C detaches and leaves the run going."""
    import ray  # noqa: PLC0415

    from remedy.cli.runner import follow, format_summary  # noqa: PLC0415

    try:
        ref = find(run_id, address)
        summary = ref.summary()
        if summary is None:
            with supervisor_of(ref) as sup:
                if sup is None and ref.summary() is None:
                    raise gone(ref)
                if sup is not None:
                    print(f"remedy: attached to run {run_id} (Ctrl-C detaches)", file=sys.stderr)
                    display = make_display(quiet=quiet)
                    try:
                        summary = follow(sup, ref.token, display=display)
                    except KeyboardInterrupt:
                        display.close(
                            {"run_id": run_id, "status": "detached"},
                            f"remedy: detached from run {run_id}; it goes on",
                        )
                        print(f"remedy: detached; the run goes on (`remedy attach {run_id}`)",
                              file=sys.stderr)  # fmt: skip
                        return EXIT_OK
                    except (ray.exceptions.RayError, TimeoutError) as exc:
                        summary = ref.summary()
                        if summary is None:
                            raise call_failed(exc, run_id, "went away") from None
                    display.close(summary, format_summary(summary, _journaled_decisions(ref)))
                    return STATUS_EXIT.get(str(summary.get("status")), EXIT_FAILED)
            summary = ref.summary()
    except AccessError as exc:
        _print_error(str(exc))
        return exc.exit_code
    assert summary is not None
    print(format_summary(summary, _journaled_decisions(ref)))
    return STATUS_EXIT.get(str(summary.get("status")), EXIT_FAILED)
