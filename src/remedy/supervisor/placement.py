"""Where ranks and warm spares run: a plan over the cluster's alive nodes, kept by node affinity.

The supervisor runs on the node `remedy run` started on (its *home*,
`launch_supervisor` pins it there). Ranks go to the other nodes when there
are any, as GPU ranks do on a cluster whose head has no GPUs; on a one-node
Ray everything stays on that node and no scheduling strategy is set, as
before placement existed.

Two strategies (`RunSpec.placement`, `remedy run --placement`):
- `spread` (default): ranks round-robin over the eligible nodes, so losing a
  node loses as few ranks as can be;
- `pack`: each node is filled up to its CPU count before the next, so ranks
  that talk most share a node.

Warm spares go where the fewest ranks and spares are, so a spare sits on
another node than the ranks it stands in for; a replacement takes a spare
from another node than the lost rank's first (`WorkerGroup._spare_or_new`).

The plan is remedy's own, carried out with Ray's node-affinity strategy
(hard: Ray 2.60's soft affinity put zero-CPU actors elsewhere than asked),
not with a Ray placement group: rank actors
reserve no CPU (`num_cpus=0`, the user's threads are theirs to set), and a
placement group cannot keep bundles off the supervisor's node.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Strategy = Literal["spread", "pack"]
STRATEGIES: tuple[str, ...] = ("spread", "pack")


@dataclass(frozen=True)
class Node:
    """One alive Ray node: its id, address and CPUs."""

    node_id: str
    ip: str
    cpus: float

    @property
    def label(self) -> str:
        return label(self.node_id, self.ip)


def label(node_id: str, ip: str | None = None) -> str:
    """A node as people read it: the first 8 hex digits of its Ray id, `@` its address."""
    short = node_id[:8]
    return f"{short}@{ip}" if ip else short


def nodes_from_ray(listing: Iterable[dict[str, Any]]) -> list[Node]:
    """The alive nodes of a `ray.nodes()` listing, in a stable order (by address, then id)."""
    alive = [
        Node(str(n["NodeID"]), str(n.get("NodeManagerAddress", "")),
             float((n.get("Resources") or {}).get("CPU", 0.0)))
        for n in listing
        if n.get("Alive")
    ]  # fmt: skip
    return sorted(alive, key=lambda n: (n.ip, n.node_id))


def eligible(nodes: Sequence[Node], home: str | None) -> list[Node]:
    """The nodes ranks may go to: every one but `home` when there is another."""
    others = [n for n in nodes if n.node_id != home]
    return others or list(nodes)


def plan(nodes: Sequence[Node], workers: int, *, strategy: str, home: str | None) -> list[str]:
    """The node id each of `workers` ranks starts on (index = rank)."""
    pool = eligible(nodes, home)
    if not pool:
        return []
    if strategy == "pack":
        order: list[str] = []
        for n in pool:
            order.extend([n.node_id] * max(1, int(n.cpus)))
        # More ranks than CPUs in all: the rest round-robin over the same nodes.
        while len(order) < workers:
            order.extend(n.node_id for n in pool)
        return order[:workers]
    return [pool[r % len(pool)].node_id for r in range(workers)]


def least_loaded(
    nodes: Sequence[Node],
    used: Iterable[str],
    *,
    home: str | None,
    avoid: Iterable[str] = (),
) -> str | None:
    """The eligible node holding the fewest of `used` (ranks and spares), not in `avoid` if it can."""
    pool = eligible(nodes, home)
    avoided = set(avoid)
    preferred = [n for n in pool if n.node_id not in avoided] or pool
    if not preferred:
        return None
    load = Counter(used)
    return min(preferred, key=lambda n: (load[n.node_id], n.ip, n.node_id)).node_id
