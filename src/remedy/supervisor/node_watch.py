"""Node loss: which nodes of the run's ranks Ray's GCS calls dead, from Ray's own node table.

On a cluster of several nodes the supervisor asks Ray for its node table
(`ray.nodes()`, one call to the GCS, in a thread and bounded by
`ASK_TIMEOUT_S` so a slow GCS never stalls the control loop) every
`POLL_S`, and at once when a rank's process is found dead (a rank's death is
often the first sign of its node's). A node the table lists as not alive is
lost: the GCS decides that after the raylet misses its health checks
(`health_check_period_ms` x `health_check_failure_threshold`: 15 s with
Ray's defaults, ~1.5 s on the test clusters, `tests/supervisor/multinode.py`).

Each lost node is reported once (`NodeWatch.new_dead`); the supervisor then
marks every rank on it lost at once (`Recovery.nodes_lost`). Nothing here
uses heartbeats of a node agent: the GCS's verdict is the signal.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import ray
import structlog

log = structlog.get_logger("remedy.node_watch")

# How often the node table is read while the job runs on several nodes.
POLL_S = 0.25
# How long one read may take before it is given up (and tried again next poll).
ASK_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class DeadNode:
    node_id: str
    ip: str
    reason: str  # Ray's words for why, where it gives any


def _why(entry: dict[str, Any]) -> str:
    """Ray's own account of a node's death, from whichever of its fields this version fills."""
    # Ray 2.60 gives `DeathReasonMessage` (words) and `DeathReason` (an enum's number).
    said = [
        str(entry[k])
        for k in ("DeathReasonMessage", "StateMessage")
        if isinstance(entry.get(k), str) and entry[k]
    ]
    return "; ".join(said) or "its raylet stopped answering the GCS's health checks"


def dead_in(listing: list[dict[str, Any]], watched: set[str]) -> list[DeadNode]:
    """The nodes of `watched` that `ray.nodes()`'s `listing` gives as not alive."""
    return [
        DeadNode(str(n["NodeID"]), str(n.get("NodeManagerAddress", "")), _why(n))
        for n in listing
        if str(n.get("NodeID")) in watched and not n.get("Alive", True)
    ]


def verdict_window_s() -> float:
    """How long Ray's GCS may take to call a node that stopped answering dead, from this
    cluster's own settings: `health_check_failure_threshold` checks, each `health_check_period_ms`
    apart and given up after `health_check_timeout_ms` (65 s with Ray's defaults; a raylet
    that is gone refuses each check at once, and is called dead after about threshold x period)."""
    try:
        config = ray._raylet.Config  # type: ignore[attr-defined]
        period_ms = float(config.health_check_period_ms())
        timeout_ms = float(config.health_check_timeout_ms())
        threshold = float(config.health_check_failure_threshold())
    except (AttributeError, TypeError, ValueError):  # a Ray without these: its defaults
        period_ms, timeout_ms, threshold = 3000.0, 10000.0, 5.0
    return threshold * (period_ms + timeout_ms) / 1000.0 + 1.0


class NodeWatch:
    """Reads Ray's node table now and then; reports each node of the run found dead once."""

    def __init__(self, poll_s: float = POLL_S) -> None:
        self.poll_s = poll_s
        self.reported: set[str] = set()
        self._next = 0.0

    async def new_dead(self, watched: set[str], *, now: bool = False) -> list[DeadNode]:
        """Nodes of `watched` Ray calls dead and not reported before (every `poll_s`, or `now`)."""
        t = time.monotonic()
        if not watched or (not now and t < self._next):
            return []
        self._next = t + self.poll_s
        try:
            listing = await asyncio.wait_for(asyncio.to_thread(ray.nodes), ASK_TIMEOUT_S)
        except (TimeoutError, ray.exceptions.RayError) as exc:
            log.warning("node_table_unread", error=repr(exc)[:200])
            return []
        found = [d for d in dead_in(listing, watched) if d.node_id not in self.reported]
        self.reported.update(d.node_id for d in found)
        return found
