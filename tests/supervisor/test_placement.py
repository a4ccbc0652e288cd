"""The placement plan: ranks off the supervisor's node, spread or packed; spares where fewest run."""

from __future__ import annotations

import pytest

from remedy.supervisor.placement import Node, eligible, label, least_loaded, nodes_from_ray, plan

HEAD = Node("h" * 56, "127.0.0.1", 2.0)
W1 = Node("a" * 56, "127.0.0.1", 2.0)
W2 = Node("b" * 56, "127.0.0.1", 2.0)


def test_ranks_leave_the_supervisors_node_when_there_is_another() -> None:
    """The home node gets no rank on a cluster of several nodes, every rank on a one-node Ray."""
    assert eligible([HEAD, W1, W2], HEAD.node_id) == [W1, W2]
    assert eligible([HEAD], HEAD.node_id) == [HEAD]
    assert plan([HEAD], 3, strategy="spread", home=HEAD.node_id) == [HEAD.node_id] * 3


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        ("spread", [W1, W2, W1, W2, W1]),
        ("pack", [W1, W1, W2, W2, W1]),
    ],
)
def test_spread_round_robins_and_pack_fills_each_node_to_its_cpus(
    strategy: str, expected: list[Node]
) -> None:
    """spread: rank r on node r mod n; pack: each node up to its CPUs, then round-robin."""
    got = plan([HEAD, W1, W2], 5, strategy=strategy, home=HEAD.node_id)
    assert got == [n.node_id for n in expected]


def test_a_spare_goes_where_fewest_actors_are_and_avoids_the_lost_ranks_node() -> None:
    """Least loaded first; `avoid` (the lost rank's node) is left out while another node is there."""
    used = [W1.node_id, W1.node_id, W2.node_id]
    assert least_loaded([HEAD, W1, W2], used, home=HEAD.node_id) == W2.node_id
    assert least_loaded([HEAD, W1, W2], used, home=HEAD.node_id, avoid={W2.node_id}) == W1.node_id
    # Nothing but the avoided node is left: it is used rather than nothing.
    assert least_loaded([HEAD, W1], [], home=HEAD.node_id, avoid={W1.node_id}) == W1.node_id
    assert least_loaded([], [], home=None) is None


def test_ray_listing_keeps_alive_nodes_and_labels_read_short() -> None:
    """Dead nodes are left out of `ray.nodes()`'s listing; a label is 8 hex digits @ the address."""
    listing = [
        {"NodeID": W2.node_id, "Alive": True, "NodeManagerAddress": "127.0.0.1",
         "Resources": {"CPU": 2.0}},
        {"NodeID": W1.node_id, "Alive": False, "NodeManagerAddress": "127.0.0.1",
         "Resources": {}},
    ]  # fmt: skip
    assert nodes_from_ray(listing) == [W2]
    assert label(W1.node_id, "127.0.0.1") == "aaaaaaaa@127.0.0.1"
    assert label(W1.node_id) == "aaaaaaaa"
