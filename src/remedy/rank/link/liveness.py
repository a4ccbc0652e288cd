"""Is the supervisor answering? How the ranks and the driver find a hung one, and what they do.

A dead supervisor is restarted by Ray (it is a detached actor with unbounded
restarts) and resumes from its journal. A hung one, a process that is alive
but answers nothing (SIGSTOPped, wedged in a system call, its event loop
blocked), is not: Ray restarts only a process that exits. So every caller that
waits on the supervisor (each rank's `RayReporter`, the driver's `follow`, and
under node agents each agent for its calls upward, `supervisor.agent`: its
ranks' reporters then watch the agent) keeps a `SilenceWatch`:

- A report (or a driver's call) unanswered for `bound_s` means the supervisor
  is not answering. The bound is `max(SILENCE_FLOOR_S, SILENCE_HEARTBEATS x
  heartbeat_s)`, 10 s at the Guard's 0.5 s heartbeat, or what `remedy run
  --supervisor-timeout` says. A healthy supervisor answers a report in
  milliseconds; even a loaded one answers within a second or two.
- The watcher then kills the supervisor's process (`kill`): by pid with
  SIGKILL when it runs on the watcher's node, checking first that the pid is
  still the process it learned from `SupervisorActor.where` (its start time),
  so a second watcher never kills the restarted supervisor; from another node
  through `ray.kill(no_restart=False)`, which only the driver and rank 0 (or
  rank 0's agent) do. Ray then restarts it and it resumes from its journal,
  as after a crash.
- When answers come again the watcher writes down the outage (`Outage`):
  when the oldest unanswered call went out, when it was noticed and by whom,
  how it was ended (killed, or answered again on its own) and when answers
  came back. Ranks attach these notes to their next report, the driver and
  the agents send them with `note_outage`; the supervisor journals each
  (`supervisor_outage`) and `summary.json` lists the outages merged across
  watchers. A rank's note on its agent says so (`silent: "agent"`) and is
  merged apart (`agent_outages`).
- A supervisor still silent `restart_s` after the kill (Ray could not restart
  it) is lost for good: the watcher says so in one line and the run ends as
  failed (`gave_up`).

Silences shorter than the bound but over `NOTE_S` are noted too (answered
again on their own), so a pause that resolved itself is not invisible.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil
import structlog

log = structlog.get_logger("remedy.liveness")

# The silence that counts as a hung supervisor: this long at least, and this many heartbeats.
SILENCE_FLOOR_S = 10.0
SILENCE_HEARTBEATS = 20
# A killed supervisor that does not answer within this long after the kill is lost for good
# (a restart takes 3-13 s here: a new process importing torch, then the journal).
RESTART_S = 120.0
# Shorter silences than the bound, over this, are noted as outages that ended on their own.
NOTE_S = 2.0
# Who a watcher waits on: the supervisor, or (a rank's reporter under node agents) its agent.
SILENT = ("supervisor", "agent")
# Notes one report may carry, and the longest `noticed_by` / `how` text accepted from one.
MAX_NOTES = 8
MAX_TEXT = 200


def silence_bound(heartbeat_s: float, configured: float | None = None) -> float:
    """How long a call may go unanswered before the supervisor counts as hung."""
    if configured is not None:
        return float(configured)
    return max(SILENCE_FLOOR_S, SILENCE_HEARTBEATS * heartbeat_s)


@dataclass(frozen=True)
class Identity:
    """Which process the supervisor is: its node, pid and the process's start time."""

    node: str
    pid: int
    created: float

    @classmethod
    def of_this_process(cls, node: str) -> Identity:
        return cls(node, os.getpid(), psutil.Process().create_time())

    @classmethod
    def from_wire(cls, raw: Any) -> Identity | None:
        """From `where()`'s answer (an older supervisor answers `(node, pid)` only)."""
        if isinstance(raw, list | tuple) and len(raw) in (2, 3):
            created = float(raw[2]) if len(raw) == 3 else 0.0
            return cls(str(raw[0]), int(raw[1]), created)
        return None


def kill(ident: Identity | None, handle: Any, *, here: str, may_ray_kill: bool) -> str:
    """Kill a supervisor that does not answer, so that Ray restarts it; how it went, in words.

    By pid when it runs on this node (`here`) and is still the process `ident`
    names; else through Ray (`ray.kill(no_restart=False)`, the raylet SIGKILLs
    a process that does not exit) when `may_ray_kill`; else nothing.
    """
    if ident is not None and ident.node == here:
        try:
            proc = psutil.Process(ident.pid)
            if ident.created and not math.isclose(proc.create_time(), ident.created, abs_tol=0.01):
                return f"pid {ident.pid} is another process now: the supervisor was restarted"
            os.kill(ident.pid, signal.SIGKILL)
        except (psutil.NoSuchProcess, ProcessLookupError):
            return f"pid {ident.pid} had already ended"
        except (PermissionError, psutil.AccessDenied) as exc:
            return f"could not kill pid {ident.pid}: {exc}"
        return f"killed its process (pid {ident.pid}, SIGKILL)"
    if not may_ray_kill:
        return "left to the driver and rank 0 (the supervisor runs on another node)"
    import ray  # noqa: PLC0415 - the pure parts of this module need no Ray

    try:
        ray.kill(handle, no_restart=False)
    except Exception as exc:  # an actor Ray no longer knows: nothing left to kill
        return f"ray.kill failed: {exc}"
    return "killed it through Ray (on another node)"


@dataclass
class Outage:
    """One watcher's view of one time the supervisor did not answer."""

    began: float  # wall time the oldest unanswered call went out
    noticed: float  # wall time the watcher counted it
    noticed_by: str
    killed: float | None = None  # wall time of the kill, if there was one
    how: str = ""  # what the kill did, or "answered again on its own"
    ended: float | None = None  # wall time the first answer came back
    # Whose answers were missing: the supervisor, or the node agent a rank reports to
    # (`SILENT`): a rank's reporter under node agents watches its agent.
    silent: str = "supervisor"

    def note(self) -> dict[str, Any]:
        out = asdict(self)
        if self.ended is not None:
            out["duration_s"] = round(self.ended - self.began, 3)
        return out


@dataclass
class SilenceWatch:
    """One caller's watch on the supervisor's answers (a rank's reporter, the driver).

    `check` is called with the send time of the oldest unanswered call, or None
    when nothing is outstanding; `answered` when a reply comes. The clock is
    wall time (notes compare across processes). `silent`: who the calls go to,
    the supervisor or, for a rank's reporter under node agents, its agent (the
    same watch and kill; its notes say which).
    """

    who: str
    bound_s: float
    restart_s: float = RESTART_S
    clock: Callable[[], float] = time.time
    silent: str = "supervisor"
    outage: Outage | None = None
    notes: list[dict[str, Any]] = field(default_factory=list)  # ended outages, not yet sent
    gave_up: str | None = None  # set once the supervisor is lost for good: why

    def check(self, oldest_unanswered: float | None) -> str | None:
        """ "kill" when the supervisor has just been silent past the bound; "give_up" when it stayed
        silent `restart_s` past the kill; else None."""
        if oldest_unanswered is None or self.gave_up is not None:
            return None
        now = self.clock()
        silent = now - oldest_unanswered
        if self.outage is None:
            if silent < self.bound_s:
                return None
            self.outage = Outage(
                began=oldest_unanswered, noticed=now, noticed_by=self.who, silent=self.silent
            )
            log.error(
                "supervisor_not_answering",
                who=self.who,
                silent=self.silent,
                seconds=round(silent, 1),
                bound_s=self.bound_s,
            )
            return "kill"
        since = self.outage.killed if self.outage.killed is not None else self.outage.noticed
        if now - since >= self.restart_s:
            self.gave_up = (
                f"the {'node agent' if self.silent == 'agent' else 'supervisor'} has not "
                f"answered since {_clock(self.outage.began)} "
                f"({now - self.outage.began:.0f} s): it was not restarted within "
                f"{self.restart_s:g} s of {'its kill' if self.outage.killed else 'being noticed'}"
            )
            log.error("supervisor_lost", who=self.who, reason=self.gave_up)
            return "give_up"
        return None

    def killed(self, how: str) -> None:
        if self.outage is not None:
            self.outage.killed = self.clock() if how.startswith("killed") else None
            self.outage.how = how
            log.warning("supervisor_killed", who=self.who, how=how)

    def answered(self, oldest_answered: float | None = None, *, at: float | None = None) -> None:
        """A reply came; `oldest_answered`: when the oldest call it answers went out; `at`: the
        latest moment it is known to have been missing (default: now). A caller that looks only
        now and then passes its previous look: the silence it saw ends there, not when it
        looked again."""
        now = self.clock() if at is None else at
        outage = self.outage
        if outage is None:
            if oldest_answered is not None and now - oldest_answered >= NOTE_S:
                outage = Outage(
                    began=oldest_answered, noticed=now, noticed_by=self.who, silent=self.silent
                )
            else:
                return
        outage.ended = now
        if not outage.how:
            outage.how = "answered again on its own"
        self.notes.append(outage.note())
        del self.notes[:-MAX_NOTES]
        self.outage = None
        log.warning("supervisor_answering_again", who=self.who, after_s=outage.note()["duration_s"])

    def take_notes(self) -> list[dict[str, Any]]:
        notes, self.notes = self.notes, []
        return notes


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


# ------------------------------------------------------------------ the supervisor side
def valid_note(raw: Any) -> dict[str, Any] | None:
    """An outage note from a rank or the driver as plain bounded data, else None (refused)."""
    if not isinstance(raw, Mapping):
        return None
    out: dict[str, Any] = {}
    for key in ("began", "noticed", "killed", "ended", "duration_s"):
        value = raw.get(key)
        if value is None and key in ("killed", "ended", "duration_s"):
            out[key] = None
            continue
        if (
            not isinstance(value, int | float)
            or isinstance(value, bool)
            or not math.isfinite(value)
        ):
            return None
        out[key] = float(value)
    for key in ("noticed_by", "how"):
        value = raw.get(key)
        if not isinstance(value, str) or len(value) > MAX_TEXT:
            return None
        out[key] = value
    silent = raw.get("silent", "supervisor")  # notes of earlier versions lack it
    if silent not in SILENT:
        return None
    out["silent"] = silent
    if not out["began"] <= out["noticed"]:
        return None
    return out


def merge_outages(notes: list[dict[str, Any]], silent: str = "supervisor") -> list[dict[str, Any]]:
    """The outages of `silent` (the supervisor, or the node agents) the notes describe: notes
    whose spans overlap are one outage. A rank's note on its agent's silence is not the
    supervisor's: each merges with its own kind only.

    Each outage: when it began (the earliest note's start), when answers came
    back (the latest end), its duration, who noticed it and after how long,
    and how it ended (a kill, if any watcher's kill worked).
    """
    spans = sorted(
        (
            n for n in notes
            if n.get("ended") is not None and n.get("silent", "supervisor") == silent
        ),
        key=lambda n: float(n["began"]),
    )  # fmt: skip
    merged: list[dict[str, Any]] = []
    for n in spans:
        last = merged[-1] if merged else None
        if last is not None and float(n["began"]) <= last["ended"]:
            last["ended"] = max(last["ended"], float(n["ended"]))
            last["noticed"] = min(last["noticed"], float(n["noticed"]))
            if n["noticed_by"] not in last["noticed_by"]:
                last["noticed_by"].append(n["noticed_by"])
            if n.get("killed") is not None and last.get("killed") is None:
                last["killed"], last["how"] = n["killed"], f"{n['how']} by {n['noticed_by']}"
            continue
        merged.append(
            {
                "began": float(n["began"]),
                "noticed": float(n["noticed"]),
                "ended": float(n["ended"]),
                "noticed_by": [n["noticed_by"]],
                "killed": n.get("killed"),
                "how": f"{n['how']} by {n['noticed_by']}" if n.get("killed") else n["how"],
            }
        )
    for m in merged:
        m["duration_s"] = round(m["ended"] - m["began"], 3)
        m["noticed_after_s"] = round(m["noticed"] - m["began"], 3)
    return merged
