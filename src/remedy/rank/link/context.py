"""The per-process worker context: who this rank is and whom it reports to.

A rank actor sets it before calling the user's training function; the Guard
reads it. With no context set (plain `python train.py`), the Guard runs in
single-process mode with the policy engine in-process. A rank of a process
group that another launcher started (torchrun, Ray Train) gets a context of
its own (`launcher.detect`): its real rank and the world size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from remedy.rank.chaos.faults import Fault


class Reporter(Protocol):
    """How a Guard talks to whoever decides: the Ray supervisor or a local controller."""

    def send(self, batch: dict[str, Any], *, wait: bool = False) -> None:
        """Send one report batch (events, metrics, outcomes, heartbeat); never blocks unless `wait`."""
        ...

    def poll(self) -> list[dict[str, Any]]:
        """Commands that have arrived since the last poll, as dicts; never blocks."""
        ...

    def close(self) -> None:
        """Flush and release."""
        ...


@dataclass
class WorkerContext:
    rank: int = 0
    world_size: int = 1
    run_id: str = "local"
    run_dir: Path | None = None
    reporter: Reporter | None = None
    faults: list[Fault] = field(default_factory=list)
    argv: list[str] = field(default_factory=list)
    # Set by a rank started as a replacement: resume from this durable checkpoint step.
    resume_step: int | None = None
    # Set by a rank actor of a multi-rank job: process-group membership across
    # generations (`workers.membership.Membership`); the Guard delegates to it.
    membership: Any = None
    # The run's policy replays anomalous steps: a flagged step waits at the next
    # boundary for the supervisor's decision on it (`workers.flag_hold`).
    hold_on_flag: bool = False
    # Filled by the Guard when its loop ends: this rank's totals for the run summary.
    summary: dict[str, Any] = field(default_factory=dict)
    # Set for a rank that another launcher started (torchrun, Ray Train): its name. Its
    # group decides without a supervisor (`group_decide`).
    launcher: str | None = None
    # Under a launcher: which start of the group this is (0: the first; `launcher.restart_count`
    # under torchrun, the run directory under Ray Train, `relaunch`). A restart resumes.
    attempt: int = 0


_current: WorkerContext | None = None


def set_context(ctx: WorkerContext | None) -> None:
    """Install (or clear) this process's context."""
    global _current
    _current = ctx


def get_context() -> WorkerContext | None:
    """This process's context, or None in single-process mode.

    Under another launcher (a process group of several ranks and no context
    set), a new context with this rank's rank and world size (`launcher.detect`).
    """
    if _current is not None:
        return _current
    from remedy.rank.link import launcher  # noqa: PLC0415 - imports context

    return launcher.detect()
