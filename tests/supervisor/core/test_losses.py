"""The supervisor's record of lost ranks survives its own restart: a process reported lost is not
reported again, and a node whose ranks were found lost is still named by them."""

from __future__ import annotations

import json
import time

import pytest

from remedy.control.losses import Losses, Route
from remedy.control.lost_ranks import LostRanks

WINDOW = 60.0


def test_a_process_is_reported_once_and_again_only_after_it_came_back() -> None:
    losses = Losses(WINDOW)
    assert losses.first(2, 1)
    assert not losses.first(2, 1)
    assert losses.first(2, 2)  # its replacement is another process
    losses.back(2, 2)
    assert losses.first(2, 2)
    losses.mark(3, 1)  # a restart took it in
    assert not losses.first(3, 1)


@pytest.mark.parametrize(
    ("evidence", "starting", "under_way", "route"),
    [
        (1, False, False, Route.STALE),  # about process 1, replaced by 2 already
        (None, False, False, Route.POLICY),
        (2, False, False, Route.POLICY),
        (2, True, True, Route.START_FAILED),  # a restart is starting it: that start failed
        (2, False, True, Route.JOIN),  # lost while a restart is decided or running
    ],
)
def test_where_a_loss_goes(
    evidence: int | None, starting: bool, under_way: bool, route: Route
) -> None:
    losses = Losses(WINDOW)
    assert losses.route(3, 2, evidence, starting=starting, under_way=under_way) is route
    again = losses.route(3, 2, None, starting=starting, under_way=under_way)
    assert again is (Route.POLICY if route is Route.STALE else Route.REPORTED)


def test_a_node_is_silent_once_every_rank_it_held_is_lost_within_the_window() -> None:
    losses = Losses(WINDOW)
    losses.on_node(2, "b", [2, 3], at=100.0)
    assert losses.silent_nodes(now=100.5) == set()  # rank 3 still answers
    losses.on_node(3, "b", [3], at=100.4)
    assert losses.silent_nodes(now=100.5) == {"b"}
    assert losses.earlier("b", now=100.5) == {2, 3}
    assert losses.silent_nodes(now=100.0 + WINDOW + 1) == set()  # too long ago to be one event
    assert losses.earlier("b", now=100.0 + WINDOW + 1) == set()


def test_the_record_keeps_current_processes_and_recent_losses_only() -> None:
    losses = Losses(WINDOW)
    for rank, inc in ((0, 1), (2, 1), (2, 2), (3, 1)):
        losses.first(rank, inc)
    losses.on_node(0, "a", [0, 1], at=10.0)  # long ago
    losses.on_node(2, "b", [2, 3], at=100.0)
    losses.on_node(3, "b", [2, 3], at=100.2)
    record = losses.record({0: 1, 1: 1, 2: 2, 3: 1}, now=101.0)
    # (2, 1) was replaced by incarnation 2: it can never be reported again, so it is not kept.
    assert record["reported"] == [[0, 1], [2, 2], [3, 1]]
    assert set(record["lost_on"]) == {"2", "3"} and record["held"] == {"b": [2, 3]}
    back = Losses.from_record(json.loads(json.dumps(record)), WINDOW)
    assert not back.first(2, 2) and not back.first(3, 1) and back.first(1, 1)
    assert back.silent_nodes(now=101.0) == {"b"} and back.earlier("b", now=101.0) == {2, 3}
    assert Losses.from_record(None, WINDOW).reported == set()  # an older record: none


def test_a_restarted_supervisor_keeps_what_was_lost_where() -> None:
    """Before: rank 3 of node b was found lost (and reported to the policy), then rank 2 too. The
    supervisor is restarted from its state record: node b still reads as silent (all its ranks
    lost), Ray's later verdict on it still names both ranks, and neither process is reported lost
    a second time."""
    before = LostRanks()
    now = time.time()
    assert before.losses.first(3, 1) and before.losses.first(2, 3)
    before.losses.on_node(3, "b", [2, 3], now - 1.0)
    before.losses.on_node(2, "b", [2], now - 0.5)
    incarnations = {0: 1, 1: 1, 2: 3, 3: 1}
    record = json.loads(json.dumps(before.record(incarnations, now)))  # as the state record has it

    after = LostRanks.from_record(record)
    assert after.losses.silent_nodes(time.time()) == {"b"}
    assert after.losses.earlier("b", time.time()) == {2, 3}
    assert not after.losses.first(3, 1) and not after.losses.first(2, 3)
    assert after.losses.first(0, 1)  # a rank never lost is reported when it is
