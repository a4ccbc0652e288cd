"""A rank lost again and again at the same step, through the run's core and the default policy:
the escalation ladder restarts it, then restarts it and rolls back (durable, older, skipped
range), then stops the run with the reason, instead of the rule's three restarts."""

from __future__ import annotations

from remedy.control.lost_ranks import RankLost
from remedy.policies._loader import bundled_policy_path
from tests.supervisor.core.test_lost_ranks import AT, make


def test_a_rank_lost_at_one_step_climbs_the_ladder_then_the_run_stops() -> None:
    """Each loss of rank 1 at step 7 after its restart (and rollback) applied is a sighting of
    one incident: rungs 0, 0, 1, 1, 2, 2, 3, 3 (rungs 1-3 restart then roll back), then notify
    and abort at the ninth loss, every decision journaled under rank-restart."""
    core = make(policy=bundled_policy_path("default").read_text(), world=2)
    controller = core.controller
    tick = 7
    for incarnation in range(1, 12):
        core.step(RankLost(1, "rank_dead", "rank 1's process is gone", AT + incarnation, {},
                           incarnation))  # fmt: skip
        if controller.abort_reason is not None:
            break
        for decision_id in list(controller.deferred):  # the shell replaced the rank
            core.slots.replace(1)
            controller.resolve_group_action(decision_id, "applied", "replaced")
        for decision_id in list(controller.pending):  # every rank applied the rollback
            for rank in (0, 1):
                tick += 1
                outcome = {"decision_id": decision_id, "rank": rank, "outcome": "applied",
                           "step": 7, "tick": tick}  # fmt: skip
                controller.ingest({"rank": rank, "step": 7, "tick": tick, "outcomes": [outcome]},
                                  answer=False)  # fmt: skip
    assert incarnation == 9, "stopped at the ninth loss"
    assert controller.abort_reason is not None
    assert "rank_dead at step 7 on rank 1 came back after every rung" in controller.abort_reason
    journal = [(d["action"], d["outcome"], (d["anomaly"].get("details") or {}).get("ladder"))
               for d in controller.decisions]  # fmt: skip
    chains = [(action, ladder["rung"] if ladder else 0) for action, _, ladder in journal]
    assert chains == [
        ("restart_rank", 0),
        ("restart_rank", 0),
        *[(a, r) for r in (1, 2, 3) for _ in range(2) for a in ("restart_rank", "rollback")],
        ("notify", 4),
        ("abort", 4),
    ], journal
    assert all(outcome == "applied" for _, outcome, _ in journal)
    assert {d["rule"] for d in controller.decisions} == {"rank-restart"}
    assert not controller.rejected
