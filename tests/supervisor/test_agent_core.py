"""The node agent's per-report work, as a plain object: checks, dedupe, digests, its state record."""

from __future__ import annotations

import time
from typing import Any

import pytest

from remedy.control.slots import RankSlots
from remedy.control.straggler import StepTimes, StragglerWatch
from remedy.supervisor.agent.core import AgentCore, digest_metrics

TOKEN = "t" * 32


def batch(rank: int, seq: int, *, step: int | None = None, incarnation: int = 1,
          events: int = 0, token: str = TOKEN, **extra: Any) -> dict[str, Any]:  # fmt: skip
    """A Guard's report: one step record, `events` anomalies, stamped as RayReporter does."""
    step = seq if step is None else step
    now = time.time()
    return {
        "rank": rank, "step": step, "tick": step, "ts": now, "incarnation": incarnation,
        "seq": seq, "token": token, "outcomes": [],
        "metrics": [{"step": step - 1, "tick": step - 1, "rank": rank, "loss": 2.0 + seq,
                     "step_time_s": 0.1 * seq, "collective_s": 0.01, "mem_bytes": 5}],
        "events": [{"kind": "data_stall", "rank": rank, "step": step - 1, "tick": step - 1,
                    "value": 2.0, "threshold": 1.0, "severity": "warning", "source": "detector",
                    "ts": now, "details": {}} for _ in range(events)],
        **extra,
    }  # fmt: skip


def core() -> AgentCore:
    return AgentCore(node="n1", token=TOKEN, world_size=16)


def test_foreign_token_and_rank_outside_the_world_are_refused() -> None:
    """A batch without the run's token, or naming a rank the world lacks, counts for nothing."""
    agent = core()
    assert not agent.take(batch(1, 1, token="x" * 32)).ok
    assert not agent.take(batch(16, 1)).ok
    assert not agent.take("not a batch").ok
    assert agent.rejected["token"] == 1
    assert agent.rejected["batch_rank"] == 1
    assert agent.rejected["batch_not_a_mapping"] == 1
    assert agent.digest() == []


def test_metrics_only_batches_become_one_digest_item_per_rank_with_every_seq() -> None:
    """Three quiet batches of rank 3: one item, the newest header, all three batch numbers."""
    agent = core()
    for seq in (1, 2, 3):
        taken = agent.take(batch(3, seq))
        assert taken.ok and taken.item is None and len(taken.metrics) == 1
    (item,) = agent.digest()
    assert item["rank"] == 3 and item["step"] == 3 and item["tick"] == 3
    assert item["seqs"] == [1, 2, 3] and item["incarnation"] == 1
    # Not the lead rank: one record, the median compute time (step less collective time).
    (record,) = item["metrics"]
    assert record["step"] == 2 and record["loss"] == 5.0
    assert record["step_time_s"] == pytest.approx(0.2 - 0.01)
    assert "mem_bytes" not in record and "collective_s" not in record
    assert agent.digest() == []


def test_lead_rank_step_records_go_up_in_full() -> None:
    """Rank 0's records are the goodput ledger's: each one goes up, trimmed."""
    records = [{"step": s, "tick": s, "rank": 0, "loss": 1.0, "step_time_s": 0.1, "x": 1}
               for s in range(4)]  # fmt: skip
    up = digest_metrics(0, records)
    assert [r["step"] for r in up] == [0, 1, 2, 3]
    assert all("x" not in r for r in up)


def test_the_lead_ranks_records_keep_their_waits_so_it_is_no_straggler() -> None:
    """Rank 0's records go up with the time they waited (in collectives, for a peer's phase),
    as the other ranks' go up as compute time: the straggler watch compares like with like
    (wall time for rank 0 and compute time for rank 1 made rank 0 look slow)."""
    lead = [{"step": s, "tick": s, "rank": 0, "loss": 1.0, "step_time_s": 0.3,
             "collective_s": 0.2, **({"phase_wait_s": 0.25} if s % 2 else {})}
            for s in range(20)]  # fmt: skip
    other = [{"step": s, "tick": s, "rank": 1, "loss": 1.0, "step_time_s": 0.11,
              "collective_s": 0.01} for s in range(20)]  # fmt: skip
    up = digest_metrics(0, lead)
    assert all(r["collective_s"] == 0.2 for r in up)
    assert [r.get("phase_wait_s") for r in up[:2]] == [None, 0.25]
    times = StepTimes(StragglerWatch(patience=1))
    events = []
    for s in range(20):
        times.add(0, up[s])
        (digested,) = digest_metrics(1, other[: s + 1])
        times.add(1, digested)
        events += times.check()
    assert events == []


def test_an_event_goes_up_at_once_with_the_ranks_pending_batches() -> None:
    """A batch with an anomaly is an immediate item carrying what the rank had pending too."""
    agent = core()
    agent.take(batch(2, 1))
    taken = agent.take(batch(2, 2, events=1))
    assert taken.item is not None
    assert taken.item["seqs"] == [1, 2]
    assert [e["kind"] for e in taken.item["events"]] == ["data_stall"]
    assert agent.digest() == []  # nothing of rank 2 is left for the digest


def test_outcomes_ride_the_next_digest_and_hold_the_answer() -> None:
    """A batch with an outcome is held: the outcome goes up with the rank's digest item."""
    agent = core()
    outcome = {"decision_id": "d1", "rank": 5, "outcome": "applied", "step": 1, "tick": 1,
               "detail": "", "result": {}, "attempts": 1}  # fmt: skip
    taken = agent.take(batch(5, 1, outcomes=[outcome]))
    assert taken.ok and taken.held and taken.item is None
    (item,) = agent.digest()
    assert [o["decision_id"] for o in item["outcomes"]] == ["d1"]
    agent.put_back([item])
    (again,) = agent.digest()
    assert [o["decision_id"] for o in again["outcomes"]] == ["d1"]


def test_batches_arriving_out_of_order_keep_the_newest_header() -> None:
    """A digest item's header is its rank's newest tick, whatever order the batches came in."""
    agent = core()
    agent.take(batch(2, 5))
    agent.take(batch(2, 3))
    (item,) = agent.digest()
    assert item["tick"] == 5 and sorted(item["seqs"]) == [3, 5]


def test_a_batch_taken_twice_is_a_duplicate() -> None:
    """The same (rank, incarnation, seq) again (a call Ray retried) is not taken again."""
    agent = core()
    assert agent.take(batch(1, 1)).ok
    again = agent.take(batch(1, 1))
    assert not again.ok and again.duplicate
    assert [i["seqs"] for i in agent.digest()] == [[1]]


def test_a_newer_incarnation_opens_a_fresh_slot_and_the_old_one_is_refused() -> None:
    """A replaced rank's process starts again from seq 1; its predecessor's late batch is stale."""
    agent = core()
    agent.take(batch(1, 5))
    agent.digest()
    assert agent.take(batch(1, 1, incarnation=2)).ok
    late = agent.take(batch(1, 6, incarnation=1))
    assert not late.ok and not late.duplicate
    assert agent.rejected["batch_stale_incarnation"] == 1


def test_commands_are_kept_per_rank_from_the_supervisors_reply() -> None:
    """Each rank is answered with its own commands from the last reply that named it."""
    agent = core()
    agent.answered({1: [{"decision_id": "d1"}], 2: []})
    assert agent.commands(1) == [{"decision_id": "d1"}]
    assert agent.commands(2) == [] and agent.commands(3) == []
    agent.answered({1: []})
    assert agent.commands(1) == []


def test_a_failed_digest_goes_out_again_merged_with_newer_batches() -> None:
    """put_back: the failed digest's seqs and records come first, the newest header wins."""
    agent = core()
    agent.take(batch(0, 1))
    items = agent.digest()
    agent.take(batch(0, 2))
    agent.put_back(items)
    (item,) = agent.digest()
    assert item["seqs"] == [1, 2]
    assert [m["step"] for m in item["metrics"]] == [0, 1]
    assert item["step"] == 2


def test_a_restarted_agent_rebuilds_from_its_record() -> None:
    """From its record a new agent knows its ranks' seqs and steps; without it, it does not."""
    agent = core()
    agent.take(batch(4, 1, step=50_000))
    assert agent.take(batch(4, 2, step=50_001)).ok
    agent.delivered(agent.digest())  # the supervisor has 1 and 2
    record = agent.record()
    reborn = core()
    reborn.restore(record)
    assert reborn.take(batch(4, 2, step=50_001)).duplicate
    assert reborn.take(batch(4, 3, step=50_002)).ok
    # It measures the next report from rank 4's last step: a jump of a million is refused.
    assert not reborn.take(batch(4, 4, step=1_050_002)).ok
    assert reborn.rejected["batch_step_too_far_ahead"] == 1
    # Without the record the same batch is a first report, and seq 2 is new again.
    fresh = core()
    assert fresh.take(batch(4, 2, step=50_001)).ok


class Upstream:
    """The supervisor's rank slots, as `SupervisorActor.report_many` works them: each item's
    numbers taken once, then those below its `unanswered_from` no longer awaited."""

    def __init__(self) -> None:
        self.slots = RankSlots(2)
        self.lost = 0

    def send(self, items: list[dict[str, Any]]) -> None:
        for item in items:
            rank = item["rank"]
            for seq in item["seqs"]:
                self.slots.accept(rank, 1, seq)
            self.lost += self.slots.answered_below(
                rank, max(item["seqs"]), item.get("unanswered_from")
            )


def test_a_restarted_agent_takes_the_retried_calls_and_nothing_is_awaited_forever() -> None:
    """SIGKILLed, an agent leaves three kinds of batch: answered and sent on; answered and not
    sent on (lost with it, step records only); taken but not answered (Ray retries them
    against the new agent, in any order, also after its first digest). The supervisor takes
    each retried batch once, as new, and stops awaiting the lost ones once a rank says it had
    them answered. (Before `unanswered_from` the new agent's first digest gave up every
    number below its newest, and retried batches arriving after it were refused as
    duplicates: an anomaly event among them would have been lost.)"""
    up, old = Upstream(), core()
    for seq in (1, 2, 3):
        old.take(batch(0, seq, unanswered_from=seq))
        old.take(batch(1, seq, unanswered_from=seq))
    items = old.digest()
    up.send(items)
    old.delivered(items)
    old.take(batch(0, 4, unanswered_from=4))  # answered, then the agent dies: lost
    # Taken, its item on its way up but not acknowledged when the record is written: the
    # rank holds it as unanswered and Ray retries it.
    assert old.take(batch(1, 4, events=1, unanswered_from=4)).item is not None
    record = old.record()
    # Killed. Ray retries rank 1's batch 4 and both ranks' batches 5-7 (in flight); each rank
    # sends 8 meanwhile, and the new agent's first digest goes up between the retries.
    new = core()
    new.restore(record)
    assert new.take(batch(1, 8, unanswered_from=4)).ok
    assert new.take(batch(0, 8, unanswered_from=5)).ok
    assert new.take(batch(1, 6, unanswered_from=4)).ok
    first = new.digest()
    up.send(first)
    new.delivered(first)
    assert up.lost == 1  # rank 0's batch 4: it was answered, and no one has it
    event = new.take(batch(1, 4, events=1, unanswered_from=4))
    assert event.item is not None and event.item["events"]  # the event goes up again
    up.send([event.item])
    retried = [new.take(batch(r, q, unanswered_from=4 if r else 5)) for r, q in
               ((0, 7), (1, 5), (0, 5))]  # fmt: skip
    assert all(t.ok for t in retried), [t for t in retried if not t.ok]
    up.send(new.digest())
    assert up.slots.refused_duplicate == 0
    assert up.slots.incomplete() == {0, 1}  # rank 0's batch 6, rank 1's 7: still on their way
    assert new.take(batch(1, 7, unanswered_from=4)).ok
    assert new.take(batch(0, 6, unanswered_from=5)).ok
    new.take(batch(0, 9, unanswered_from=9))
    new.take(batch(1, 9, unanswered_from=9))
    up.send(new.digest())
    assert up.slots.incomplete() == frozenset()  # nothing is awaited forever
    assert up.lost == 1 and up.slots.refused_duplicate == 0


def test_a_rank_that_reported_to_the_supervisor_first_is_taken_from_where_it_stands() -> None:
    """A rank on a node that joined the run started before the node's agent, so its first
    20,000 batches went to the supervisor directly. Its first batch here (20,003, sent while
    20,001 and 20,002 were still out to the supervisor) is taken, not refused as too far
    ahead; nothing it sent the supervisor is awaited here, nor taken twice upstream."""
    up, agent = Upstream(), core()
    for seq in range(1, 20_003):  # the direct reports, which the supervisor took
        up.slots.accept(1, 1, seq)
    taken = agent.take(batch(1, 20_003, unanswered_from=20_001))
    assert taken.ok and agent.rejected["batch_seq_too_far_ahead"] == 0
    assert agent.take(batch(1, 20_004, unanswered_from=20_003)).ok
    assert not agent.take(batch(1, 20_000, unanswered_from=20_000)).ok  # answered before
    items = agent.digest()
    up.send(items)
    agent.delivered(items)
    assert up.slots.refused_duplicate == 0 and up.slots.incomplete() == frozenset()
    assert {r["rank"]: r["gaps"] for r in agent.record()["slots"]}[1] == []


def test_a_number_the_supervisor_never_acknowledged_leaves_the_record_once_answered() -> None:
    """An item that failed upward is never acknowledged: its number counts as not taken in
    the state record (a retried call would be taken again) only until the rank says it had
    it answered (its contents went out again under a new number)."""
    agent = core()
    failed = agent.take(batch(2, 1, events=1, unanswered_from=1))
    assert failed.item is not None  # its call upward fails: never `delivered`
    gaps = {r["rank"]: r["gaps"] for r in agent.record()["slots"]}
    assert gaps[2] == [1]
    agent.take(batch(2, 2, events=1, unanswered_from=2))  # the rank sent it again, as 2
    gaps = {r["rank"]: r["gaps"] for r in agent.record()["slots"]}
    assert gaps[2] == [2]


def test_a_bad_unanswered_from_is_refused_and_counted() -> None:
    """Not an int, or above the batch's own number: counted, and no number is given up."""
    slots = RankSlots(1)
    for seq in (1, 3):
        slots.accept(0, 1, seq)
    assert slots.answered_below(0, 3, "2") == 0
    assert slots.answered_below(0, 3, 4) == 0
    assert slots.rejected["batch_unanswered_from"] == 2
    assert slots.answered_below(0, 3, None) == 0  # a sender that does not say
    assert slots.answered_below(0, 3, 3) == 1 and slots.incomplete() == frozenset()


def test_the_digest_period_keeps_the_supervisors_digest_calls_bounded() -> None:
    """0.5 s up to 128 agents; beyond, all agents together send at most 256 digests a second."""
    from remedy.supervisor.agent.actor import DIGEST_CALLS_PER_S, digest_period  # noqa: PLC0415

    assert [digest_period(n) for n in (0, 1, 64, 128)] == [0.5] * 4
    assert (digest_period(512), digest_period(2048)) == (2.0, 8.0)
    assert all(n / digest_period(n) <= DIGEST_CALLS_PER_S for n in (1, 100, 300, 5000))


def test_digests_are_no_more_frequent_than_the_nodes_ranks_report() -> None:
    """Ranks reporting every 1 s (an anomaly's batch early, between two of them) set a 1 s
    digest period over the run's 0.5 s; ranks reporting every 0.2 s leave 0.5 s; ranks that
    report every 30 s set 2 s at most; a replaced rank's pace is forgotten."""
    now = [time.time()]
    agent = AgentCore(node="n1", token=TOKEN, world_size=16, clock=lambda: now[0])
    assert agent.report_period() is None and agent.digest_interval(0.5) == 0.5

    def reports(ranks: range, gap: float, count: int, seq0: int = 1) -> None:
        for k in range(count):
            for r in ranks:
                agent.take(batch(r, seq0 + k, events=int(k == 3)))
            now[0] += gap

    reports(range(4), 1.0, 3)
    now[0] -= 0.7  # the anomaly's batch goes out 0.3 s after the one before
    reports(range(4), 0.3, 1, seq0=4)
    now[0] += 0.4
    reports(range(4), 1.0, 4, seq0=5)
    assert agent.report_period() == pytest.approx(1.0)
    assert agent.digest_interval(0.5) == pytest.approx(1.0)
    assert agent.digest_interval(2.0) == 2.0  # a run with many agents: its floor wins

    fast = AgentCore(node="n2", token=TOKEN, world_size=16, clock=lambda: now[0])
    for k in range(5):
        fast.take(batch(0, k + 1))
        now[0] += 0.2
    assert fast.digest_interval(0.5) == 0.5

    slow = AgentCore(node="n3", token=TOKEN, world_size=16, clock=lambda: now[0])
    for k in range(3):
        slow.take(batch(0, k + 1))
        now[0] += 30.0
    assert slow.digest_interval(0.5) == 2.0
    slow.replaced(0)
    assert slow.report_period() is None


def test_a_ranks_first_report_of_a_new_generation_hurries_the_digest() -> None:
    """`regrouped` (the first step after a restart re-formed the group, which the restart waits
    on): the report is kept for the digest, as a quiet one is, and asks for it now; the next
    report of that rank does not; the flag is not carried up."""
    agent = core()
    assert not agent.take(batch(2, 1)).hurry
    taken = agent.take(batch(2, 2, regrouped=True))
    assert taken.ok and taken.hurry and taken.item is None
    assert not agent.take(batch(2, 3)).hurry
    (item,) = agent.digest()
    assert item["seqs"] == [1, 2, 3] and "regrouped" not in item
    assert agent.rejected == {}


def test_a_failed_collective_goes_up_at_once_and_says_so() -> None:
    """A rank whose collective failed: an immediate item with the flag (the supervisor pings
    the group on it); the flag is not carried into the rank's next digest item."""
    agent = core()
    agent.take(batch(4, 1))
    taken = agent.take(batch(4, 2, collective_failed=True))
    assert taken.ok and taken.item is not None
    assert taken.item["collective_failed"] is True and taken.item["seqs"] == [1, 2]
    assert agent.rejected == {} or sum(agent.rejected.values()) == 0
    agent.take(batch(4, 3))
    (item,) = agent.digest()
    assert "collective_failed" not in item
