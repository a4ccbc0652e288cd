"""What one flooding report batch costs the supervisor, with and without the report caps.

A rank (or anything that can call the supervisor) sends one batch of N
well-formed `data_stall` events for one step, the shape that blocked a live
supervisor for 7.1 s and wrote 46 MB to `anomalies.jsonl`. The same batch
goes to two Controllers in this process, one with the default
`report_validation.Limits` and one with the caps lifted; for each the table
gives the time `ingest` took, the bytes it wrote to the run directory, the
events accepted and the rejections counted.

`--live` also sends the batch to a real `SupervisorActor` through Ray (a
private local Ray on 127.0.0.1; the supervisor's control loop is not
started, as in `supervisor_load.py`), the way a rank's `RayReporter` does:
`report.remote(batch)`. That round trip includes what the in-process rows
leave out: pickling on the sender, the object store (the batch is far over
Ray's inline limit) and unpickling in the supervisor's process, all of which
happen before `report` runs and so before any cap applies. The script prints
the pickled size and a local `pickle.loads` of it, and the round trip of a
one-event batch beside it. Ray offers no per-call size limit to apply the
cap before unpickling: that needs the batch sent as bytes and its length
checked before decoding (not done).

    python benchmarks/report_flood.py [--events 400000] [--live] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

from benchmarks._smoke import add_check_imports, check_imports
from remedy.control.decide import Controller
from remedy.policies import AnomalyEvent, Engine, load_policy
from remedy.protocol.reports import Limits
from remedy.rundir.journal_effects import write_journal
from remedy.rundir.writer import RunDir

UNCAPPED = Limits(max_events_per_batch=10**9, max_events_per_tick=10**9)


def flood(events: int, limits: Limits) -> tuple[float, int, int, dict[str, int]]:
    """(seconds in ingest, bytes written, events accepted, rejections) for one flooding batch."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = RunDir(tmp, "flood")
        engine = Engine(load_policy("default"), run_id="flood")
        controller = Controller(engine, world_size=1, limits=limits)
        controller.ingest({"rank": 0, "step": 10, "tick": 10}, now=time.time())
        write_journal(run_dir, controller.take_effects())
        stall = AnomalyEvent("data_stall", 0, 10, value=9.0, threshold=1.0).to_dict()
        batch = {"rank": 0, "step": 11, "tick": 11, "events": [stall] * events}
        start = time.perf_counter()
        controller.ingest(batch, now=time.time())
        write_journal(run_dir, controller.take_effects())  # what the shell writes of it
        seconds = time.perf_counter() - start
        run_dir.close()
        written = sum(p.stat().st_size for p in Path(tmp).rglob("*") if p.is_file())
        return seconds, written, controller.anomaly_counts["data_stall"], dict(controller.rejected)


def distinct(n: int) -> list[dict[str, Any]]:
    """`n` data_stall events, each its own mapping, as n events from a rank are on the wire
    (one object repeated would pickle as one, by reference)."""
    stall = AnomalyEvent("data_stall", 0, 10, value=9.0, threshold=1.0).to_dict()
    return [{**stall, "ts": float(i)} for i in range(n)]


def live(events: int, repeat: int) -> None:
    """Round trips of one flooding batch and of a one-event batch through Ray to a real supervisor."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
    import ray  # noqa: PLC0415 - only --live needs Ray

    from remedy.protocol.spec import RunSpec  # noqa: PLC0415
    from remedy.supervisor.actor import SupervisorActor  # noqa: PLC0415

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False, logging_level="ERROR")  # fmt: skip
    try:
        with tempfile.TemporaryDirectory() as tmp:
            spec = RunSpec(target="bench.py:main", run_dir=str(Path(tmp) / "run"), spares=0)
            sup = SupervisorActor.remote(spec.to_dict())  # type: ignore[attr-defined]
            ray.get(sup.status.remote(spec.token))
            seq = 0

            def send(n: int, step: int) -> float:
                nonlocal seq
                seq += 1
                batch: dict[str, Any] = {"token": spec.token, "rank": 0, "step": step, "tick": step,
                                         "incarnation": 1, "seq": seq, "events": distinct(n)}  # fmt: skip
                start = time.perf_counter()
                ray.get(sup.report.remote(batch))
                return time.perf_counter() - start

            send(1, 10)
            small = [send(1, 11 + i) for i in range(max(repeat, 5))]
            big = [send(events, 20 + i) for i in range(repeat)]
            rejected = ray.get(sup.status.remote(spec.token))["rejected"]
    finally:
        ray.shutdown()
    sample = {"rank": 0, "step": 20, "tick": 20, "events": distinct(events)}
    data = pickle.dumps(sample, protocol=5)
    loads = []
    for _ in range(repeat):
        start = time.perf_counter()
        pickle.loads(data)
        loads.append(time.perf_counter() - start)
    print(f"\nthrough Ray to a live supervisor (median of {repeat}; load average "
          f"{os.getloadavg()[0]:.1f}):")  # fmt: skip
    print(
        f"  one-event batch round trip        {statistics.median(small) * 1e3:8.1f} ms (n={len(small)})"
    )
    print(
        f"  {events}-event batch round trip   {statistics.median(big) * 1e3:8.1f} ms (n={len(big)})"
    )
    print(
        f"  its pickle: {len(data) / 1e6:.1f} MB; pickle.loads here {statistics.median(loads) * 1e3:.1f} ms"
    )
    print(f"  rejected by the supervisor: {rejected}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=400_000)
    parser.add_argument("--live", action="store_true", help="also through Ray to a live supervisor")
    parser.add_argument("--repeat", type=int, default=3)
    add_check_imports(parser)
    args = parser.parse_args()
    if args.check_imports:
        check_imports("ray", "remedy.protocol.spec", "remedy.supervisor.actor")
        return
    rows = [("capped (default Limits)", Limits()), ("caps lifted", UNCAPPED)]
    print(f"one batch of {args.events} data_stall events at one step")
    print(f"{'controller':<26}{'ingest s':>10}{'written MB':>12}{'accepted':>10}  rejected")
    results = []
    for label, limits in rows:
        seconds, written, accepted, rejected = flood(args.events, limits)
        results.append(seconds)
        print(f"{label:<26}{seconds:>10.3f}{written / 1e6:>12.2f}{accepted:>10}  {rejected}")
    print(f"ratio (lifted / capped): {results[1] / results[0]:.0f}x")
    if args.live:
        live(args.events, args.repeat)


if __name__ == "__main__":
    main()
