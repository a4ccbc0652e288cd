"""A step a detector flagged waits, at the next boundary, for the supervisor's decision on it.

Under a policy that replays (`replay_step`), the cure for an anomalous step
depends on an answer only a replay of that step gives, and every step trained
past it is lost when the replay goes back to it. So the ranks do not train
past a flagged step until the supervisor has decided on it:

1. Each step, after the detectors' flags and before the optimizer step, every
   rank launches one small all-reduce (`Agreement.launch_flag`): the highest
   tick any rank flagged. It runs beside the optimizer step.
2. At the next boundary every rank reads it. If a rank flagged the step, every
   rank holds there: it reports at once with `holding: <tick>`, and again
   every `RESEND_S`, until a reply says the tick is *settled* (every rank has
   reported it and every incident of it is decided; the reply carries the
   commands decided).
3. The ranks leave together (`agree_while_holding`: one all-reduce per round
   of the wait: the command seq every rank holds, whether one waited past
   `wait_s`, whether all have the settled reply) and apply the commands they
   all hold there: a replay of the flagged step starts at once, with no step
   trained past it.

A hold that brought no command (the policy decided nothing: a cooldown, a rule
that only counts) is followed by `QUIET_STEPS` steps that do not hold, so an
anomaly the policy lets run does not stall every step. A rank alone (no
process group) holds on its own flag. The supervisor's side is
`Controller.settled`.

What it costs: one 1-element all-reduce per step, overlapped with the
optimizer step, read at the boundary (a host sync of its own under NCCL), and
only with a policy that replays; a flagged step then waits one report round
trip.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

# Reports sent while holding, at most this often (each reply may bring the decision).
RESEND_S = 0.05
# After a hold that brought no command, this many steps do not hold.
QUIET_STEPS = 20
# Longest hold for a decision before the ranks go on without it (it then comes as usual).
WAIT_S = 5.0
# Holds a rank remembers for its summary (`FlagHold.holds`), the newest.
HOLDS_KEPT = 20


@dataclass
class FlagHold:
    """One rank's side: whether to hold, this step's flag, and the quiet period."""

    on: bool = False
    wait_s: float = WAIT_S
    quiet_until: int = 0  # steps before this one do not hold
    _flagged: int | None = None  # the tick this rank's detectors flagged, not yet told
    # Each flagged tick seen at a boundary and what became of it, for the rank's summary:
    # {"tick", "step", "end": "ready" | "late" | "regrouped" | "quiet", "held_s", "brought"}.
    holds: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=HOLDS_KEPT))

    def flag(self, tick: int) -> None:
        """This rank's detectors flagged the step at `tick`."""
        self._flagged = tick

    def take(self) -> int | None:
        """The flag to tell the group (or, alone, to act on); cleared."""
        tick, self._flagged = self._flagged, None
        return tick

    def due(self, tick: int | None, step: int) -> bool:
        """Whether to hold at this boundary for a flagged `tick` (the same on every rank)."""
        return self.on and tick is not None and step >= self.quiet_until

    def after(self, step: int, *, brought: bool) -> None:
        """A hold ended; with no command, the next `QUIET_STEPS` steps do not hold."""
        if not brought:
            self.quiet_until = step + QUIET_STEPS

    def note(
        self, tick: int, step: int, end: str, *, held_s: float = 0.0, brought: bool = False
    ) -> None:
        """Remember what became of the flag of `tick` at the boundary where the rank's step count
        is `step` (`end` "quiet": not held, within the quiet period after a hold that brought
        nothing)."""
        self.holds.append(
            {"tick": tick, "step": step, "end": end, "held_s": round(held_s, 3),
             "brought": brought, "quiet_until": self.quiet_until}
        )  # fmt: skip


def agree_while_holding(
    group: Any, device: Any, seq: int, *, late: bool, ready: bool = True
) -> tuple[int, bool, bool]:
    """One collective of a hold at a boundary (this module's, or a replay's for its answer).

    Returns (the command seq every rank holds, whether any rank has waited too
    long, whether every rank is `ready`): every rank leaves the hold on the
    same round, with the same commands due.
    """
    import torch  # noqa: PLC0415 - only ranks of a process group get here
    import torch.distributed as dist  # noqa: PLC0415

    t = torch.tensor([seq, -int(late), int(ready)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    agreed, any_late, all_ready = t.tolist()
    return int(agreed), any_late < 0, all_ready > 0
