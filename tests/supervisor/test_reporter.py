"""A rank's reporter never blocks on an absent supervisor, holds what it cannot send, and loses no event or outcome."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import ray

from remedy.rank.link import reporter as reporter_mod
from remedy.rank.link.reporter import RayReporter

pytestmark = [pytest.mark.ray]


@ray.remote(num_cpus=0)
class _Supervisor:
    """Takes report batches; answers none while closed (a supervisor that is away)."""

    def __init__(self, fail_seq: int | None = None) -> None:
        self.gate = asyncio.Event()
        self.gate.set()
        self.batches: list[dict[str, Any]] = []
        self.fail_seq = fail_seq

    async def close(self) -> None:
        self.gate.clear()

    async def open(self) -> None:
        self.gate.set()

    async def report(self, batch: dict[str, Any]) -> list[dict[str, Any]]:
        await self.gate.wait()
        if batch["seq"] == self.fail_seq:
            raise RuntimeError("the reply is lost")
        self.batches.append(batch)
        if "holding" in batch:  # as SupervisorActor.report: settled once step 2 is reported
            held = batch["holding"]
            return {"commands": [{"echo": batch["seq"]}], "settled": held if held < 2 else None}
        return [{"echo": batch["seq"]}]

    async def seen(self) -> list[dict[str, Any]]:
        return self.batches


def _batch(i: int, *, event: bool = False, outcome: bool = False) -> dict[str, Any]:
    return {
        "rank": 0,
        "step": i,
        "tick": i,
        "events": [{"kind": "loss_spike", "n": i}] if event else [],
        "metrics": [{"step": i}],
        "outcomes": [{"decision_id": f"d{i}"}] if outcome else [],
    }


def _drain(rep: RayReporter) -> list[dict[str, Any]]:
    replies = []
    deadline = time.monotonic() + 60
    while (rep._in_flight or rep._held is not None) and time.monotonic() < deadline:
        replies += rep.poll()
        time.sleep(0.05)
    return replies + rep.poll()


@pytest.mark.timeout(120)
def test_absent_supervisor_batches_are_held_merged_and_bounded(
    ray_cluster: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While nothing answers, sends return at once; held batches merge; only the oldest metrics are dropped."""
    monkeypatch.setattr(reporter_mod, "MAX_IN_FLIGHT", 4)
    monkeypatch.setattr(reporter_mod, "MAX_HELD_METRICS", 10)
    sup = _Supervisor.remote()
    ray.get(sup.close.remote())
    rep = RayReporter(sup)
    for i in range(40):
        rep.send(_batch(i, event=i % 7 == 0, outcome=i % 11 == 0))  # returns: nothing is waited for
    assert len(rep._in_flight) == 4 and rep._held is not None
    assert rep.dropped_metrics == 40 - 4 - 10
    ray.get(sup.open.remote())
    _drain(rep)
    arrived = ray.get(sup.seen.remote())
    got = sorted(arrived, key=lambda b: b["seq"])  # waiters wake in any order
    assert [b["seq"] for b in got] == [1, 2, 3, 4, 5]  # four in flight, then one merged batch
    events = [e["n"] for b in got for e in b["events"]]
    outcomes = [o["decision_id"] for b in got for o in b["outcomes"]]
    assert events == [i for i in range(40) if i % 7 == 0]
    assert outcomes == [f"d{i}" for i in range(40) if i % 11 == 0]
    metrics = [m["step"] for b in got for m in b["metrics"]]
    assert metrics == [0, 1, 2, 3, *range(30, 40)]
    assert got[-1]["step"] == 39  # the merged batch has the newest header
    # Each says the lowest number still unanswered when it went out: 1 while 1-4 were away.
    # The merged batch went out once at least one of them was answered, whichever (the
    # waiters wake in any order): every number below its value was answered before it.
    assert [b["unanswered_from"] for b in got[:4]] == [1, 1, 1, 1]
    merged = got[-1]
    answered_before = {b["seq"] for b in arrived[: arrived.index(merged)]}
    assert set(range(1, merged["unanswered_from"])) <= answered_before
    assert merged["unanswered_from"] <= 5
    ray.kill(sup)


@pytest.mark.timeout(120)
def test_failed_report_sends_its_events_and_outcomes_again(ray_cluster: None) -> None:
    """A report whose reply fails is not acknowledged: its event and outcome go out again, once."""
    sup = _Supervisor.remote(fail_seq=2)
    rep = RayReporter(sup)
    rep.send(_batch(0))
    rep.send(_batch(1, event=True, outcome=True))
    rep.send(_batch(2))
    time.sleep(0.5)
    rep.send(_batch(3))
    _drain(rep)
    assert rep.lost_replies == 1
    got = sorted(ray.get(sup.seen.remote()), key=lambda b: b["seq"])
    assert [e["n"] for b in got for e in b["events"]] == [1]
    assert [o["decision_id"] for b in got for o in b["outcomes"]] == ["d1"]
    assert 2 not in [b["seq"] for b in got]
    # Its contents went out again under a new number, and the next batch sent once every
    # earlier reply is collected tells the supervisor to stop awaiting 2. Not necessarily the
    # resend itself: it names the lowest number whose reply the rank has not collected, and
    # replies are collected as they arrive, in any order. On a clean clone under the whole
    # suite's load, batch 2's failure was collected before batch 1's answer (or none had
    # arrived after the 0.5 s sleep), so the resend went out naming 1, rightly.
    rep.send(_batch(4))
    _drain(rep)
    last = max(ray.get(sup.seen.remote()), key=lambda b: b["seq"])
    assert last["step"] == 4 and last["unanswered_from"] == last["seq"] > 2
    ray.kill(sup)


@pytest.mark.timeout(120)
def test_a_rank_whose_nodes_agent_comes_late_reports_through_it_once_it_is_there(
    ray_cluster: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its node joined the run, so the rank started before the node's agent answered: its
    reports go to the supervisor, and once the agent answers to its name the rest go to the
    agent (each batch to one of them, numbered on), and its silences are noted as the agent's."""
    monkeypatch.setattr(reporter_mod, "AGENT_LOOK_S", 0.0)
    sup, agent = _Supervisor.remote(), _Supervisor.remote()
    there: list[Any] = []
    looks: list[bool] = []

    def find_agent() -> Any:
        looks.append(bool(there))
        return there[0] if there else None

    rep = RayReporter(sup, find_agent=find_agent)
    assert not rep.to_agent and rep.watch.silent == "supervisor"
    for i in range(3):
        rep.send(_batch(i, event=i == 1))
    there.append(agent)  # the agent started
    for i in range(3, 6):
        rep.send(_batch(i, outcome=i == 4))
    _drain(rep)
    assert rep.to_agent and rep.watch.silent == "agent"
    assert looks[-1] is True and len(looks) == 4  # none after it was found
    direct = [b["seq"] for b in ray.get(sup.seen.remote())]
    through = [b["seq"] for b in ray.get(agent.seen.remote())]
    assert sorted(direct) == [1, 2, 3] and sorted(through) == [4, 5, 6]
    assert all(b["unanswered_from"] <= b["seq"] for b in ray.get(agent.seen.remote()))
    ray.kill(sup)
    ray.kill(agent)


@pytest.mark.timeout(60)
def test_a_holding_report_learns_when_its_tick_is_settled(ray_cluster: None) -> None:
    sup = _Supervisor.remote()  # type: ignore[attr-defined]
    rep = RayReporter(sup)
    assert rep.settled() == -1
    rep.send({**_batch(2), "holding": 2})
    assert [r["echo"] for r in _drain(rep)] == [1], "the commands of the reply still come"
    assert rep.settled() == -1, "not settled yet"
    rep.send({**_batch(2), "holding": 1})
    rep.send(_batch(3))
    assert [r["echo"] for r in _drain(rep)] == [2, 3]
    assert rep.settled() == 1
    rep.send({**_batch(3), "holding": 0})
    _drain(rep)
    assert rep.settled() == 1, "the newest settled tick is kept"
    ray.kill(sup)


@pytest.mark.timeout(60)
def test_a_settled_tick_is_seen_only_once_its_commands_are_polled(ray_cluster: None) -> None:
    """A reply that settles a tick, in but not yet polled, does not read as settled: a rank
    holding for it (workers.flag_hold) would leave without the commands decided on it."""
    sup = _Supervisor.remote()  # type: ignore[attr-defined]
    rep = RayReporter(sup)
    rep.send({**_batch(1), "holding": 1})
    ray.wait([ref for ref, _, _ in rep._in_flight], timeout=30)  # the reply is in, not taken
    assert rep.settled() == -1, "settled, with its commands not yet handed out"
    assert [r["echo"] for r in rep.poll()] == [1]
    assert rep.settled() == 1


@pytest.mark.timeout(60)
def test_a_rank_that_did_not_look_notes_no_outage_but_a_silence_it_saw_is_noted(
    ray_cluster: None,
) -> None:
    """A rank that does not look for its replies for 3 s (re-forming its group after a peer's
    loss) finds them in when it looks again: the supervisor was not silent to it, so no outage is
    noted. A supervisor that let the rank look in vain for 3 s was: that is noted."""
    sup = _Supervisor.remote()  # type: ignore[attr-defined]
    rep = RayReporter(sup)
    rep.send(_batch(0))
    time.sleep(3.0)  # not looking; the reply came long ago
    rep.poll()
    assert not rep._in_flight and rep.watch.take_notes() == []
    ray.get(sup.close.remote())
    rep.send(_batch(1))
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:  # looking, in vain
        assert rep.poll() == []
        time.sleep(0.05)
    ray.get(sup.open.remote())
    _drain(rep)
    (note,) = rep.watch.take_notes()
    assert note["how"] == "answered again on its own" and note["silent"] == "supervisor"
    assert 2.5 <= note["duration_s"] < 10.0
    # A rank whose reports go to its node's agent notes the agent's silences as the agent's.
    assert RayReporter(sup, to_agent=True).watch.silent == "agent"
    ray.kill(sup)
