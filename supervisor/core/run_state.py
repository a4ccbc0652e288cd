"""The record a restarted supervisor resumes from: `RunState`, with a schema version.

Every `state` record in `journal.wal` is a `RunState.to_record()`: the
job's phase (`JobState`), the rank slots with their incarnations, the
worker group's generation and actor names, the restart in progress (its
timeline and the tick the group must pass), and the Controller's state
(engine, pending commands with targets and outcomes, counters). A
supervisor that Ray restarts reads the last one back with
`RunState.from_record`, which reads every schema this code knows and
migrates the older ones:

- schema 1: the records of remedy up to 0.1.0 (no `schema` key, no `recovery`);
- schema 2: `schema`, `recovery` (a restart in progress continues after a
  crash) and `crashed` (chaos crash points passed, each fires once per run).

A record of a newer schema is refused with a sentence that says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from remedy.supervisor.job_state import JobState

STATE = "state"
SCHEMA = 2


class StateSchemaError(ValueError):
    """A state record this version of remedy cannot read; the message says why."""


@dataclass(frozen=True, slots=True)
class RunState:
    """What the supervisor of a run must know to carry on (see the module docstring)."""

    incarnation: int
    started: float
    job: JobState
    slots: list[dict[str, Any]]
    group: dict[str, Any] | None
    controller: dict[str, Any]
    recovery: dict[str, Any] | None = None
    # Chaos: the supervisor crash points (`RunSpec.crash_points`) already passed.
    crashed: tuple[str, ...] = ()

    def to_record(self) -> dict[str, Any]:
        """The journal record (JSON-able)."""
        return {
            "type": STATE,
            "schema": SCHEMA,
            "incarnation": self.incarnation,
            "started": self.started,
            "job": self.job.to_dict(),
            "slots": self.slots,
            "group": self.group,
            "controller": self.controller,
            "recovery": self.recovery,
            "crashed": list(self.crashed),
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> RunState:
        """The state a journal record holds, whichever schema wrote it."""
        record = migrate(record)
        return cls(
            incarnation=int(record["incarnation"]),
            started=float(record["started"]),
            job=JobState.from_dict(record["job"]),
            slots=list(record["slots"]),
            group=record["group"],
            controller=dict(record["controller"]),
            recovery=record["recovery"],
            crashed=tuple(str(p) for p in record["crashed"]),
        )


def migrate(record: dict[str, Any]) -> dict[str, Any]:
    """`record` brought up to `SCHEMA`, one schema at a time (the input is left as it is)."""
    if record.get("type") != STATE:
        raise StateSchemaError(f"not a state record: type {record.get('type')!r}")
    schema = record.get("schema", 1)
    if type(schema) is not int or schema < 1:
        raise StateSchemaError(f"a state record with schema {schema!r}: not one remedy wrote")
    if schema > SCHEMA:
        raise StateSchemaError(
            f"this run's journal was written by a newer remedy (state schema {schema}; this one "
            f"reads up to {SCHEMA}): resume it with that version"
        )
    out = dict(record)
    if schema == 1:
        # No restart could be resumed then: a record of schema 1 has none in progress.
        out["recovery"] = None
        out["crashed"] = []
        out["schema"] = schema = 2
    return out
