"""The record a restarted supervisor resumes from: `RunRecord`, with a schema version.

`RunRecord` is frozen, and its sections are typed (`control.sections`):
the job's phase (`JobState`), the rank slots with their incarnations
(`SlotSection`, their `last_seq` apart), the worker group's generation,
actor names and spares (`GroupSection`), the Controller's state (engine,
pending commands with targets and outcomes, counters), the restart in
progress with its deadline (`RestartSection`), the losses
(`LossesSection`), the hang watch's entries (`HangSection`), the ranks'
results and the run's end, and the chaos crash points passed. Every
`state` record in `journal.wal` is a `RunRecord.to_record()` (the restart
and the losses share its JSON `recovery` section). A supervisor that Ray
restarts reads the last one back with `RunRecord.from_record`, which reads
every schema this code knows and migrates the older ones (`RunState`, the
same record with plain JSON sections, is kept for one release):

- schema 1: the records of remedy up to 0.1.0 (no `schema` key, no `recovery`);
- schema 2: `schema`, `recovery` (a restart in progress continues after a
  crash) and `crashed` (chaos crash points passed, each fires once per run);
- schema 3: the same full record, which `state_delta` records may follow
  (`StateLog`); a remedy that reads only up to schema 2 would miss them, so
  it refuses the journal instead of resuming from a stale state;
- schema 4: the restart in progress is its machine's state
  (`core.restart.RestartState`, under `recovery.restart`) in place of the
  tick the group must pass and what the latest launch started
  (`recovery.front`, `recovery.launched`);
- schema 5: the same record; a `state_delta` after it may give a per-rank
  entry as a patch (`patch`: only the fields that changed, then a slot's
  `last_seq` at each report), which a remedy that reads up to schema 4
  would miss;
- schema 6: each slot's `last_seq` is kept apart from its record, in
  `last_seq` (rank -> number): a report moves it and nothing else of the
  slot, so a delta gives those numbers, compared as plain values, instead of a
  patch of each slot record a report touched (schema-5 slot records are
  split when read);
- schema 7: `hang` (rank -> [p99 step time, first steps seen]: the hang
  watch's state, `HangWatch.record`), so a restarted supervisor watches
  each rank with its own timeout instead of a start-up allowance; read as
  empty from older records (the ranks then get the start-up allowance);
- schema 8: `ranks_ended` (rank -> each rank's final result, once every rank
  has ended: a supervisor restarted from there finishes from them) and
  `ended` (the run's status once it has ended). From schema 8 on journal.wal
  holds state records only; the journals of older schemas also held the
  run's history (`decided`, `job_state`, `run_ended`, ...), which
  `control_state.older_tail` still reads when resuming one of them. Read as
  None from older records.

A record of a newer schema is refused with a sentence that says so.

Most of a state record at thousands of ranks is per-rank (each rank's slot,
step, tick, progress mark and actor name: ~0.7 MB at 4,096 ranks), and
little of it changes between two records, which are written before every
reply that carries a new promise. `StateLog` therefore writes a full record
now and then and, in between, a `state_delta`: the sections that changed,
and of the per-rank maps (`PER_RANK`) only the ranks whose entry changed.
`fold` rebuilds the newest state from the last full record and the deltas
after it; what it returns equals the full record `StateLog` was given last.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import compress
from operator import eq, is_not, itemgetter
from typing import Any

from remedy.control.job import JobState
from remedy.control.restart import RestartState, Stage
from remedy.control.sections import (
    RESTART_KEYS,
    GroupSection,
    HangSection,
    LossesSection,
    RestartSection,
    SlotSection,
)

STATE = "state"
DELTA = "state_delta"
SCHEMA = 8
# The maps of a state record keyed by rank, as (section, key) paths; key None: the section
# itself, the list of slot records (`RankSlots.state_records`, keyed by each record's "rank")
# or a map keyed by rank.
PER_RANK: tuple[tuple[str, str | None], ...] = (
    ("slots", None),
    ("last_seq", None),
    ("group", "names"),
    ("controller", "step_of"),
    ("controller", "tick_of"),
    ("controller", "marks"),
    ("hang", None),
)
# Sections whose keys are diffed one by one (the rest of a record is replaced whole when it changed).
NESTED = ("controller", "group")
# A full record after this many deltas, so that a restore reads a bounded tail.
FULL_EVERY = 100
# ... and once the deltas since the last full record hold this many times its per-rank
# entries. A restore then folds at most that much more than one full record; at 4,096 ranks
# through agents, with 1 (a full record about every 8 deltas) the full records were half the
# bytes a state record encodes, its largest cost.
DELTA_ENTRIES_PER_FULL = 4


class StateSchemaError(ValueError):
    """A state record this version of remedy cannot read; the message says why."""


@dataclass(frozen=True, slots=True)
class RunRecord:
    """What the supervisor of a run must know to carry on, in typed sections (see the module
    docstring); `to_record` gives the journal's JSON, `from_record` reads any schema back."""

    incarnation: int
    started: float
    job: JobState
    slots: tuple[SlotSection, ...] = ()
    # rank -> its slot's last_seq (`RankSlots.seqs`): every report moves it, so it is kept
    # apart from the slots' records.
    last_seq: Mapping[int, int] = field(default_factory=dict)
    group: GroupSection | None = None
    # The Controller's own state (`Controller.state_dict`: engine, pending commands, marks).
    controller: Mapping[str, Any] = field(default_factory=dict)
    restart: RestartSection | None = None
    losses: LossesSection | None = None
    # Chaos: the supervisor crash points (`RunSpec.crash_points`) already passed.
    crashed: tuple[str, ...] = ()
    hang: HangSection = field(default_factory=HangSection)
    # rank -> its final result, once every rank has ended.
    ranks_ended: Mapping[int, Mapping[str, Any]] | None = None
    # The run's status once it has ended (`summary.json` holds the rest).
    ended: str | None = None

    @property
    def recovery(self) -> dict[str, Any] | None:
        """The JSON `recovery` section: the restart's half and the losses', or None before
        either holds anything."""
        losses = self.losses if self.losses is not None and not self.losses.empty() else None
        if self.restart is None and losses is None:
            return None
        return {
            **(self.restart.to_json() if self.restart is not None else {}),
            **(self.losses or LossesSection()).to_json(),
        }

    def to_record(self) -> dict[str, Any]:
        """The journal record (JSON-able)."""
        return {
            "type": STATE,
            "schema": SCHEMA,
            "incarnation": self.incarnation,
            "started": self.started,
            "job": self.job.to_dict(),
            "slots": [s.to_json() for s in self.slots],
            "last_seq": dict(self.last_seq),
            "group": self.group.to_json() if self.group is not None else None,
            "controller": dict(self.controller),
            "recovery": self.recovery,
            "crashed": list(self.crashed),
            "hang": self.hang.to_json(),
            "ranks_ended": (
                None
                if self.ranks_ended is None
                else {str(r): v for r, v in self.ranks_ended.items()}
            ),
            "ended": self.ended,
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> RunRecord:
        """The record a journal record holds, whichever schema wrote it."""
        record = migrate(record)
        recovery = record["recovery"]
        restart = losses = None
        if recovery is not None:
            if RESTART_KEYS & recovery.keys():
                restart = RestartSection.from_json(recovery)
            losses = LossesSection.from_json(recovery)
        return cls(
            incarnation=int(record["incarnation"]),
            started=float(record["started"]),
            job=JobState.from_dict(record["job"]),
            slots=tuple(SlotSection.from_json(s) for s in record["slots"]),
            last_seq={int(r): int(n) for r, n in record["last_seq"].items()},
            group=None if record["group"] is None else GroupSection.from_json(record["group"]),
            controller=dict(record["controller"]),
            restart=restart,
            losses=losses,
            crashed=tuple(str(p) for p in record["crashed"]),
            hang=HangSection.from_json(record["hang"]),
            ranks_ended=(
                None
                if record["ranks_ended"] is None
                else {int(r): dict(v) for r, v in record["ranks_ended"].items()}
            ),
            ended=None if record["ended"] is None else str(record["ended"]),
        )


@dataclass(frozen=True, slots=True)
class RunState:
    """The state record as plain JSON sections, as remedy up to this release read it.

    Deprecated, kept for one release for code that reads a record's sections as dicts:
    `RunRecord` is the record, with typed sections, and writes the same JSON.
    """

    incarnation: int
    started: float
    job: JobState
    slots: list[dict[str, Any]]
    group: dict[str, Any] | None
    controller: dict[str, Any]
    recovery: dict[str, Any] | None = None
    crashed: tuple[str, ...] = ()
    last_seq: dict[Any, int] = field(default_factory=dict)
    hang: dict[str, list[float]] = field(default_factory=dict)
    ranks_ended: dict[str, Any] | None = None
    ended: str | None = None

    def to_record(self) -> dict[str, Any]:
        """The journal record (JSON-able)."""
        return {
            "type": STATE,
            "schema": SCHEMA,
            "incarnation": self.incarnation,
            "started": self.started,
            "job": self.job.to_dict(),
            "slots": self.slots,
            "last_seq": self.last_seq,
            "group": self.group,
            "controller": self.controller,
            "recovery": self.recovery,
            "crashed": list(self.crashed),
            "hang": self.hang,
            "ranks_ended": self.ranks_ended,
            "ended": self.ended,
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
            last_seq={str(r): int(n) for r, n in record["last_seq"].items()},
            hang=dict(record["hang"]),
            ranks_ended=None if record["ranks_ended"] is None else dict(record["ranks_ended"]),
            ended=None if record["ended"] is None else str(record["ended"]),
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
    if schema == 2:
        # The same record; schema 3 says deltas may follow it.
        out["schema"] = schema = 3
    if schema == 3:
        out["recovery"] = _restart_of_schema_3(out)
        out["schema"] = schema = 4
    if schema == 4:
        # The same record; schema 5 says the deltas after it may patch a per-rank entry.
        out["schema"] = schema = 5
    if schema == 5:
        out["last_seq"] = {str(s["rank"]): int(s.get("last_seq", 0)) for s in out["slots"]}
        out["slots"] = [{k: v for k, v in s.items() if k != "last_seq"} for s in out["slots"]]
        out["schema"] = schema = 6
    if schema == 6:
        out["hang"] = {}
        out["schema"] = schema = 7
    if schema == 7:
        # Where the run had got to was in the history records of the journal then
        # (`ranks_ended`, `run_ended`): `control_state.older_tail` reads them.
        out["ranks_ended"] = None
        out["ended"] = None
        out["schema"] = schema = 8
    return out


def _restart_of_schema_3(record: dict[str, Any]) -> dict[str, Any] | None:
    """A schema-3 restart in progress as the restart machine's state.

    Schema 3 kept what a restarted supervisor needed to see whether the
    crashed one's launch formed the group (`launched`, `front`): its
    machine stood at the step stage. Without a launch it starts over from
    killing the lost ranks, as it did then. The decision it belongs to is
    the deferred `restart_rank` (decision_id "": whichever it is).
    """
    recovery = record.get("recovery")
    if recovery is None or "restart" in recovery:
        return recovery
    recovery = dict(recovery)
    launched = recovery.pop("launched", None)
    front = int(recovery.pop("front", 0))
    recovery["restart"] = None
    if launched is not None:
        recovery["restart"] = RestartState(
            decision_id="",
            world=len(record["slots"]),
            stage=Stage.STEP,
            ranks=tuple(sorted(int(r) for r in record["job"]["lost"])),
            front=front,
            blocked=tuple(int(r) for r in launched.get("blocked", [])),
            launched=launched,
        ).to_dict()
    return recovery


def _path(section: str, key: str | None) -> str:
    return section if key is None else f"{section}.{key}"


_PER_RANK_PATHS = frozenset(_path(section, key) for section, key in PER_RANK)


def _entries(record: dict[str, Any], section: str, key: str | None) -> dict[str, Any] | None:
    """The per-rank map at (section, key) of `record`, keyed by rank, or None. (A map's
    keys are as its record gives them: numbers in memory, strings once through JSON;
    a delta's are written as JSON strings either way.)"""
    value = record.get(section)
    if key is None:
        if isinstance(value, dict):
            return value
        if not isinstance(value, list):
            return None
        try:  # without a Python step per slot: the slot list is keyed at each record
            return dict(zip(map(_RANK, value), value, strict=True))
        except (TypeError, KeyError):  # an entry that is no slot record: skipped, as below
            return {item["rank"]: item for item in value if isinstance(item, dict)}
    if not isinstance(value, dict):
        return None
    inner = value.get(key)
    return inner if isinstance(inner, dict) else None


def _encoded(value: Any) -> str:
    """A section's text, to tell whether it changed since the last record. Keys are not
    sorted (a third of the encoding's time): a section built in another order with the
    same content is written again, which costs bytes, never a change missed."""
    return json.dumps(value, default=str)


class StateLog:
    """Turns each full state record into what journal.wal gets: itself, or a `state_delta`.

    A delta holds `set` (dotted paths of the sections, or keys of `NESTED`
    sections, that changed, with their new value), `unset` (paths no longer
    there, if any), `ranks` (for each `PER_RANK` path, the entries that changed,
    None for one removed) and `patch` (for each such path, the entries that kept
    their keys: only the fields that changed). A full
    record is written first, after `FULL_EVERY` deltas, and when the per-rank
    entries written since the last full record outnumber `DELTA_ENTRIES_PER_FULL` times
    those it holds.

    Per-rank entries are compared with `is` and `!=` against the previous
    record's, which needs an entry never to be changed once given (each record
    builds fresh ones, or gives an unchanged one again, as `RankSlots.records`
    does); every other
    section is compared by its JSON text, so a live object shared between
    records cannot hide a change.
    """

    def __init__(self) -> None:
        self._last_ranks: dict[str, dict[str, Any]] | None = None
        self._last_text: dict[str, str] = {}
        self._deltas = 0
        self._written = 0  # per-rank entries written in deltas since the full record
        self._full_size = 0  # per-rank entries in the full record
        # A full record is due to bound the tail a restore folds, and was put off (`entry`).
        self.full_due = False

    def entry(self, record: dict[str, Any], *, defer_full: bool = False) -> dict[str, Any]:
        """What to write for `record` (a `RunState.to_record()`).

        `defer_full`: a record written before a reply (a rank waits for it) is a
        delta even when one of the bounds above asks for a full record, which is
        then `full_due` for the next record written without it (the supervisor's
        loop writes it within `POLL_S`): at 4,096 ranks a full record takes tens of
        milliseconds, which a decision's reply would otherwise wait for. Only the
        first record, and one whose per-rank maps changed shape, are full anyway.
        """
        ranks = {}
        for section, key in PER_RANK:
            entries = _entries(record, section, key)
            if entries is not None:
                ranks[_path(section, key)] = entries
        sections = self._sections(record)
        text = {path: _encoded(value) for path, value in sections}
        if self._last_ranks is None or set(ranks) != set(self._last_ranks):
            return self._full(record, ranks, text)
        due = self.full_due or self._deltas >= FULL_EVERY
        if due and not defer_full:
            return self._full(record, ranks, text)
        changed: dict[str, dict[str, Any]] = {}
        patches: dict[str, dict[str, dict[str, Any]]] = {}
        count = 0
        for path, entries in ranks.items():
            last = self._last_ranks[path]
            diff = _changed(entries, last)
            count += len(diff)
            patch = _patches(diff, last)
            if patch:
                patches[path] = patch
            if diff:
                changed[path] = diff
        if due or self._written + count > DELTA_ENTRIES_PER_FULL * self._full_size:
            if not defer_full:
                return self._full(record, ranks, text)
            self.full_due = True
        sets = {path: value for path, value in sections if self._last_text.get(path) != text[path]}
        unset = sorted(self._last_text.keys() - text.keys())
        self._last_ranks, self._last_text = ranks, text
        self._deltas += 1
        self._written += count
        delta = {"type": DELTA, "schema": SCHEMA, "n": self._deltas, "set": sets, "ranks": changed}
        if patches:
            delta["patch"] = patches
        if unset:
            delta["unset"] = unset
        return delta

    def _full(
        self, record: dict[str, Any], ranks: dict[str, dict[str, Any]], text: dict[str, str]
    ) -> dict[str, Any]:
        self._last_ranks, self._last_text = ranks, text
        self._deltas = self._written = 0
        self._full_size = sum(len(e) for e in ranks.values())
        self.full_due = False
        return record

    @staticmethod
    def _sections(record: dict[str, Any]) -> list[tuple[str, Any]]:
        """(path, value) of everything outside the per-rank maps and the record's type."""
        out: list[tuple[str, Any]] = []
        for name, value in record.items():
            if name == "type" or name in _PER_RANK_PATHS:
                continue
            if name in NESTED and isinstance(value, dict):
                out.extend(
                    (f"{name}.{k}", v)
                    for k, v in value.items()
                    if f"{name}.{k}" not in _PER_RANK_PATHS
                )
            else:
                out.append((name, value))
        return out


def _changed(entries: dict[Any, Any], last: dict[Any, Any]) -> dict[Any, Any]:
    """The entries of `entries` new or changed since `last`, and None for each rank gone: by
    identity first (an unchanged slot record, or a number nobody set again, is the same
    object), then by value.

    The maps of two records nearly always hold the same ranks in the same order: then
    the keys and the values are paired up in order (`map`, `compress`, without a Python
    step per rank), and only the values not identical are compared; 4,096 ranks of which
    a few hundred moved take about a tenth of the time of the general case, which looks
    every entry up in `last` (and takes anything else)."""
    if len(entries) == len(last) and all(map(eq, entries, last)):
        moved = compress(entries.items(), map(is_not, entries.values(), last.values()))
        return {r: v for r, v in moved if last[r] != v}
    diff = {r: v for r, v in entries.items() if (was := last.get(r, _GONE)) is not v and was != v}
    for r in last.keys() - entries.keys():
        diff[r] = None
    return diff


_GONE = object()
_RANK = itemgetter("rank")


def _patches(diff: dict[str, Any], last: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Take out of `diff` each entry that is a dict with the same keys as its last one: its
    patch, only the fields that changed (a slot record whose state or pid changed, say)."""
    out: dict[str, dict[str, Any]] = {}
    for r, v in diff.items():
        was = last.get(r)
        if isinstance(v, dict) and isinstance(was, dict) and v.keys() == was.keys():
            out[r] = {k: x for k, x in v.items() if was[k] != x}
    for r in out:
        del diff[r]
    return out


def fold(records: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(the newest state: the last full record with the deltas after it applied, or None;
    the records after the last of them). The records given are left as they are."""
    base = None
    for i in range(len(records) - 1, -1, -1):
        if records[i].get("type") == STATE:
            base = i
            break
    if base is None:
        return None, records
    state = copy.deepcopy(records[base])
    last = base
    for i in range(base + 1, len(records)):
        if records[i].get("type") == DELTA:
            _apply(state, records[i])
            last = i
    return state, records[last + 1 :]


def _apply(state: dict[str, Any], delta: dict[str, Any]) -> None:
    for path in delta.get("unset", []):
        section, _, key = path.partition(".")
        if not key:
            state.pop(section, None)
        elif isinstance(state.get(section), dict):
            state[section].pop(key, None)
    for path, value in delta.get("set", {}).items():
        section, _, key = path.partition(".")
        if not key:
            state[section] = value
            continue
        if not isinstance(state.get(section), dict):
            state[section] = {}
        state[section][key] = value
    ranks, patches = delta.get("ranks", {}), delta.get("patch", {})
    for path in {*ranks, *patches}:
        entries, patch = ranks.get(path, {}), patches.get(path, {})
        section, _, key = path.partition(".")
        if not key and isinstance(state.get(section), dict):  # a map keyed by rank
            _merge(state[section], entries, patch)
            continue
        if not key:  # the slot records: a list kept in rank order
            by_rank = {str(s["rank"]): s for s in state.get(section, [])}
            _merge(by_rank, entries, patch)
            state[section] = [s for _, s in sorted(by_rank.items(), key=lambda kv: int(kv[0]))]
            continue
        if not isinstance(state.get(section), dict):
            state[section] = {}
        _merge(state[section].setdefault(key, {}), entries, patch)


def _merge(target: dict[str, Any], entries: dict[str, Any], patch: dict[str, Any]) -> None:
    """A per-rank map with a delta's whole entries (None: removed) and patches applied."""
    for rank, value in entries.items():
        if value is None:
            target.pop(rank, None)
        else:
            target[rank] = value
    for rank, fields in patch.items():
        target[rank] = {**target[rank], **fields}
