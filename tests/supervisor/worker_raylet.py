"""Start one Ray worker node (a raylet and its agents) on 127.0.0.1 and block until killed.

What `ray start --address ... --block` does, minus its refusal: with
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` (what makes Ray use 127.0.0.1 rather
than the host's address here) `ray start` refuses to start a worker node,
and with 1 it rewrites 127.0.0.1 into the host's address, where the head
does not listen. This builds the node the way `ray.cluster_utils.Cluster`
does (Ray's own one-host multi-node test cluster), in a process of its own,
so a test can kill the node by its pids.

    python tests/supervisor/worker_raylet.py GCS_ADDRESS CPUS RESOURCES_JSON \
        AGENT_PORT AGENT_GRPC_PORT METRICS_PORT RUNTIME_ENV_PORT OBJECT_MANAGER_PORT SOCKET_DIR
"""

from __future__ import annotations

import json
import signal
import sys

import ray._private.node
import ray._private.parameter


def main() -> None:
    gcs, cpus, resources, agent, agent_grpc, metrics, runtime_env, objects, sockets = sys.argv[1:10]
    params = ray._private.parameter.RayParams(
        gcs_address=gcs,
        node_ip_address="127.0.0.1",
        num_cpus=int(cpus),
        num_gpus=0,
        resources=json.loads(resources),
        object_store_memory=150 * 1024 * 1024,
        min_worker_port=0,
        max_worker_port=0,
        node_manager_port=0,
        object_manager_port=int(objects),
        include_log_monitor=False,
        # Sockets of its own: Ray numbers a node's sockets per process (`raylet.1`), so
        # two nodes started by two processes would otherwise both bind the same path.
        raylet_socket_name=f"{sockets}/raylet.sock",
        plasma_store_socket_name=f"{sockets}/plasma.sock",
        dashboard_agent_listen_port=int(agent),
        metrics_agent_port=int(agent_grpc),
        metrics_export_port=int(metrics),
        runtime_env_agent_port=int(runtime_env),
    )
    ray._private.node.Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
    print("worker node started", flush=True)
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
