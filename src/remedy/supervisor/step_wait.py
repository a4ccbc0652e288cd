"""A restart's wait for the group to step in its new generation, woken by reports, not polls.

While a restart waits (`restart.AwaitSteps`, or the full-group restart), each
rank's newest tick is kept here, fed by the supervisor's report path
(`Recovery.progress`); a replacement that fails, or a rank lost meanwhile,
wakes the wait too, which then gives up with why (`RestartError`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

from remedy.control import restart
from remedy.protocol.exceptions import SupervisorError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Collection, Iterable

# A replaced rank and its peers must each complete a step in the new generation within
# this long of the launch (`core.restart`, which keeps the deadline in the state record).
REGROUP_TIMEOUT_S = restart.REGROUP_TIMEOUT_S


class RestartError(SupervisorError):
    """A targeted restart did not bring the group back; the message says why."""


def ranks_text(ranks: Iterable[int]) -> str:
    ordered = sorted(ranks)
    return ("rank " if len(ordered) == 1 else "ranks ") + ", ".join(map(str, ordered))


class GroupSteps:
    """Each rank's newest tick while a restart waits on the group, and the replacements that
    failed meanwhile; `until_stepped` waits on them."""

    def __init__(self) -> None:
        self.ticks: dict[int, int] = {}  # rank -> its newest tick (only while a restart waits)
        self.failed: dict[int, str] = {}  # replacement rank -> why it failed
        self._moved = asyncio.Event()

    def wake(self) -> None:
        """Something the wait looks at changed (a rank joined the restart, say)."""
        self._moved.set()

    def progress(self, rank: int, tick: int) -> None:
        """A report of `rank` at `tick` was accepted."""
        if rank in self.ticks:
            self.ticks[rank] = tick
            self._moved.set()

    def fail(self, rank: int, why: str) -> None:
        """Replacement `rank` failed: an attempt waiting on it gives up."""
        self.failed[rank] = why
        self._moved.set()

    async def until_stepped(
        self,
        world: list[int],
        past: int,
        replaced: list[int],
        *,
        joining: Callable[[], Collection[int]],
        where: Callable[[], Awaitable[str]],
        own_phase: Callable[[list[int]], Awaitable[float]] | None = None,
        fresh: bool = False,
        deadline: float = 0.0,
    ) -> None:
        """Wait until every rank of `world` reported a tick past `past` (a step of the new
        generation).

        Raises `RestartError` when a rank of `replaced` failed, a rank is `joining` the
        restart (lost meanwhile), or at wall time `deadline` (the launch's, from the state
        record; 0: `REGROUP_TIMEOUT_S` from now), naming `where` the ranks are then. Past
        the deadline, `own_phase(ranks not stepped)` gives how much longer to wait on ranks
        that are in a phase of their loop's own (0: none, the attempt failed).
        `fresh`: no tick of this supervisor's life counts yet (after a resume).
        """
        if fresh:
            self.ticks = dict.fromkeys(world, -1)
        deadline = deadline or time.time() + REGROUP_TIMEOUT_S
        while not all(self.ticks.get(r, -1) > past for r in world):
            if joining():
                raise RestartError(f"{ranks_text(joining())} lost while the group re-formed")
            failed = {r: why for r, why in self.failed.items() if r in replaced}
            if failed:
                raise RestartError(
                    "; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items()))
                )
            left = deadline - time.time()
            if left <= 0:
                behind = [r for r in world if self.ticks.get(r, -1) <= past]
                more = await own_phase(behind) if own_phase is not None else 0.0
                if more > 0:
                    deadline = time.time() + more
                    continue
                raise RestartError(
                    f"the group did not step within {REGROUP_TIMEOUT_S:g}s of the launch "
                    f"({await where()})"
                )
            self._moved.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._moved.wait(), timeout=left)
        self.ticks = {}
