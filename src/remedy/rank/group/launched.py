"""The membership of a rank whose process group another launcher formed: a lost peer ends it.

Under `remedy run` a failed collective is survived (`membership.Membership`):
the supervisor replaces the lost rank and the survivors re-form the group.
Under torchrun or Ray Train nobody can do that from inside the group, so a
collective that fails because a peer died or hung (past the collective
timeout) ends this rank at once with `GroupLostError`, whose message says
what happened and what restarts the group: the launcher's own restarts
(`torchrun --max-restarts N`, Ray Train's `FailureConfig`), which resume
from the newest checkpoint every rank committed (`launcher.resume_step`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from remedy.rank.exceptions import GroupLostError
from remedy.rank.group.membership import (
    COLLECTIVE_TIMEOUT_ENV,
    collective_timeout,
    is_group_failure,
)

if TYPE_CHECKING:
    from remedy.rank.guard import Guard

log = structlog.get_logger("remedy.launched")

# What gloo says when a collective outlived the group's timeout (a hung peer), which the
# membership's words do not cover: "Application timeout caused pair closure" (torch 2.13).
TIMEOUT_WORDS = ("timeout", "pair closure")


def is_lost_peer(exc: BaseException) -> bool:
    """True for the errors a collective raises when a peer died, hung or timed out."""
    text = str(exc).lower()
    return is_group_failure(exc) or any(w in text for w in TIMEOUT_WORDS)


def lost_reason(launcher: str, rank: int, step: int, exc: BaseException) -> str:
    """The one sentence a rank ends with when a collective failed under `launcher`."""
    bound = collective_timeout().total_seconds()
    return (
        f"rank {rank} at step {step}: a collective of the process group failed, so a peer "
        f"died or hung (remedy's collectives time out after {bound:g} s, "
        f"{COLLECTIVE_TIMEOUT_ENV}): {_last_words(exc)}; under {launcher} remedy cannot "
        "replace a rank: the launcher's restart (torchrun --max-restarts N, Ray Train's "
        "FailureConfig(max_failures=N)) resumes the group "
        "from the newest checkpoint every rank committed"
    )


class LaunchedGroup:
    """What the Guard asks of a membership, for a group remedy did not form."""

    def __init__(self, launcher: str) -> None:
        self.launcher = launcher

    def attach(self, guard: Guard) -> None:
        """Nothing to announce: no supervisor waits for this rank."""

    def mark(self, guard: Guard) -> None:
        """No step is run again after a lost peer: nothing to mark."""

    def framework_loop(self) -> None:
        """A framework's loop: a lost peer ends it, as it ends a Guard's."""

    def recover(self, guard: Guard, exc: BaseException, *, in_step: bool) -> bool:
        """A collective failed: False if not a group failure (the caller raises it), else end
        this rank with `GroupLostError` naming the cause."""
        del in_step
        if not is_lost_peer(exc):
            return False
        reason = lost_reason(self.launcher, guard.rank, guard.step_count, exc)
        log.error("group_lost", rank=guard.rank, step=guard.step_count, error=str(exc)[:200])
        peer_lost = getattr(guard.reporter, "peer_lost", None)
        if callable(peer_lost):
            peer_lost(reason)
        raise GroupLostError(reason) from exc


def _last_words(exc: BaseException) -> str:
    """The collective's error, without the callback wrappers torch puts around it."""
    text = " ".join(str(exc).split())
    marker = "RuntimeError: "
    if marker in text:
        text = text.rsplit(marker, 1)[1]
    return text.split(" At: ")[0][:200]
