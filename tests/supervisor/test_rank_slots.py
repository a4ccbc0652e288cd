"""Rank slots accept current incarnations only, count what they refuse, and reopen on replacement."""

from __future__ import annotations

from remedy.supervisor.rank_slots import RankSlots, SlotState


def test_reports_of_a_replaced_incarnation_are_refused_and_counted() -> None:
    """After rank 2 is replaced, its old incarnation's reports no longer count."""
    slots = RankSlots(4)
    assert slots.accept(2, 1, 1)
    slots.lose(2)
    assert not slots.accept(2, 1, 2)  # lost: a stopped process's late message
    assert slots.replace(2) == 2
    assert not slots.accept(2, 1, 3)
    assert slots.accept(2, 2, 1)
    assert slots.refused_stale == 2
    assert slots.slots[2].state is SlotState.RUNNING


def test_duplicate_sequence_numbers_are_refused() -> None:
    """A batch sequence number seen already is refused and counted."""
    slots = RankSlots(1)
    assert slots.accept(0, 1, 1)
    assert slots.accept(0, 1, 2)
    assert not slots.accept(0, 1, 2)
    assert slots.refused_duplicate == 1


def test_reports_without_an_incarnation_are_accepted() -> None:
    """Batches of a single-process Guard carry no incarnation; nothing to compare."""
    slots = RankSlots(2)
    assert slots.accept(0, None, None)
    assert slots.accept("x", 1, 1)  # malformed ranks are the controller's to reject


def test_records_rebuild_the_picture() -> None:
    """`records()` lists every slot with its incarnation and state."""
    slots = RankSlots(2)
    slots.lose(1)
    slots.replace(1)
    assert slots.records()[1] == {
        "rank": 1, "incarnation": 2, "state": "starting", "last_seq": 0, "seen": [], "pid": None,
    }  # fmt: skip
    assert slots.live() == [0, 1]


def test_batches_retried_out_of_order_are_accepted_once() -> None:
    """After a supervisor restart Ray retries calls out of order: each seq counts once, in any order."""
    slots = RankSlots(1)
    assert slots.accept(0, 1, 1)
    assert [slots.accept(0, 1, q) for q in (4, 2, 3, 2, 4, 5)] == [
        True,
        True,
        True,
        False,
        False,
        True,
    ]
    assert slots.refused_duplicate == 2
    assert slots.slots[0].last_seq == 5 and not slots.slots[0].seen


def test_records_restore_the_slots() -> None:
    """`from_records(records())` gives the same slots, out-of-order seqs included (a restarted supervisor)."""
    slots = RankSlots(2)
    for q in (1, 3):
        slots.accept(1, 1, q)
    slots.lose(0)
    slots.replace(0)
    again = RankSlots.from_records(slots.records())
    assert again.records() == slots.records()
    assert not again.accept(1, 1, 3) and again.accept(1, 1, 2)
