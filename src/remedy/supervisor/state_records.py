"""journal.wal's state records: writing the run's record, and when one is owed.

The record (`control.record.RunRecord`) is the core's; the supervisor writes
it before any reply that carries a new promise leaves (`owed`: the
controller changed since the last record), at each move of the job's state,
and at least every `STATE_EVERY_S` (`due`). A reply's record may put off a
full record that only bounds the journal's tail (`StateLog.entry`) to the
loop's next pass. Calls that need a record wait for one together
(`commit`): under load one record answers many calls instead of one each.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from remedy.control.record import StateLog
from remedy.control.run_core import RunCore
from remedy.rundir.writer import RunDir

# A state record at least this often, besides the one before each new promise
# (which keeps it exact; this one only refreshes steps and losses).
STATE_EVERY_S = 30.0


class StateRecords:
    """The run's state records in journal.wal: full ones, and deltas between them."""

    def __init__(self, core: RunCore, run_dir: RunDir) -> None:
        self.core = core
        self.run_dir = run_dir
        self.unwritable = False  # ending on the run directory's write error: no records
        self._log = StateLog()
        self._changes = -1  # controller changes covered by the last state record
        self._at = 0.0
        self._committing: asyncio.Future[None] | None = None  # the record calls await

    def write(self, *, before_reply: bool = False) -> None:
        """A state record in journal.wal: what a restarted supervisor resumes from.

        `before_reply`: a call waits for it, so a full record that only bounds the
        journal's tail is put off to the loop's next pass (`StateLog.entry`).
        """
        if self.unwritable:
            return  # the run ends on its run directory's write error (the actor's `_finish`)
        # Every section is the core's: the group and the restart send theirs as they change.
        state = self.core.record(time.time())
        self.run_dir.wal(self._log.entry(state.to_record(), defer_full=before_reply))
        self._changes = self.core.controller.changes
        self._at = time.monotonic()

    def owed(self) -> bool:
        """Whether the controller promised something new since the last record."""
        return self.core.controller.changes != self._changes

    def due(self) -> bool:
        """Whether the loop writes one now: `STATE_EVERY_S` passed, or a full one was put off."""
        return time.monotonic() - self._at >= STATE_EVERY_S or self._log.full_due

    async def commit(self, keep: Callable[[], None]) -> None:
        """A state record covering every change so far (`keep` writes it if owed), shared by
        the calls waiting together.

        Each call that needs one waits for one record written after it; the
        calls Ray has queued meanwhile are taken first, so under load one record
        answers many calls instead of one each.
        """
        if not self.owed():
            return
        if self._committing is None:
            loop = asyncio.get_running_loop()
            done: asyncio.Future[None] = loop.create_future()
            self._committing = done

            def flush() -> None:
                self._committing = None
                try:
                    keep()
                except Exception as exc:  # the waiting calls fail; their senders send again
                    done.set_exception(exc)
                else:
                    done.set_result(None)

            loop.call_soon(flush)
        await asyncio.shield(self._committing)
