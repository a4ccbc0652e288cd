"""Carrying out what the supervisor's control state asked for, in order.

The Controller and the job's state machine write no file and call nothing of the
shell: what they ask leaves in their outboxes (`Controller.take_effects`,
`JobStateMachine.take_moves`). `carry_control` takes both and carries them out:
the journal lines into the run directory (before any state record or reply that
follows), a `Notify` sent on and a `GroupAction` started, each answered with the
input it produced (`resolve_notify`, `resolve_group_action`; a group action that
goes on asynchronously is answered later, by the restart that ends it). An answer
may ask for more (a follow-up decision): the outboxes are taken until empty.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from remedy.control.decide import Controller
from remedy.control.effects import GroupAction, Notify
from remedy.control.job import JobStateMachine
from remedy.policies import Decision
from remedy.rundir.journal_effects import JournalFiles, write_journal


def carry_control(
    controller: Controller,
    job: JobStateMachine,
    files: JournalFiles,
    *,
    notify: Callable[[Notify], tuple[str, str]],
    group_action: Callable[[Decision], tuple[str, str] | None],
) -> bool:
    """Carry out every effect and job move waiting; True if the job moved (the shell then
    writes a state record, so a supervisor restarted from here resumes from the new phase).

    `notify(effect)` returns (outcome, detail); `group_action(decision)` too, or None while
    it goes on (its end is answered by whoever carries it on).
    """
    moved = False
    while True:
        rest = write_journal(files, controller.take_effects())
        moves = job.take_moves()
        if not rest and not moves:
            return moved
        for record in moves:
            files.history(record)
            moved = True
        for effect in rest:
            if isinstance(effect, Notify):
                controller.resolve_notify(effect.decision_id, *notify(effect))
            elif isinstance(effect, GroupAction):
                result = group_action(effect.decision)
                if result is not None:
                    controller.resolve_group_action(effect.decision.decision_id, *result)


class RankNodes(Mapping[int, str]):
    """rank -> the node label of its current process, where known: what the Controller
    stamps on a rank's anomalies, read live from the shell that places the ranks."""

    def __init__(self, label: Callable[[int], str | None], world_size: int) -> None:
        self._label = label
        self._world_size = world_size

    def __getitem__(self, rank: int) -> str:
        node = self._label(rank) if 0 <= rank < self._world_size else None
        if node is None:
            raise KeyError(rank)
        return node

    def __iter__(self) -> Iterator[int]:
        return (r for r in range(self._world_size) if self._label(r) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)
