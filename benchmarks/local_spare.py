"""A rank's process lost while its node lives: a spare of its own node, one on another node, or none.

A head (the driver's and the supervisor's node) and two worker nodes
(raylets on 127.0.0.1, `tests/supervisor/multinode.py`); a 4-rank gloo job
of examples/pretrain_gpt.py spread two ranks per worker node, reporting
through node agents. `kill_rank` SIGKILLs rank 1's process at step
KILL_STEP; its node lives on. Three rows, alternated so each sees the same
machine load:

- local: `local_spares=1, spares=0`: a warm spare on each worker node; rank
  1's node agent promotes its node's spare (`NodeAgent.promote`), once the
  lost process is gone;
- apart: `spares=2`: warm spares where the fewest actors are; the
  supervisor takes one on another node than rank 1's and starts it;
- cold: `spares=0`: a new actor on another node.

For each run it prints the seconds from the loss's detection to the step
every rank completed in the new generation (`detect_to_step_s`, as the
supervisor saw it, and by the ranks' own marks), how rank 1 was replaced,
the node it runs on after (the same as before, or not), and whether every
rank's parameters equal a fault-free run's; then the medians of each row
and their ratios to `apart`.

`--fault hang_rank` SIGSTOPs rank 1 instead: its agent kills the stopped
process by pid, and the promotion waits for it to be gone.

    python benchmarks/local_spare.py [--repeat 3] [--steps 40] [--fault kill_rank|hang_rank]
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
from tests.supervisor.multinode import local_cluster  # noqa: E402

KILL_STEP = 15
VICTIM = 1
ROWS: dict[str, dict[str, Any]] = {
    "local": {"local_spares": 1, "spares": 0},
    "apart": {"spares": 2},
    "cold": {"spares": 0},
}


def measure(summary: dict[str, Any], digest: str, home_of_victim: str) -> dict[str, Any]:
    record = summary["recoveries"][0] if summary.get("recoveries") else {}
    detected = record.get("detected_at")
    marks = [t.get("next_step") for t in record.get("rank_timelines", {}).values()]
    stepped = max(marks) if marks and None not in marks else None
    return {
        "status": summary["status"],
        "replaced": record.get("replacements", {}).get(str(VICTIM)),
        "same_node": summary["nodes"].get(str(VICTIM), "").split("@")[0] == home_of_victim,
        "detect_to_step_s": record.get("detect_to_step_s"),
        "ranks_stepped_s": round(stepped - detected, 3) if stepped and detected else None,
        "agent_promotions": summary.get("agent_promotions"),
        # How long the agent waited for the lost process to be gone before the promotion.
        "gone_s": record.get("promoted", {}).get(str(VICTIM), {}).get("gone_s"),
        "bitwise_equal": {r.get("result", {}).get("params_digest") for r in summary["ranks"]}
        == {digest},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--fault", choices=("kill_rank", "hang_rank"), default="kill_rank")
    add_check_imports(p)
    args = p.parse_args()
    if args.check_imports:
        check_imports()
        return
    root = Path(tempfile.mkdtemp(prefix="lsb-", dir="/tmp"))  # short: socket paths are bounded
    rows: dict[str, list[dict[str, Any]]] = {row: [] for row in ROWS}
    fault = {"kind": args.fault, "at_step": KILL_STEP, "rank": VICTIM}
    common = {"node_agents": "on", "hang_watch": {"first_step_s": 20.0}}
    with local_cluster(root, workers=2, head_cpus=2, worker_cpus=2) as cluster:
        clean = run(cluster, root / "clean", args.steps, spares=0, **common)
        digest = clean["ranks"][0]["result"]["params_digest"]
        home_of_victim = clean["nodes"][str(VICTIM)].split("@")[0]
        for i in range(args.repeat):
            for row, spec in ROWS.items():
                summary = run(cluster, root / f"{row}-{i}", args.steps, faults=[fault],
                              **common, **spec)  # fmt: skip
                got = measure(summary, digest, home_of_victim)
                rows[row].append(got)
                print(json.dumps({"row": row, "run": i, **got}), flush=True)
    print("\nrow     runs  detect -> every rank stepped (median s)  by the ranks' marks  "
          "same node  all bitwise equal")  # fmt: skip
    medians: dict[str, float] = {}
    for row, got in rows.items():

        def median(key: str, got: list[dict[str, Any]] = got) -> float:
            values = [g[key] for g in got if g[key] is not None]
            return statistics.median(values) if values else float("nan")

        medians[row] = median("detect_to_step_s")
        print(
            f"{row:6} {len(got):5}  {medians[row]:38.3f}  {median('ranks_stepped_s'):19.3f}"
            f"  {all(g['same_node'] for g in got)!s:>9}"
            f"  {all(g['bitwise_equal'] and g['status'] == 'completed' for g in got)}"
        )
    apart = medians["apart"]
    print(
        f"ratio to apart: local {medians['local'] / apart:.2f}, cold {medians['cold'] / apart:.2f}"
    )


if __name__ == "__main__":
    main()
