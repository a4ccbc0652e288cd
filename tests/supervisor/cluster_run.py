"""Run one supervised job on a running Ray cluster, from a process of its own; print its summary.

    python -m tests.supervisor.cluster_run ADDRESS SPEC_JSON

`SPEC_JSON` holds `RunSpec` fields. The driver joins the cluster at
`ADDRESS` (its environment carries the cluster's auth token), so the
supervisor runs on the node this process is on, and prints the summary as
the last line of its output (`SUMMARY {...}`). Tests and benchmarks on a
cluster of several nodes (`multinode.local_cluster`) use it so their own
process needs no Ray of its own.
"""

from __future__ import annotations

import json
import sys

import ray

from remedy.cli.runner import run_supervised
from remedy.protocol.spec import RunSpec


def main() -> None:
    address, spec = sys.argv[1], json.loads(sys.argv[2])
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    summary = run_supervised(RunSpec(**spec))
    print("SUMMARY " + json.dumps(summary, default=str), flush=True)


if __name__ == "__main__":
    main()
