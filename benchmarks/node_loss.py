"""Time from a node's loss to the next step on every rank, on a real 3-node Ray cluster here.

A head (the driver's and the supervisor's node) and two worker nodes
(raylets on 127.0.0.1, `tests/supervisor/multinode.py`, whose GCS calls a
node dead after three missed health checks 0.5 s apart); a 4-rank gloo job
of examples/pretrain_gpt.py spread two ranks per worker node. `kill_node` at
step KILL_STEP on rank 1 SIGKILLs its node's raylet and every process below
it (ranks 1 and 3, and any spares there). Two rows:

- warm: `spares=4`, two warm spares on each worker node, so the surviving
  node has two to take the lost ranks;
- cold: `spares=0`, the lost ranks are started as new actors on the
  surviving node;
- warm-agents, cold-agents: the same with node agents on (`--node-agents
  on`): each node's ranks report to its agent, which pings them itself.

For each run it prints the seconds from the kill (the supervisor's journal
record, written just before the rank kills its node) to the node's loss
being found (the `node_lost` record) and to the step every rank completed in
the new generation, as the supervisor saw it (the restart's `stepped_at`)
and by the ranks' own marks (`ranks_stepped_s`: under node agents the
supervisor sees a step only with a digest, up to a digest period later),
and whether every rank's parameters equal a fault-free run's; then the
medians of `--repeat` runs.

    python benchmarks/node_loss.py [--repeat 3] [--steps 30] [--rows warm,cold] [--timeline]
    python benchmarks/node_loss.py --rows warm,warm-agents

`--timeline` adds, for each run, the restart's marks (supervisor side) and
each rank's own, in seconds after the kill.
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
from remedy.rundir.writer import read_jsonl  # noqa: E402
from tests.supervisor.multinode import Cluster, local_cluster  # noqa: E402

TARGET = f"{REPO / 'examples' / 'pretrain_gpt.py'}:main"
KILL_STEP = 15
# row -> (warm spares, node agents)
ROWS = {"warm": (4, "off"), "cold": (0, "off"), "warm-agents": (4, "on"), "cold-agents": (0, "on")}


def run(cluster: Cluster, run_dir: Path, steps: int, **spec: Any) -> dict[str, Any]:
    """One 4-rank supervised run on `cluster`, driven from a process of its own; its summary."""
    args = ["--steps", str(steps), "--layers", "1", "--width", "32", "--batch-size", "4",
            "--block-size", "32", "--sample-every", "0"]  # fmt: skip
    fields = {"target": TARGET, "workers": 4, "run_dir": str(run_dir), "argv": args,
              "threads_per_rank": 1, **spec}  # fmt: skip
    out = cluster.head.run(
        sys.executable, "-m", "tests.supervisor.cluster_run", cluster.head.address,
        json.dumps(fields), timeout=900, cwd=REPO,
    )  # fmt: skip
    line = next((x for x in out.stdout.splitlines() if x.startswith("SUMMARY ")), None)
    if line is None:
        raise RuntimeError(f"the run printed no summary: {out.stderr[-3000:]}")
    summary: dict[str, Any] = json.loads(line.removeprefix("SUMMARY "))
    return summary


def _since(at: float, marks: dict[str, Any]) -> dict[str, float]:
    """`marks` (wall times) as seconds after `at`, in time order."""
    times = {k: v - at for k, v in marks.items() if isinstance(v, int | float) and v > 1e9}
    return {k: round(v, 3) for k, v in sorted(times.items(), key=lambda kv: kv[1])}


def measure(run_dir: Path, summary: dict[str, Any], digest: str) -> dict[str, Any]:
    history = read_jsonl(run_dir / "history.jsonl")
    kill = next(r for r in history if r.get("type") == "chaos_kill_node")
    lost = next((r for r in history if r.get("type") == "node_lost"), None)
    record = summary["recoveries"][0] if summary.get("recoveries") else {}
    ranks = {r: _since(kill["at"], t) for r, t in record.get("rank_timelines", {}).items()}
    stepped = [t.get("next_step") for t in ranks.values()]
    return {
        "status": summary["status"],
        "ranks_lost": lost["ranks"] if lost else None,
        "replacements": record.get("replacements"),
        "detect_s": round(lost["detected_at"] - kill["at"], 3) if lost else None,
        "kill_to_step_s": round(record["stepped_at"] - kill["at"], 3) if record else None,
        # By the ranks' own marks: under node agents the supervisor learns of a step from a
        # digest, up to a digest period after it.
        "ranks_stepped_s": max(stepped) if stepped and None not in stepped else None,
        "bitwise_equal": {r.get("result", {}).get("params_digest") for r in summary["ranks"]}
        == {digest},
        # Where the time went, in seconds after the kill: the supervisor's marks, each rank's.
        "timeline": _since(kill["at"], record.get("timeline", {})),
        "rank_timelines": ranks,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rows", default="warm,cold")
    p.add_argument("--timeline", action="store_true", help="print where each run's time went")
    add_check_imports(p)
    args = p.parse_args()
    if args.check_imports:
        check_imports(targets=(TARGET,))
        return
    root = Path(tempfile.mkdtemp(prefix="nlb-", dir="/tmp"))  # short: socket paths are bounded
    rows: dict[str, list[dict[str, Any]]] = {}
    with local_cluster(root, workers=2, head_cpus=2, worker_cpus=2) as cluster:
        clean = run(cluster, root / "clean", args.steps, spares=0)
        digest = clean["ranks"][0]["result"]["params_digest"]
        fault = {"kind": "kill_node", "at_step": KILL_STEP, "rank": 1}
        for row in args.rows.split(","):
            for i in range(args.repeat):
                run_dir = root / f"{row}-{i}"
                spares, agents = ROWS[row]
                summary = run(cluster, run_dir, args.steps, spares=spares, node_agents=agents,
                              faults=[fault])  # fmt: skip
                got = measure(run_dir, summary, digest)
                rows.setdefault(row, []).append(got)
                shown = (
                    got if args.timeline else {k: v for k, v in got.items() if "timeline" not in k}
                )
                print(json.dumps({"row": row, "run": i, **shown}), flush=True)
                # The next run gets three nodes again: a fresh node for the killed one.
                killed = next(
                    r["node_id"]
                    for r in read_jsonl(run_dir / "history.jsonl")
                    if r.get("type") == "chaos_kill_node"
                )
                cluster.replace_worker(killed, root)
    print("\nrow          runs  detect_s  kill_to_step_s  ranks_stepped_s  all bitwise equal"
          "\n                    (medians; kill_to_step_s as the supervisor saw it)")  # fmt: skip
    for row, got in rows.items():

        def median(key: str, got: list[dict[str, Any]] = got) -> float:
            values = [g[key] for g in got if g[key] is not None]
            return statistics.median(values) if values else float("nan")

        print(
            f"{row:12} {len(got):4}  {median('detect_s'):8.3f}  {median('kill_to_step_s'):14.3f}"
            f"  {median('ranks_stepped_s'):15.3f}"
            f"  {all(g['bitwise_equal'] and g['status'] == 'completed' for g in got)}"
        )


if __name__ == "__main__":
    main()
