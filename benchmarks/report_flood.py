"""What one flooding report batch costs the supervisor, with and without the report caps.

A rank (or anything that can call the supervisor) sends one batch of N
well-formed `data_stall` events for one step, the shape that blocked a live
supervisor for 7.1 s and wrote 46 MB to `anomalies.jsonl`. The same batch
goes to two Controllers in this process, one with the default
`report_validation.Limits` and one with the caps lifted; for each the table
gives the time `ingest` took, the bytes it wrote to the run directory, the
events accepted and the rejections counted.

    python benchmarks/report_flood.py [--events 400000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

from remedy.policies import AnomalyEvent, Engine, load_policy
from remedy.supervisor.core.control import Controller
from remedy.supervisor.core.report_validation import Limits
from remedy.workers.rundir import RunDir

UNCAPPED = Limits(max_events_per_batch=10**9, max_events_per_tick=10**9)


def flood(events: int, limits: Limits) -> tuple[float, int, int, dict[str, int]]:
    """(seconds in ingest, bytes written, events accepted, rejections) for one flooding batch."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = RunDir(tmp, "flood")
        engine = Engine(load_policy("default"), run_id="flood")
        controller = Controller(engine, world_size=1, run_dir=run_dir, limits=limits)
        controller.ingest({"rank": 0, "step": 10, "tick": 10})
        stall = AnomalyEvent("data_stall", 0, 10, value=9.0, threshold=1.0).to_dict()
        batch = {"rank": 0, "step": 11, "tick": 11, "events": [stall] * events}
        start = time.perf_counter()
        controller.ingest(batch)
        seconds = time.perf_counter() - start
        run_dir.close()
        written = sum(p.stat().st_size for p in Path(tmp).rglob("*") if p.is_file())
        return seconds, written, controller.anomaly_counts["data_stall"], dict(controller.rejected)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=400_000)
    args = parser.parse_args()
    rows = [("capped (default Limits)", Limits()), ("caps lifted", UNCAPPED)]
    print(f"one batch of {args.events} data_stall events at one step")
    print(f"{'controller':<26}{'ingest s':>10}{'written MB':>12}{'accepted':>10}  rejected")
    results = []
    for label, limits in rows:
        seconds, written, accepted, rejected = flood(args.events, limits)
        results.append(seconds)
        print(f"{label:<26}{seconds:>10.3f}{written / 1e6:>12.2f}{accepted:>10}  {rejected}")
    print(f"ratio (lifted / capped): {results[1] / results[0]:.0f}x")


if __name__ == "__main__":
    main()
