"""Rank slots accept current incarnations only, count what they refuse, and reopen on replacement."""

from __future__ import annotations

from collections import Counter

from remedy.control.slots import (
    MAX_SEQ_AHEAD,
    SEQ_AHEAD_PER_S,
    SEQ_WINDOW,
    RankSlots,
    SlotState,
)


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
        "rank": 1, "incarnation": 2, "state": "starting", "last_seq": 0, "gaps": [], "pid": None,
        "node": None,
    }  # fmt: skip
    assert slots.live() == [0, 1]


def test_state_records_change_with_their_slot_and_only_then() -> None:
    """A slot whose record moved gets a new one (its gaps too); one that did not, or that only
    took reports in order (its last_seq, kept apart in `seqs`), gives the same dict."""
    slots = RankSlots(2)
    assert slots.accept(0, 1, 1) and slots.accept(1, 1, 1)  # both running now
    first = slots.state_records()
    assert "last_seq" not in first[0]
    assert slots.accept(1, 1, 2) and slots.accept(0, 1, 4)
    second = slots.state_records()
    assert second[1] is first[1], "in order: only its last_seq moved"
    assert slots.seqs() == {0: 4, 1: 2}
    assert second[0] is not first[0] and second[0]["gaps"] == [2, 3]
    assert slots.accept(0, 1, 2)
    assert slots.state_records()[0]["gaps"] == [3]
    assert first[0]["gaps"] == []  # a record given out is never changed
    slots.lose(1)
    assert slots.state_records()[1]["state"] == "lost"
    slots.slots[1].pid, slots.slots[1].node = 42, "n1"  # as the worker group learns them
    assert (slots.state_records()[1]["pid"], slots.state_records()[1]["node"]) == (42, "n1")
    assert slots.give_up_gaps(0, 4) == 1
    assert slots.state_records()[0]["gaps"] == []
    again = RankSlots.from_records(
        slots.state_records(), {str(r): n for r, n in slots.seqs().items()}
    )
    assert again.records() == slots.records()


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
    assert slots.slots[0].last_seq == 5 and not slots.slots[0].gaps


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


def test_a_sequence_number_far_ahead_is_refused_and_does_not_lock_the_rank_out() -> None:
    """seq 10**12 is refused (counted by reason); the real next batch is still accepted."""
    now = [100.0]
    rejected: Counter[str] = Counter()
    slots = RankSlots(1, rejected=rejected)
    assert slots.accept(0, 1, 1, now[0])
    assert not slots.accept(0, 1, 10**12, now[0])
    assert slots.accept(0, 1, 2, now[0])
    assert not slots.accept(0, 1, 2, now[0])
    assert not slots.accept(0, 5, 3, now[0])
    now[0] += 10.0  # a rank away for a while may skip as many as it could have sent
    assert slots.accept(0, 1, 2 + MAX_SEQ_AHEAD + 10 * SEQ_AHEAD_PER_S, now[0])
    assert rejected == {
        "batch_seq_too_far_ahead": 1,
        "batch_duplicate_seq": 1,
        "batch_stale_incarnation": 1,
    }


def test_a_bool_is_not_a_rank_incarnation_or_seq() -> None:
    """True == 1, but a header of booleans names no slot and moves no sequence."""
    slots = RankSlots(2)
    assert slots.accept(True, 1, 10**12)  # the controller refuses the header
    assert slots.accept(1, True, True)
    assert slots.slots[1].last_seq == 0
    assert slots.accept(1, 1, 1)


def test_a_batch_overtaken_by_a_later_one_still_counts_once() -> None:
    """Ray may run an async actor's calls out of order: seq 2 after seq 3 is accepted, a second
    seq 2 is a duplicate, and a number older than the window is refused."""
    slots = RankSlots(1)
    assert slots.accept(0, 1, 1)
    assert slots.accept(0, 1, 3)
    assert slots.accept(0, 1, 2)
    assert not slots.accept(0, 1, 2)
    assert not slots.accept(0, 1, 3)
    for seq in range(4, 4 + 3 * SEQ_WINDOW):
        assert slots.accept(0, 1, seq)
    assert not slots.slots[0].gaps  # nothing is awaited once every number came
    top = slots.slots[0].last_seq
    assert not slots.accept(0, 1, top - SEQ_WINDOW)
    assert slots.refused_duplicate == 3


def test_a_slot_rebuilt_from_its_record_takes_nothing_twice() -> None:
    """A slot rebuilt from its record takes its gaps once each and nothing else below last_seq."""
    slots = RankSlots(1)
    for seq in (1, 2, 5):
        assert slots.accept(0, 1, seq)
    again = RankSlots.from_records(slots.records())
    assert again.slots[0].gaps == {3, 4}
    assert not again.accept(0, 1, 2) and not again.accept(0, 1, 5)
    assert again.accept(0, 1, 4) and again.accept(0, 1, 3) and again.accept(0, 1, 6)
    assert not again.accept(0, 1, 3)


def test_on_node_lists_the_ranks_a_node_holds_now() -> None:
    """A node's ranks: running ones, lost ones only when asked, never a replaced or ended one."""
    slots = RankSlots(4)
    for rank, node in enumerate(["a", "b", "a", "b"]):
        slots.slots[rank].node = node
    slots.lose(3)
    slots.end(2)
    assert slots.on_node("b") == [1]
    assert slots.on_node("b", lost_too=True) == [1, 3]
    slots.replace(3)  # its new process has not said where it runs yet
    assert slots.on_node("b", lost_too=True) == [1]
    assert slots.on_node("a") == [0]


def test_gaps_given_up_are_no_longer_awaited() -> None:
    """Numbers that died with a restarted agent stop making the rank incomplete."""
    slots = RankSlots(2)
    for seq in (1, 4, 6):
        assert slots.accept(1, 1, seq)
    assert slots.incomplete() == {1}
    assert slots.give_up_gaps(1, 5) == 2  # 2 and 3
    assert slots.slots[1].gaps == {5}
    assert slots.give_up_gaps(1, 6) == 1
    assert slots.incomplete() == frozenset()
    assert not slots.accept(1, 1, 3)  # a given-up number is not taken later
    assert slots.give_up_gaps(7, 10) == 0  # no such rank
