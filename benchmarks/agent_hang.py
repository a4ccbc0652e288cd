"""Time to find a hung rank with node agents on vs off, and the rank pings the supervisor sends.

The same DDP job of examples/pretrain_gpt.py (gloo on CPU, `--workers`
ranks, one local Ray) runs with `hang_rank` (SIGSTOP of the last rank's
process at `--hang-step`), `--repeat` times with node agents off (the
supervisor's hang watch suspects, the supervisor pings every rank and
names the hung one) and as often with them on (the agent of the rank's
node suspects, pings its ranks and sends its sightings; the supervisor
names the rank from them, `supervisor.core.sightings`), alternating so that
both see the same machine load. The detection time is from the fault's
marker (written just before the rank stops itself) to the `rank_hang`
being decided (`detected_at` of the run's recovery record). Then one
fault-free run of each mode gives the supervisor's rank pings per second
in steady state (`supervisor_pings` of summary.json over the run's wall
time); the hang runs' counts include the pings of the restart itself.

    python benchmarks/agent_hang.py [--workers 2] [--repeat 3] [--steps 60] [--hang-step 30]

Prints each run, the medians, and the ratio (on / off). About four minutes
on two shared cores with the defaults; ten with `--workers 4 --repeat 5`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._smoke import add_check_imports, check_imports  # noqa: E402
from remedy.cli.runner import run_supervised  # noqa: E402
from remedy.protocol.spec import RunSpec  # noqa: E402
from remedy.rundir.writer import read_jsonl  # noqa: E402

TARGET = f"{REPO / 'examples' / 'pretrain_gpt.py'}:main"


def job_args(steps: int) -> list[str]:
    return ["--steps", str(steps), "--layers", "2", "--width", "64", "--batch-size", "8",
            "--block-size", "64", "--sample-every", "0"]  # fmt: skip


def run(
    tmp: Path, *, agents: str, workers: int, steps: int, faults: list[dict[str, Any]]
) -> dict[str, Any]:
    spec = RunSpec(
        target=TARGET, workers=workers, run_dir=str(tmp), faults=faults, argv=job_args(steps),
        threads_per_rank=1, spares=1, node_agents=agents,
    )  # fmt: skip
    summary = run_supervised(spec)
    assert summary["status"] == "completed", summary
    return summary


def detection(tmp: Path, summary: dict[str, Any], rank: int) -> dict[str, Any]:
    """Fault -> rank_hang decided, and who found it, for one hang run."""
    fault_at = min(m.stat().st_mtime for m in (tmp / "chaos" / "fired").glob("*.json"))
    rec = summary["recoveries"][0]
    decided = [d for d in read_jsonl(tmp / "decisions.jsonl") if d["action"] == "restart_rank"]
    anomaly = decided[0]["anomaly"]
    assert anomaly["kind"] == "rank_hang" and anomaly["rank"] == rank, anomaly
    timeout = anomaly["details"].get("timeout_s")
    return {
        "detect_s": round(rec["detected_at"] - fault_at, 3),
        # The first suspicion of this stall (the supervisor's, or the agent's) -> decided:
        # the ping rounds, and under agents their trip to the supervisor.
        "suspect_to_decide_s": round(rec["detected_at"] - rec["timeline"]["suspected"], 3),
        "found_by": anomaly["details"].get("found_by", "supervisor"),
        "timeout_s": timeout,
        "supervisor_pings": summary["supervisor_pings"],
        "agent_sighting_calls": summary["agent_sighting_calls"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3, help="hang runs of each mode")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--hang-step", type=int, default=30)
    add_check_imports(p)
    args = p.parse_args()
    if args.check_imports:
        check_imports(targets=(TARGET,))
        return
    ray.init(num_cpus=max(4, args.workers + 2), include_dashboard=False,
             _node_ip_address="127.0.0.1", log_to_driver=False, logging_level="ERROR")  # fmt: skip
    rank = args.workers - 1
    fault = [{"kind": "hang_rank", "at_step": args.hang_step, "rank": rank}]
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    steady: dict[str, float] = {}
    sightings: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        for i in range(args.repeat):
            for mode in ("off", "on"):
                d = tmp / f"{mode}{i}"
                summary = run(d, agents=mode, workers=args.workers, steps=args.steps, faults=fault)
                runs[mode].append(detection(d, summary, rank))
                print(f"agents {mode:<3} run {i}: {json.dumps(runs[mode][-1])}", flush=True)
        for mode in ("off", "on"):
            summary = run(tmp / f"clean-{mode}", agents=mode, workers=args.workers,
                          steps=args.steps, faults=[])  # fmt: skip
            assert summary["recoveries"] == [], summary["recoveries"]
            steady[mode] = summary["supervisor_pings"] / summary["wall_s"]
            sightings[mode] = summary["agent_sighting_calls"] / summary["wall_s"]
            print(f"agents {mode:<3} fault-free: {summary['supervisor_pings']} supervisor pings, "
                  f"{summary['agent_sighting_calls']} agent sighting calls in "
                  f"{summary['wall_s']:.1f} s", flush=True)  # fmt: skip
    medians = {m: statistics.median(r["detect_s"] for r in runs[m]) for m in runs}
    confirm = {m: statistics.median(r["suspect_to_decide_s"] for r in runs[m]) for m in runs}
    timeouts = {m: statistics.median(r["timeout_s"] for r in runs[m]) for m in runs}
    print(f"{args.workers} ranks, hang_rank on rank {rank} at step {args.hang_step}, "
          f"{args.repeat} runs each")  # fmt: skip
    print(f"{'node agents':<12} {'fault->rank_hang':>17} {'timeout':>8} {'suspect->decided':>17} "
          f"{'found by':>11} {'fault-free: supervisor pings/s':>31} {'sighting calls/s':>17}")  # fmt: skip
    for mode in ("off", "on"):
        found = sorted({r["found_by"] for r in runs[mode]})
        print(f"{mode:<12} {medians[mode]:>16.3f}s {timeouts[mode]:>7.3f}s {confirm[mode]:>16.3f}s "
              f"{','.join(found):>11} {steady[mode]:>31.2f} {sightings[mode]:>17.2f}")  # fmt: skip
    print("(medians over the runs)")
    print(f"ratio on / off: {medians['on'] / medians['off']:.2f}")
    print(json.dumps({"runs": runs, "medians": medians, "suspect_to_decide": confirm,
                      "supervisor_pings_per_s": steady,
                      "agent_sighting_calls_per_s": sightings}))  # fmt: skip
    ray.shutdown()


if __name__ == "__main__":
    main()
