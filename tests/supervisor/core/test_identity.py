"""A supervisor's incarnation is above every one any source remembers; the ranks' answers plan a takeover."""

from __future__ import annotations

from typing import Any

import pytest

from remedy.control.identity import (
    Lineage,
    id_incarnation,
    journal_behind,
    plan_resume,
    with_rank_ids,
)


@pytest.mark.parametrize(
    ("decision_id", "incarnation"),
    [
        ("20261207-1-abc-d00003", 1),
        ("20261207-1-abc-s2-d00001", 2),
        ("run-s17-d12345", 17),
        ("run", None),
        ("run-s2-x00001", None),
        (42, None),
    ],
)
def test_a_decision_id_names_the_incarnation_that_gave_it(
    decision_id: Any, incarnation: int | None
) -> None:
    """RUN-dNNNNN is incarnation 1's, RUN-sK-dNNNNN incarnation K's; anything else is none's."""
    assert id_incarnation(decision_id) == incarnation


@pytest.mark.parametrize(
    ("lineage", "incarnation", "lost"),
    [
        (Lineage(), 1, False),  # a new run
        (Lineage(journal_lives=1, claim_lives=1, history_lives=1, restarted=True), 2, False),
        # journal.wal deleted mid-run: the claim, the history, the ids and Ray still remember
        (Lineage(claim_lives=1, history_lives=1, seen_ids=("r-d00003",), restarted=True), 2, True),
        # everything in the run directory lost but the ranks' applied ids
        (Lineage(restarted=True, rank_ids=("r-s3-d00002",)), 4, True),
        # only Ray says it was restarted: never incarnation 1 again
        (Lineage(restarted=True), 2, True),
        # an older copy of journal.wal: its state record is from incarnation 1, the claim says 2
        (Lineage(journal_lives=1, claim_lives=2, seen_ids=("r-s2-d00001",)), 3, True),
    ],
)
def test_the_incarnation_is_above_every_source(
    lineage: Lineage, incarnation: int, lost: bool
) -> None:
    """The highest count of journal, claim, history, decision ids and Ray, plus one."""
    assert lineage.incarnation == incarnation
    assert lineage.journal_lost is lost


def test_an_id_a_rank_applied_is_never_given_again() -> None:
    """Whatever the sources say, the new incarnation's ids differ from every id a rank applied."""
    seen = ("r-d00001", "r-d00002", "r-s2-d00007")
    lineage = with_rank_ids(Lineage(journal_lives=1, restarted=True), seen)
    new = lineage.incarnation
    assert new == 3
    assert all((id_incarnation(i) or 0) < new for i in seen)


def _answer(**over: Any) -> dict[str, Any]:
    base = {
        "run_id": "r", "training": True, "generation": 2, "incarnation": 1, "step": 120,
        "unanswered_from": 40, "applied": ["r-d00003"], "max_seq": 3,
    }  # fmt: skip
    return {**base, **over}


def test_ranks_that_all_train_in_one_generation_are_taken_over() -> None:
    """Names, incarnations, generation, the report numbers answered and the command seq to pass."""
    plan = plan_resume(2, {0: ("a0", _answer()), 1: ("a1", _answer(incarnation=2, max_seq=5))})
    assert plan is not None
    assert plan.names == {0: "a0", 1: "a1"} and plan.incarnations == {0: 1, 1: 2}
    assert plan.generation == 2 and plan.last_seq == {0: 39, 1: 39} and plan.command_seq == 5
    assert plan.group_section().names == {0: "a0", 1: "a1"}


@pytest.mark.parametrize(
    "answers",
    [
        {0: ("a0", _answer())},  # a rank missing
        {0: ("a0", _answer()), 1: ("a1", _answer(generation=3))},  # a regroup under way
        {0: ("a0", _answer()), 1: ("a1", {"run_id": "r", "training": False})},  # not started
        {0: ("a0", _answer()), 1: ("a1", _answer(incarnation="1"))},  # a mistyped answer
    ],
)
def test_ranks_that_cannot_be_taken_over_as_they_are(answers: Any) -> None:
    """No plan: the group starts over, as after a supervisor that died while starting it."""
    assert plan_resume(2, answers) is None


def test_a_journal_whose_commands_the_ranks_have_passed_is_behind() -> None:
    """A rank holding command seq 5 while the journal's newest is 3: an older copy."""
    answers = {0: ("a0", _answer(max_seq=5))}
    assert journal_behind(3, answers) and not journal_behind(5, answers)
