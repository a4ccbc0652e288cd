"""Mean time to recover from a hung rank: targeted restart (warm spare, cold actor) vs a full-group restart.

The same 4-rank DDP job of examples/pretrain_gpt.py (gloo on CPU) runs three
times in one process on one local Ray, with the same `hang_rank` fault
(SIGSTOP of rank 3's process at step HANG_STEP):

(a) targeted restart with warm spares (`RunSpec(spares=2)`);
(b) targeted restart with a cold replacement actor (`spares=0`);
(c) a full-group restart from the last durable checkpoint, as torchrun and
    Ray Train's FailureConfig do, measured: the same job and hang with
    `max_targeted_restarts=0`, so remedy's restart kills every rank and
    starts the group afresh (warm spares first), each rank resuming from
    the newest checkpoint every rank committed (every 100 steps, so step 0
    here) and re-executing the steps since. Its detection is remedy's own,
    a lower bound for a system that waits for the collective timeout.

For each it prints fault -> detection, detection -> next completed step on
every rank, the total, and the steps lost, then the ratios.

    python benchmarks/mttr.py [--steps 60] [--hang-step 30] [--rows abc]

With `--fsdp` the job is sharded (`pretrain_gpt.py --fsdp`, snapshots every
step, checkpoints every 10): row (a) restores the replaced rank's shard from
its buddy's memory, row (d) hangs ranks 2 and 3 at once (rank 2's buddy is
lost too) and restores from the DCP checkpoint, row (c) restarts every rank.
With `--hsdp` it is sharded on a 2 x 2 HSDP mesh: row (a) restores the
replaced rank's shard from its live replica peer (row (d) is left out: each
of two adjacent ranks has a live replica there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
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
CHECKPOINT_EVERY = 100  # GuardConfig's default
SHARDED: list[str] = []  # `--fsdp`: the example's sharding flags


def job_args(steps: int) -> list[str]:
    return ["--steps", str(steps), "--layers", "2", "--width", "64", "--batch-size", "8",
            "--block-size", "64", "--sample-every", "0", *SHARDED]  # fmt: skip


def run(tmp: Path, *, steps: int, faults: list[dict[str, Any]], spares: int) -> dict[str, Any]:
    t0 = time.time()
    spec = RunSpec(
        target=TARGET, workers=4, run_dir=str(tmp), faults=faults, argv=job_args(steps),
        threads_per_rank=1, spares=spares,
    )  # fmt: skip
    summary = run_supervised(spec)
    summary["launched_at"] = t0
    return summary


def fault_time(tmp: Path) -> float:
    """When the fault fired: its marker is written (and synced) just before the rank stops itself."""
    [marker] = (tmp / "chaos" / "fired").glob("*.json")
    return marker.stat().st_mtime


def recovered(tmp: Path, summary: dict[str, Any]) -> dict[str, float]:
    assert summary["status"] == "completed", summary["status"]
    rec = summary["recoveries"][-1]  # two ranks hung at once may be replaced in two records
    fault_at = min(m.stat().st_mtime for m in (tmp / "chaos" / "fired").glob("*.json"))
    ranks = summary["ranks"]
    lost = max(r["steps_executed"] - r["steps_completed"] for r in ranks)
    return {
        "detect": rec["detected_at"] - fault_at,
        "recover": rec["stepped_at"] - rec["detected_at"],
        "total": rec["stepped_at"] - fault_at,
        "lost": float(lost),
        "replaced": float(len(rec["ranks"])),
    }


def profile(tmp: Path, summary: dict[str, Any]) -> list[tuple[str, float]]:
    """The recovery's marks (supervisor's and each rank's), in seconds after the fault, in order."""
    [rec] = summary["recoveries"]
    t0 = fault_time(tmp)
    marks = [(f"supervisor {k}", v - t0) for k, v in rec["timeline"].items()]
    for rank, timeline in rec.get("rank_timelines", {}).items():
        marks += [(f"rank {rank} {k}", v - t0) for k, v in timeline.items() if v >= t0]
    return sorted(marks, key=lambda m: m[1])


def full_restart_row(tmp: Path, *, steps: int, hang_step: int) -> dict[str, float]:
    """Row (c), measured: the hang recovered by a full-group restart from the last checkpoint."""
    fault = [{"kind": "hang_rank", "at_step": hang_step, "rank": 3}]
    spec = RunSpec(
        target=TARGET, workers=4, run_dir=str(tmp), faults=fault, argv=job_args(steps),
        threads_per_rank=1, spares=2, max_targeted_restarts=0,
    )  # fmt: skip
    summary = run_supervised(spec)
    assert summary["status"] == "completed", summary["status"]
    [rec] = summary["recoveries"]
    assert "resumed" in rec, rec  # a full-group restart's record
    fault_at = fault_time(tmp)
    return {
        "detect": rec["detected_at"] - fault_at,
        "recover": rec["stepped_at"] - rec["detected_at"],
        "total": rec["stepped_at"] - fault_at,
        # The steps the group redid from the checkpoint, as the run's goodput ledger counted them.
        "lost": float(summary["steps_executed"] - summary["steps_kept"]),
        "replaced": float(len(rec["replacements"])),
    }


def fresh_start(tmp: Path, summary: dict[str, Any]) -> tuple[float, float]:
    """(launch -> first step reported by every rank, median step time) of a fault-free run."""
    first: dict[int, float] = {}
    times = []
    for m in read_jsonl(tmp / "metrics.jsonl"):
        first.setdefault(m["rank"], _ts(m["ts"]))
        times.append(m["step_time_s"])
    return max(first.values()) - summary["launched_at"], statistics.median(times)


def _ts(iso: str) -> float:
    from datetime import datetime  # noqa: PLC0415

    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _source(args: argparse.Namespace) -> str:
    """Where row (a)'s replacement takes its state from, for its label."""
    return ", replica" if args.hsdp else ", buddy" if args.fsdp else ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--hang-step", type=int, default=30)
    p.add_argument("--repeat", type=int, default=1, help="runs of each row; medians are printed")
    p.add_argument(
        "--rows", default="abc", help="rows to run: a (warm), b (cold), c (full restart)"
    )
    p.add_argument("--profile", action="store_true", help="print each warm run's timeline")
    p.add_argument("--fsdp", action="store_true", help="the sharded job; adds row (d), DCP")
    p.add_argument("--hsdp", action="store_true", help="the sharded job on a 2 x 2 HSDP mesh")
    add_check_imports(p)
    args = p.parse_args()
    if args.check_imports:
        check_imports(targets=(TARGET,))
        return
    global CHECKPOINT_EVERY
    if args.fsdp or args.hsdp:
        SHARDED.extend(["--fsdp", "--snapshot-every", "1", "--checkpoint-every", "10"])
        CHECKPOINT_EVERY = 10
        args.fsdp = True
    if args.hsdp:
        SHARDED.append("--hsdp")
    elif args.fsdp:
        args.rows += "d"
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False, logging_level="ERROR")  # fmt: skip
    fault = [{"kind": "hang_rank", "at_step": args.hang_step, "rank": 3}]
    rows: dict[str, dict[str, float]] = {}
    full_name = "(c) full restart from checkpoint"
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        clean = run(tmp / "clean", steps=args.steps, faults=[], spares=0)
        # A false alarm on the fault-free run would make every figure below meaningless.
        assert clean["recoveries"] == [] and "rank_hang" not in clean["anomalies"], clean
        start_s, step_s = fresh_start(tmp / "clean", clean)
        adjacent = [{**fault[0], "rank": 2}, *fault]
        for name, spares, faults in (
            ("(a) targeted, warm spare" + _source(args), 2, fault),
            ("(b) targeted, cold actor", 0, fault),
            ("(d) targeted, buddy lost: DCP", 2, adjacent),
        ):
            if name[1] not in args.rows or (name[1] == "d" and not args.fsdp):
                continue
            runs = []
            for i in range(args.repeat):
                d = tmp / f"{name[1]}{i}"
                summary = run(d, steps=args.steps, faults=faults, spares=spares)
                runs.append(recovered(d, summary))
                if args.profile:
                    print(
                        f"{name} run {i}: "
                        + json.dumps({k: round(v, 3) for k, v in runs[-1].items()})
                    )
                    for mark, at in profile(d, summary):
                        print(f"  {at:7.3f}s  {mark}")
            rows[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        if "c" in args.rows:
            runs = [
                full_restart_row(tmp / f"c{i}", steps=args.steps, hang_step=args.hang_step)
                for i in range(args.repeat)
            ]
            rows[full_name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    if not rows:
        p.error("--rows names no row")
    print(f"4 ranks, hang_rank on rank 3 at step {args.hang_step}; step {step_s * 1000:.1f} ms; "
          f"fresh group start to first step {start_s:.2f} s; checkpoint every {CHECKPOINT_EVERY}")  # fmt: skip
    print(
        f"{'recovery':<34} {'fault->detect':>14} {'detect->step':>13} {'total':>8} {'steps lost':>11} {'ranks':>6}"
    )
    for name, r in rows.items():
        print(f"{name:<34} {r['detect']:>13.2f}s {r['recover']:>12.2f}s {r['total']:>7.2f}s "
              f"{r['lost']:>11.0f} {r['replaced']:>6.0f}")  # fmt: skip
    if full_name in rows:
        full = rows[full_name]["total"]
        for name in rows:
            if name != full_name:
                print(f"full restart / {name[4:]}: {full / rows[name]['total']:.1f}x")
    print(json.dumps(rows))
    ray.shutdown()


if __name__ == "__main__":
    main()
