"""Which nodes of the run Ray's node table gives as dead, and Ray's words for why."""

from __future__ import annotations

from remedy.supervisor.node_watch import DeadNode, dead_in

LISTING = [
    {"NodeID": "a" * 56, "Alive": True, "NodeManagerAddress": "127.0.0.1"},
    {"NodeID": "b" * 56, "Alive": False, "NodeManagerAddress": "127.0.0.1",
     "DeathReason": 2, "DeathReasonMessage": "health check failed due to missing too many heartbeats"},
    {"NodeID": "c" * 56, "Alive": False, "NodeManagerAddress": "127.0.0.2"},
]  # fmt: skip


def test_only_watched_dead_nodes_are_reported_with_rays_reason() -> None:
    """A dead node the run has nothing on is not its loss; Ray's message is kept, its enum number not."""
    assert dead_in(LISTING, {"a" * 56, "b" * 56}) == [
        DeadNode("b" * 56, "127.0.0.1", "health check failed due to missing too many heartbeats")
    ]
    [quiet] = dead_in(LISTING, {"c" * 56})
    assert quiet.reason == "its raylet stopped answering the GCS's health checks"
    assert dead_in(LISTING, set()) == []
