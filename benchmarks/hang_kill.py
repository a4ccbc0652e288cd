"""A hung rank on another node: killed by its node's agent vs through Ray, on a real 3-node cluster.

A head (the driver's and the supervisor's node) and two worker nodes
(raylets on 127.0.0.1, `tests/supervisor/multinode.py`) whose raylets keep
Ray's default `kill_worker_timeout_milliseconds` (5,000 ms), as a cluster
that remedy did not start has. A 4-rank gloo job of examples/pretrain_gpt.py
runs with its ranks on the worker nodes; `hang_rank` SIGSTOPs rank 1 at
step KILL_STEP. Once the hang is found, `restart_rank` kills the stopped
process:

- agents off: through Ray (`ray.kill`), whose raylet waits its kill timeout
  for a stopped process before it SIGKILLs it;
- agents on: by pid, from the rank's node agent (`NodeAgent.kill_rank`),
  with Ray's kill behind it.

The survivors stay blocked in their collective until the process is gone.
Runs alternate between the two rows so both see the same machine load. For
each run it prints the seconds from the restart's kill (its `killed` mark)
to the first survivor's collective failing (`error` in its timeline) and to
every rank's step in the new generation (`stepped_at`); then the medians of
each row and their ratio (on / off).

    python benchmarks/hang_kill.py [--repeat 3] [--steps 40]

The nodes share one machine, so the supervisor could kill any rank by pid
here; it does so only on its own Ray node, as on a cluster of several
machines, and leaves the others to their agent or to Ray.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._smoke import add_check_imports, check_imports  # noqa: E402
from benchmarks.node_loss import run  # noqa: E402
from tests.supervisor.multinode import HEALTH_CHECK, local_cluster  # noqa: E402

KILL_STEP = 15
VICTIM = 1


def measure(summary: dict[str, Any]) -> dict[str, Any]:
    record = summary["recoveries"][0] if summary.get("recoveries") else {}
    killed = record.get("timeline", {}).get("killed")
    errors = [
        t["error"]
        for r, t in record.get("rank_timelines", {}).items()
        if int(r) != VICTIM and "error" in t
    ]
    return {
        "status": summary["status"],
        "ranks": record.get("ranks"),
        "agent_kills": summary.get("agent_kills"),
        "kill_to_released_s": round(min(errors) - killed, 3) if killed and errors else None,
        "kill_to_step_s": round(record["stepped_at"] - killed, 3) if killed else None,
        "detect_to_step_s": record.get("detect_to_step_s"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    add_check_imports(p)
    args = p.parse_args()
    if args.check_imports:
        check_imports()
        return
    root = Path(tempfile.mkdtemp(prefix="hkb-", dir="/tmp"))  # short: socket paths are bounded
    rows: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    fault = {"kind": "hang_rank", "at_step": KILL_STEP, "rank": VICTIM}
    # Ray's default kill timeout: only the faster health checks of the test clusters.
    with local_cluster(root, workers=2, system_config=dict(HEALTH_CHECK)) as cluster:
        for i in range(args.repeat):
            for row in rows:
                summary = run(
                    cluster, root / f"{row}-{i}", args.steps, spares=2, faults=[fault],
                    node_agents=row, hang_watch={"first_step_s": 4.0},
                )  # fmt: skip
                got = measure(summary)
                rows[row].append(got)
                print(json.dumps({"agents": row, "run": i, **got}), flush=True)
    print(
        "\nagents  runs  kill -> survivors released (median)  kill -> every rank stepped (median)"
    )
    medians: dict[str, tuple[float, float]] = {}
    for row, got in rows.items():
        released = [g["kill_to_released_s"] for g in got if g["kill_to_released_s"] is not None]
        stepped = [g["kill_to_step_s"] for g in got if g["kill_to_step_s"] is not None]
        med = (
            statistics.median(released) if released else float("nan"),
            statistics.median(stepped) if stepped else float("nan"),
        )
        medians[row] = med
        print(f"{row:6} {len(got):5}  {med[0]:34.3f}  {med[1]:34.3f}")
    on, off = medians["on"], medians["off"]
    print(f"ratio on / off: released {on[0] / off[0]:.2f}, stepped {on[1] / off[1]:.2f}")


if __name__ == "__main__":
    main()
