"""A Controller whose effects a test shell carries out after each call, as the supervisor does.

The Controller calls nothing of its shell: its journal lines, notifications and group
actions leave as effects (`Controller.take_effects`). `Carried` takes them after every
call a shell makes, writes the journal lines into `files` (a run directory), and answers
a `Notify` or a `GroupAction` with what the test's `notify` or `group_action` returns,
as the supervisor's `carry_control` does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from remedy.control.decide import Controller
from remedy.control.effects import GroupAction, Notify, log_notify
from remedy.policies import Decision, Engine
from remedy.rundir.journal_effects import JournalFiles, write_journal


class Carried(Controller):
    """A `Controller` with its shell: `files` gets its journal; `group_action(decision)`
    answers a group action ((outcome, detail), or None: it goes on, ended later with
    `resolve_group_action`); `notify(effect)` a notification (by default a log line)."""

    def __init__(
        self,
        engine: Engine,
        *,
        files: JournalFiles | None = None,
        group_action: Callable[[Decision], tuple[str, str] | None] | None = None,
        notify: Callable[[Notify], tuple[str, str]] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            engine, group_actions=group_action is not None, notify=notify is not None, **kwargs
        )
        self.files = files
        self.carry_group_action = group_action
        self.carry_notify = notify or log_notify
        self.carried: list[Any] = []  # every effect carried, in order

    def carry(self) -> None:
        """Carry out every effect waiting, answering those that need an answer."""
        while effects := self.take_effects():
            self.carried += effects
            for effect in write_journal(self.files, effects):
                if isinstance(effect, Notify):
                    Controller.resolve_notify(self, effect.decision_id, *self.carry_notify(effect))
                elif isinstance(effect, GroupAction):
                    assert self.carry_group_action is not None
                    result = self.carry_group_action(effect.decision)
                    if result is not None:
                        Controller.resolve_group_action(self, effect.decision.decision_id, *result)

    def ingest(self, batch: Any, **kwargs: Any) -> list[dict[str, Any]]:
        out = super().ingest(batch, **kwargs)
        self.carry()
        return out

    def stop(self, reason: str) -> bool:
        out = super().stop(reason)
        self.carry()
        return out

    def resolve_group_action(
        self, decision_id: str, outcome: str, detail: str, **extra: Any
    ) -> None:
        super().resolve_group_action(decision_id, outcome, detail, **extra)
        self.carry()

    def rewound(self, tick: int, resumed: str) -> list[str]:
        out = super().rewound(tick, resumed)
        self.carry()
        return out

    def drop_rank(self, rank: int) -> list[str]:
        out = super().drop_rank(rank)
        self.carry()
        return out

    def finish(self, reason: str = "the run ended before the ranks reported an outcome") -> None:
        super().finish(reason)
        self.carry()

    def record_anomaly(self, ev: Any) -> None:
        super().record_anomaly(ev)
        self.carry()
