"""A chip or the data? Each fault, its classification, the action, what it cost: the table.

The example GPT (examples/pretrain_gpt.py defaults, 0.8M parameters) runs
under `remedy run`'s supervisor on a private local Ray with the llm-pretrain
policy, 2 gloo ranks (3 for the replica check, which needs a majority), one
chaos fault each at step `--at`:

- `bitflip` in rank 1's gradient (bit 30: a small value becomes huge, the norm inf);
- `bad_rank`: the same on every step of rank 1's process until it is replaced;
- `loss_spike`: a poisoned batch on rank 0 (its loss x20 whenever it is trained on);
- `bitflip` of a low bit of a weight on rank 1 (no NaN, no spike: only the
  replica check, every 50 steps, can see it).

Per fault it prints the classification, the action that followed, the steps
lost (executed minus completed, on the rank that lost most), the time from
the anomaly (the event's time stamp) to the answer (the classification's)
and to the action done (every rank stepped after the restart, or the
rollback's outcome journaled), each also in steps of the run's median step,
and the replay's own time (`replay_s`). The replica check's cost per step is
`benchmarks/replay_costs.py`'s.

    python benchmarks/replay_outcomes.py [--steps 60] [--at 25] [--repeat 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from datetime import datetime
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


def scenarios(at: int) -> list[tuple[str, int, dict[str, Any]]]:
    """(name, ranks, fault)."""
    return [
        ("bitflip, gradient, rank 1", 2, {"kind": "bitflip", "at_step": at, "rank": 1}),
        ("bad_rank, gradient, rank 1", 2, {"kind": "bad_rank", "at_step": at, "rank": 1}),
        ("poisoned batch, rank 0", 2,
         {"kind": "loss_spike", "at_step": at, "rank": 0, "factor": 20.0}),
        ("bitflip, weight bit 3, rank 1 of 3", 3,
         {"kind": "bitflip", "at_step": at, "rank": 1, "target": "param", "bit": 3}),
    ]  # fmt: skip


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def measure(tmp: Path, workers: int, fault: dict[str, Any], steps: int) -> dict[str, Any]:
    spec = RunSpec(
        target=TARGET, workers=workers, run_dir=str(tmp), faults=[fault], policy="llm-pretrain",
        argv=["--steps", str(steps), "--sample-every", "0"], threads_per_rank=1, spares=1,
        # The hang watch's 0.5 s floor: at load 10 the example's steps take ~0.8 s and a
        # replacement's first ones more, and it was once named hung right after the
        # restart its replay asked for (a second restart, 47 s); that is not what is
        # measured here.
        hang_watch={"floor_s": 3.0},
    )  # fmt: skip
    summary = run_supervised(spec)
    assert summary["status"] == "completed", summary
    assert len({r["result"]["params_digest"] for r in summary["ranks"]}) == 1, "replicas differ"
    decisions = read_jsonl(tmp / "decisions.jsonl")
    metrics = [m for m in read_jsonl(tmp / "metrics.jsonl") if m["rank"] == 0]
    step_s = statistics.median(m["step_time_s"] for m in metrics)
    lost = max(r["steps_executed"] - r["steps_completed"] for r in summary["ranks"])
    replays = [d for d in decisions if d["action"] == "replay_step"]
    replay = next((d for d in replays if d["outcome"] == "applied"), None)
    if replays and replay is None:
        raise RuntimeError(f"no replay was made: {replays[0]['outcome']}: {replays[0]['detail']}")
    if replay is not None:
        verdict = replay["result"]["verdict"]
        seen, kind, rank = replay["anomaly"], verdict["kind"], verdict["rank"]
        answered_at = next(
            d["anomaly"]["ts"] for d in decisions if d["anomaly"]["kind"] == verdict["kind"]
        )
        replay_s: float | None = verdict["replay_s"]
    else:  # the replica check: the classification is the anomaly itself
        seen = next(d["anomaly"] for d in decisions if d["anomaly"]["kind"] == "replica_divergence")
        kind, rank, answered_at, replay_s = seen["kind"], seen["rank"], seen["ts"], None
    acted = [d for d in decisions if d["anomaly"]["kind"] == kind and d["outcome"] == "applied"]
    done = [
        d["result"]["stepped_at"] if d["action"] == "restart_rank" else _epoch(d["ts"])
        for d in acted
        if d["action"] in ("restart_rank", "rollback")
    ]
    return {
        "classification": f"{kind} (rank {rank})",
        "action": ", ".join(sorted({d["action"] for d in acted})),
        "steps_lost": lost,
        "step_s": step_s,
        "to_answer_s": answered_at - seen["ts"],
        "to_done_s": max(done) - seen["ts"] if done else None,
        "replay_s": replay_s,
        "found_at": seen["step"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--at", type=int, default=25, help="the step the fault hits")
    p.add_argument("--repeat", type=int, default=1, help="runs of each fault; medians printed")
    add_check_imports(p)
    args = p.parse_args()
    if args.check_imports:
        check_imports(targets=(TARGET,))
        return
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False, logging_level="ERROR")  # fmt: skip
    print("| fault | classification | action | steps lost | anomaly -> answer | "
          "anomaly -> action done | replay |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for name, workers, fault in scenarios(args.at):
            runs = [
                measure(Path(tmp) / f"{fault['kind']}-{fault['rank']}-{workers}-{i}", workers,
                        fault, args.steps)
                for i in range(args.repeat)
            ]  # fmt: skip
            row = runs[0]
            step = statistics.median(r["step_s"] for r in runs)

            def cell(key: str, runs: list[dict[str, Any]] = runs, step: float = step) -> str:
                values = [r[key] for r in runs if r[key] is not None]
                if not values:
                    return "-"
                v = statistics.median(values)
                return f"{v:.2f} s ({v / step:.1f} steps)"

            lost = statistics.median(r["steps_lost"] for r in runs)
            found = f" (found at step {row['found_at']})" if row["replay_s"] is None else ""
            print(
                f"| {name} | {row['classification']}{found} | {row['action']} | {lost:g} | "
                f"{cell('to_answer_s')} | {cell('to_done_s')} | {cell('replay_s')} |"
            )
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"median step {step * 1e3:.0f} ms of the last fault's run; load average {load}")
    ray.shutdown()


if __name__ == "__main__":
    main()
