"""A Ray cluster of several real nodes on 127.0.0.1: a head plus worker raylets, each killable alone.

The head is `headnode.head_node`'s (its own HOME, temp dir, free ports,
token authentication); each worker node is a raylet started by `worker_raylet.py` (as
`ray start --address ... --block` would, on 127.0.0.1), in a process session of its own, with its own CPUs and a custom
resource naming it (`remedy_node_<name>`), so a test can place work on it and
kill it (its raylet and every process below it) by its own pids. Teardown
kills each session's processes; `ray stop`, which ends every Ray on the
machine, is never called.

The cluster's GCS declares a node dead `NODE_DEATH_S` after its raylet stops
answering (`HEALTH_CHECK`): Ray's default (five missed checks three seconds
apart) would make every node-loss test wait 15 s for Ray's verdict.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tests.supervisor.headnode import (
    Head,
    _free_ports,
    head_node,
    machine_load,
    session_pids,
    stop_head,
)

# Ray's health check of each raylet by the GCS: a raylet that misses
# `failure_threshold` checks `period_ms` apart is dead. A dead raylet's port
# refuses at once, so it is declared dead after about threshold x period; a live
# one on a loaded machine gets `timeout_ms` per check before a check counts missed.
HEALTH_CHECK: dict[str, object] = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 2000,
    "health_check_failure_threshold": 3,
}
NODE_DEATH_S = 1.5
# As on the Rays remedy starts: a hung actor is SIGKILLed 0.1 s after ray.kill().
SYSTEM_CONFIG: dict[str, object] = {**HEALTH_CHECK, "kill_worker_timeout_milliseconds": 100}


def node_resource(name: str) -> str:
    """The custom resource that names node `name` (one unit of it, on that node only)."""
    return f"remedy_node_{name}"


@dataclass
class WorkerNode:
    name: str
    sid: int  # the session of its `worker_raylet.py`: every process of the node is in it
    proc: subprocess.Popen[bytes]
    log: IO[str]
    cpus: int = 1
    node_id: str = ""

    def pids(self) -> set[int]:
        return session_pids(self.sid)

    def kill(self) -> None:
        """SIGKILL every process of this node at once (its raylet, workers and agents)."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


@dataclass
class Cluster:
    head: Head
    workers: list[WorkerNode] = field(default_factory=list)
    head_node_id: str = ""

    def replace_worker(self, node_id: str, root: Path) -> WorkerNode:
        """Stop what is left of worker node `node_id` (a killed node's launcher) and start a
        fresh node in its place (a new Ray node id, the same CPUs); return it once alive."""
        old = next(w for w in self.workers if w.node_id == node_id)
        stop_head(old.sid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            old.proc.wait(timeout=30)
        old.log.close()
        new = _start_worker(self.head, root, f"{old.name}x", old.cpus)
        self.workers[self.workers.index(old)] = new
        return self._joined(new)

    def add_worker(self, name: str, root: Path, cpus: int = 2) -> WorkerNode:
        """Start one more worker node `name` (a node joining a running cluster); return it
        once alive."""
        new = _start_worker(self.head, root, name, cpus)
        self.workers.append(new)
        return self._joined(new)

    def _joined(self, new: WorkerNode) -> WorkerNode:
        deadline = time.monotonic() + 90
        while not new.node_id and time.monotonic() < deadline:
            if new.proc.poll() is not None:
                raise RuntimeError(f"worker node {new.name} failed to start")
            for n in _ask_nodes(self.head, expect=len(self.workers) + 1, timeout_s=10):
                if n["Alive"] and node_resource(new.name) in n["Resources"]:
                    new.node_id = n["NodeID"]
        if not new.node_id:
            raise RuntimeError(f"worker node {new.name} did not join the cluster")
        return new

    def replace_dead_workers(self) -> None:
        """A fresh node in place of each worker node Ray calls dead (one a test before killed)."""
        dead = {n["NodeID"] for n in self.nodes() if not n["Alive"]}
        for node_id in dead & {w.node_id for w in self.workers}:
            self.replace_worker(node_id, Path(tempfile.mkdtemp(prefix="nx-", dir="/tmp")))

    def nodes(self) -> list[dict[str, Any]]:
        """Ray's view of the cluster's nodes (`ray.nodes()`), asked from a process of its own."""
        return _ask_nodes(self.head, expect=0, timeout_s=60)


def _ask_nodes(head: Head, *, expect: int, timeout_s: float) -> list[dict[str, Any]]:
    """`ray.nodes()` once `expect` nodes are alive, from a fresh process connected to `head`."""
    script = (
        "import json, sys, time, ray\n"
        f"ray.init(address={head.address!r}, logging_level='ERROR', log_to_driver=False)\n"
        f"deadline = time.monotonic() + {timeout_s}\n"
        "while True:\n"
        "    nodes = ray.nodes()\n"
        f"    if sum(n['Alive'] for n in nodes) >= {expect} or time.monotonic() > deadline:\n"
        "        break\n"
        "    time.sleep(0.5)\n"
        "print('NODES ' + json.dumps(nodes), flush=True)\n"
    )
    out = head.run(sys.executable, "-c", script, timeout=timeout_s + 60)
    if out.returncode != 0:
        raise RuntimeError(f"could not list the cluster's nodes: {out.stderr[-2000:]}")
    line = next(x for x in out.stdout.splitlines() if x.startswith("NODES "))
    nodes: list[dict[str, Any]] = json.loads(line.removeprefix("NODES "))
    return nodes


def _start_worker(head: Head, root: Path, name: str, cpus: int) -> WorkerNode:
    agent, grpc_agent, metrics, rt_agent, objects = _free_ports(5)
    sockets = root / name  # short: a socket path is bounded (108 bytes)
    sockets.mkdir()
    argv = [
        sys.executable, str(Path(__file__).with_name("worker_raylet.py")), head.address,
        str(cpus), json.dumps({node_resource(name): 1}),
        str(agent), str(grpc_agent), str(metrics), str(rt_agent), str(objects), str(sockets),
    ]  # fmt: skip
    log = open(root / f"ray-start-{name}.log", "w")  # noqa: SIM115 - closed by the cluster's teardown
    proc = subprocess.Popen(
        argv, env=head.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    return WorkerNode(name, proc.pid, proc, log, cpus)


@contextlib.contextmanager
def local_cluster(
    root: Path,
    *,
    workers: int = 2,
    head_cpus: int = 2,
    worker_cpus: int = 2,
    system_config: dict[str, object] | None = None,
) -> Iterator[Cluster]:
    """A head plus `workers` worker nodes (`w1`, `w2`, ...) under `root`; stops only them.

    `system_config`: the head's Ray settings (default `SYSTEM_CONFIG`).

    The head carries `remedy_node_head`; each worker node `remedy_node_w<i>`.
    Returns once Ray lists every node alive, with each node's Ray node id filled in.
    """
    with head_node(
        root,
        cpus=head_cpus,
        resources={node_resource("head"): 1},
        system_config=SYSTEM_CONFIG if system_config is None else system_config,
    ) as head:
        cluster = Cluster(head)
        try:
            for i in range(1, workers + 1):
                cluster.workers.append(_start_worker(head, root, f"w{i}", worker_cpus))
            retried: dict[str, bool] = {}
            deadline = time.monotonic() + 90
            while True:
                for i, w in enumerate(cluster.workers):
                    if w.proc.poll() is None:
                        continue
                    log = (root / f"ray-start-{w.name}.log").read_text()
                    if retried.get(w.name) or "Failed to get node info" not in log:
                        raise RuntimeError(f"worker node {w.name} failed to start: {log[-2000:]}")
                    # Its raylet missed Ray's 30 s registration window (see head_node).
                    print(f"worker node {w.name} timed out starting; {machine_load()}",
                          file=sys.stderr)  # fmt: skip
                    retried[w.name] = True
                    stop_head(w.sid)
                    w.log.close()
                    (root / f"ray-start-{w.name}.log").rename(root / f"ray-start-{w.name}-1.log")
                    shutil.rmtree(root / w.name, ignore_errors=True)
                    cluster.workers[i] = _start_worker(head, root, w.name, worker_cpus)
                    deadline = time.monotonic() + 90
                nodes = _ask_nodes(head, expect=workers + 1, timeout_s=10)
                if sum(n["Alive"] for n in nodes) > workers or time.monotonic() > deadline:
                    break
            by_resource = {
                key: n["NodeID"]
                for n in nodes
                if n["Alive"]
                for key in n["Resources"]
                if key.startswith("remedy_node_")
            }
            cluster.head_node_id = by_resource.get(node_resource("head"), "")
            for w in cluster.workers:
                w.node_id = by_resource.get(node_resource(w.name), "")
                if not w.node_id:
                    log = (root / f"ray-start-{w.name}.log").read_text()[-2000:]
                    raise RuntimeError(f"worker node {w.name} did not join the cluster: {log}")
            yield cluster
        finally:
            for w in cluster.workers:
                stop_head(w.sid)  # the same scoped teardown as the head's: by session
                with contextlib.suppress(subprocess.TimeoutExpired):
                    w.proc.wait(timeout=30)
                w.log.close()
