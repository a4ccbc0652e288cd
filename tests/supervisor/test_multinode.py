"""The multi-node test cluster: a head plus two worker raylets on 127.0.0.1; one is killed alone."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest

from tests.supervisor.multinode import NODE_DEATH_S, local_cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]


def test_three_nodes_start_and_one_dies_alone() -> None:
    """Three nodes join; killing one node's processes makes Ray call it dead, the others stay alive."""
    root = Path(tempfile.mkdtemp(prefix="mn-", dir="/tmp"))  # short: Ray's socket paths are bounded
    with local_cluster(root, workers=2, head_cpus=1, worker_cpus=1) as cluster:
        ids = {cluster.head_node_id, *(w.node_id for w in cluster.workers)}
        assert len(ids) == 3 and all(ids)
        victim, other = cluster.workers
        assert victim.pids() and not (victim.pids() & other.pids())
        victim.kill()
        t0 = time.monotonic()
        deadline = t0 + 60
        while time.monotonic() < deadline:
            alive = {n["NodeID"]: n["Alive"] for n in cluster.nodes()}
            if not alive[victim.node_id]:
                break
            time.sleep(0.5)
        assert alive == {cluster.head_node_id: True, victim.node_id: False, other.node_id: True}
        # Ray's verdict came from its health check, in seconds (well under its 15 s default).
        assert time.monotonic() - t0 < 60, NODE_DEATH_S
        assert not victim.pids()
