"""What a supervisor crash costs: the restart's outage, and the state records that make it safe.

Two measures, in one process:

1. The state record (`Controller.state_dict` written to journal.wal with an
   fsync), which the supervisor writes before any reply that carries a new
   command: its size and time, for a controller holding a pending NaN
   rollback chain (2 commands) and `C` closed decision ids.
2. A real run (tests/supervisor/daemon_train.py, 2 gloo ranks) with the
   `kill_supervisor` fault at step 150 and a NaN at step 200, and the same
   run without the kill: the outage (the kill marker's time to the restarted
   supervisor's `supervisor_restored` record), the time from that record to
   the control loop running again (`supervisor_started`), the wall
   time of each run, and whether both took the same decisions.

3. With `--hang`, the supervisor SIGSTOPped for good instead of killed, once
   at step 150 (the NaN at 200 still to come) and once 20 steps before the
   end: who found it silent and after how long, the outage until it
   answered again, whether the decisions are those of the clean run, and
   the time from the ranks' last step to the run's end (for the second,
   stopped 20 steps before the end, the ranks finish while it is away).

    python benchmarks/supervisor_restart.py [--workers 2] [--steps 260] [--records-only]
        [--hang [--supervisor-timeout S]]

A state record keeps the newest `control_state.MAX_CLOSED_KEPT` closed ids.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._smoke import add_check_imports, check_imports  # noqa: E402
from remedy.cli.runner import run_supervised  # noqa: E402
from remedy.control.decide import Controller  # noqa: E402
from remedy.policies import AnomalyEvent, Engine, load_policy  # noqa: E402
from remedy.protocol.spec import NAMESPACE, RunSpec, supervisor_name  # noqa: E402
from remedy.rundir.journal_effects import write_journal  # noqa: E402
from remedy.rundir.writer import RunDir, read_jsonl  # noqa: E402

TARGET = f"{REPO / 'tests' / 'supervisor' / 'daemon_train.py'}:main"


def state_record_cost(pending: bool, closed: int, repeats: int = 50) -> tuple[int, float]:
    """(bytes, median seconds) of one state record for a controller of that size."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = RunDir(tmp, "bench")
        c = Controller(
            Engine(load_policy("default"), run_id="bench"),
            world_size=8,
        )
        # Closed ids as a long run leaves them; pending rollbacks as a busy one holds them.
        for i in range(closed):
            c._closed.add(f"bench-d{i:05d}")
            c._recent_closed.append(f"bench-d{i:05d}")
        if pending:  # a NaN rollback chain (rollback, shrink_lr) no rank has answered yet
            ev = AnomalyEvent("nonfinite_loss", 0, 100, tick=100, value=float("nan"))
            c.ingest({"rank": 0, "step": 100, "tick": 100, "events": [ev.to_dict()]}, now=100.0)
            write_journal(run_dir, c.take_effects())
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run_dir.wal({"type": "state", "controller": c.state_dict()})
            times.append(time.perf_counter() - t0)
        size = len(json.dumps({"type": "state", "controller": c.state_dict()}, default=str))
        run_dir.close()
        return size, statistics.median(times)


def _ts(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def crash_run(tmp: Path, workers: int, steps: int, kill: bool) -> dict[str, Any]:
    faults: list[dict[str, Any]] = [{"kind": "nan_loss", "at_step": 200, "rank": 0}]
    if kill:
        faults.append({"kind": "kill_supervisor", "at_step": 150, "rank": 0})
    spec = RunSpec(
        target=TARGET, workers=workers, run_dir=str(tmp), faults=faults, threads_per_rank=1,
        argv=["--steps", str(steps), "--step-s", "0.03", "--await-after", "200"], spares=0,
    )  # fmt: skip
    t0 = time.time()
    summary = run_supervised(spec)
    out: dict[str, Any] = {"wall_s": time.time() - t0, "status": summary["status"]}
    out["restarts"] = summary["supervisor_restarts"]
    out["decisions"] = sorted(
        (d["action"], d["anomaly"]["kind"], d["anomaly"]["step"], d["outcome"])
        for d in read_jsonl(tmp / "decisions.jsonl")
    )
    if kill:
        marker = next((tmp / "chaos" / "fired").glob("*.json"))
        journal = read_jsonl(tmp / "history.jsonl")
        restored = next(r for r in journal if r["type"] == "supervisor_restored")
        started = [r for r in journal if r["type"] == "supervisor_started"][-1]
        out["outage_s"] = _ts(restored["ts"]) - marker.stat().st_mtime
        out["restore_s"] = _ts(started["ts"]) - _ts(restored["ts"])
    return out


def _stop_supervisor(run_id: str, run_dir: Path, step: int, stopped: list[float]) -> None:
    """SIGSTOP the run's supervisor for good once it wrote a metrics record of `step`."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            lines = (run_dir / "metrics.jsonl").read_text().splitlines()[-20:]
        except OSError:
            lines = []
        if any(json.loads(line).get("step", 0) >= step for line in lines if line.strip()):
            sup = ray.get_actor(supervisor_name(run_id), namespace=NAMESPACE)
            os.kill(ray.get(sup.where.remote(), timeout=30)[1], signal.SIGSTOP)
            stopped.append(time.time())
            return
        time.sleep(0.02)


def hang_run(
    tmp: Path, workers: int, steps: int, stop_at: int, timeout_s: float | None, *, nan: bool
) -> dict[str, Any]:
    """A run whose supervisor is SIGSTOPped for good at `stop_at`; what it cost.

    With `nan`, a NaN at step 200 whose rollback the ranks wait for (slow steps until it is
    applied); without, the ranks run to their end while the supervisor is away.
    """
    argv = ["--steps", str(steps), "--step-s", "0.03"]
    spec = RunSpec(
        target=TARGET, workers=workers, run_dir=str(tmp), threads_per_rank=1, spares=0,
        faults=[{"kind": "nan_loss", "at_step": 200, "rank": 0}] if nan else [],
        argv=[*argv, "--await-after", "200"] if nan else argv,
        supervisor_timeout_s=timeout_s,
    )  # fmt: skip
    stopped: list[float] = []
    watcher = threading.Thread(
        target=_stop_supervisor, args=(spec.run_id, tmp, stop_at, stopped), daemon=True
    )
    watcher.start()
    t0 = time.time()
    summary = run_supervised(spec)
    watcher.join(timeout=5)
    journal = read_jsonl(tmp / "history.jsonl")
    ended = next(r for r in journal if r["type"] == "run_ended")
    last_step = max(float(r["result"]["last_step_at"]) for r in summary["ranks"])
    return {
        "wall_s": time.time() - t0,
        "status": summary["status"],
        "restarts": summary["supervisor_restarts"],
        "outages": summary["supervisor_outages"],
        "last_step_to_end_s": _ts(ended["ts"]) - last_step,
        "decisions": sorted(
            (d["action"], d["anomaly"]["kind"], d["anomaly"]["step"], d["outcome"])
            for d in read_jsonl(tmp / "decisions.jsonl")
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=260)
    p.add_argument("--records-only", action="store_true", help="measure the state record only")
    p.add_argument("--hang", action="store_true", help="SIGSTOP the supervisor instead of a kill")
    p.add_argument(
        "--supervisor-timeout", type=float, default=None, help="the silence bound (default: 10 s)"
    )
    add_check_imports(p)
    args = p.parse_args()
    if args.check_imports:
        check_imports(targets=(TARGET,))
        return

    print("state record (written with an fsync before a reply that carries a new command)")
    print(f"{'pending':>8} {'closed ids':>10} {'bytes':>9} {'median ms':>10}")
    for pending, closed in [(0, 0), (2, 100), (2, 1_000), (2, 10_000), (2, 100_000)]:
        size, seconds = state_record_cost(pending > 0, closed)
        print(f"{pending:>8} {closed:>10} {size:>9} {seconds * 1e3:>10.2f}")
    if args.records_only:
        return

    ray.init(
        num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1",
        log_to_driver=False, logging_level="ERROR",
        _system_config={"kill_worker_timeout_milliseconds": 100},
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        clean = crash_run(Path(tmp) / "clean", args.workers, args.steps, kill=False)
        if args.hang:
            rows = [
                ("at step 150", hang_run(Path(tmp) / "mid", args.workers, args.steps, 150,
                                         args.supervisor_timeout, nan=True)),
                # No NaN, 20 steps (0.6 s) before the end: the ranks finish while it is away.
                ("near the end, no NaN", hang_run(Path(tmp) / "end", args.workers, args.steps,
                                                  args.steps - 20, args.supervisor_timeout,
                                                  nan=False)),
            ]  # fmt: skip
            ray.shutdown()
            _print_hangs(clean, rows, args)
            return
        killed = crash_run(Path(tmp) / "killed", args.workers, args.steps, kill=True)
    ray.shutdown()
    print(f"\n{args.workers} ranks, {args.steps} steps, kill_supervisor at 150, NaN at 200")
    print(f"  without the kill: {clean['status']}, {clean['wall_s']:.1f} s")
    print(
        f"  with the kill:    {killed['status']}, {killed['wall_s']:.1f} s, "
        f"supervisor_restarts {killed['restarts']}"
    )
    print(f"  outage (kill -> restored supervisor): {killed['outage_s']:.2f} s")
    print(f"  restored -> control loop running again: {killed['restore_s']:.3f} s")
    same = clean["decisions"] == killed["decisions"]
    print(f"  same decisions and outcomes: {same} ({len(killed['decisions'])} decisions)")


def _print_hangs(
    clean: dict[str, Any], rows: list[tuple[str, dict[str, Any]]], args: argparse.Namespace
) -> None:
    bound = args.supervisor_timeout or "10 (default)"
    print(
        f"\n{args.workers} ranks, {args.steps} steps, NaN at 200, supervisor SIGSTOPped for good;"
    )
    print(f"silence bound {bound} s; without the stop: {clean['status']}, {clean['wall_s']:.1f} s")
    for name, r in rows:
        (o,) = r["outages"] or [{}]
        same = r["decisions"] == clean["decisions"] if "NaN" not in name else not r["decisions"]
        print(
            f"  stopped {name}: {r['status']}, {r['wall_s']:.1f} s, restarts {r['restarts']}, "
            f"decisions as without the stop: {same}"
        )
        if not same:
            print(f"    decisions: {r['decisions']}\n    without the stop: {clean['decisions']}")
        print(
            f"    silent {o.get('noticed_after_s')} s before {', '.join(o.get('noticed_by', []))} "
            f"noticed; {o.get('how')}; answered again {o.get('duration_s')} s after it went silent"
        )
        print(f"    ranks' last step -> run's end: {r['last_step_to_end_s']:.1f} s")


if __name__ == "__main__":
    main()
