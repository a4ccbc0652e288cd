"""A run that reached its last step unhealthy is `degraded`, not `completed`.

Every rank reports how its run learned (`learning` in its summary, from
`remedy.rank.loop.learning`). A run whose ranks all completed but where one
rank's last steps learned nothing (every update skipped, gradients
identically zero, the loss scale below its floor) did not end healthy: its
status is `degraded`, with the reason, and `remedy run` exits with its own
code for it. Any other status (aborted, failed, stopped) stands as it is:
those already say the run did not end well.

Pure: rank summaries in, a status and a reason out.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def degraded_reason(ranks: Iterable[dict[str, Any]]) -> str | None:
    """Why the ranks' runs ended unhealthy (the first rank that did, by rank), or None."""
    for r in sorted(ranks, key=lambda r: int(r.get("rank", 0) or 0)):
        learning = r.get("learning")
        why = learning.get("unhealthy_tail") if isinstance(learning, dict) else None
        if why:
            return f"rank {r.get('rank', 0)}: {why}"
    return None


def final_status(status: str, ranks: Iterable[dict[str, Any]]) -> tuple[str, str | None]:
    """The run's status once its health is known: `completed` becomes `degraded` (with the
    reason) when a rank ended unhealthy; every other status is kept, with no reason."""
    if status != "completed":
        return status, None
    why = degraded_reason(ranks)
    return ("degraded", why) if why else (status, None)
