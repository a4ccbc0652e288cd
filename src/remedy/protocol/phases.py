"""The phases a rank's ping answer gives (`Membership.status`), named once for both sides.

Two kinds: where the rank is in remedy's machinery (`phase`: starting, inside
a step, at a boundary, recovering, joining), and, under `loop_phase`, a phase
of the training loop's own that it is in (`rank.loop.phases`: an eval, a save,
a compile, the time between two steps), with how long it has been in it and
its bound: `{"name": "eval", "for_s": 2.5, "bound_s": 300.0}`. A ping answer of
an older remedy has no `loop_phase`, read as none.

Torch-free: the supervisor, its decision core and the node agents read them.
"""

from __future__ import annotations

from typing import Any

STARTING = "starting"  # before its Guard exists
BOUNDARY = "boundary"  # between steps
STEP = "step"  # inside a step
RECOVERING = "recovering"  # a collective failed: waiting for the order to regroup, or adopting
# Forming the ordered generation. gloo's rendezvous waits without any timeout for
# each peer it accepts a connection from (`Pair::waitUntilConnected`, torch
# 2.13): a peer that died after publishing its address, or before connecting,
# holds it there for good, and neither the collective timeout nor closing the
# store ends that wait. Measured here with 3 ranks, the third SIGKILLed within
# 50 ms of starting its rendezvous (`python benchmarks/rendezvous_peer_death.py`,
# 2026-12-03): a survivor was still in its rendezvous 15 s after the kill in 8 of
# 25 tries with the group's and the store's timeouts at 30 min, and in 12 of 25
# with both at 8 s. The supervisor
# replaces a survivor it finds still joining a generation that can no longer
# form (`supervisor.recovery.Recovery._blocked`).
JOINING = "joining"
IDLE = "idle"  # a rank actor whose training has not started or has ended

IN_LOOP = (STEP, BOUNDARY)
IN_RECOVERY = (RECOVERING, JOINING)


def regroups(ping: Any) -> bool | None:
    """Whether the rank of a ping answer survives a lost peer by re-forming the group: True
    under a Guard, False under a framework's loop (which a failed collective ends),
    None when not known (no answer, no Guard yet, or a rank of an older remedy)."""
    value = ping.get("regroups") if isinstance(ping, dict) else None
    return value if isinstance(value, bool) else None


def of(ping: Any) -> str | None:
    """The phase a rank's ping answer gives (None: no answer, or a dead actor)."""
    return ping.get("phase") if isinstance(ping, dict) else None


def loop_phase(ping: Any) -> tuple[str, float, float] | None:
    """(name, seconds in it, bound) of the loop's own phase a ping answer gives, or None
    (none, no answer, an older remedy, or a malformed entry)."""
    entry = ping.get("loop_phase") if isinstance(ping, dict) else None
    if not isinstance(entry, dict):
        return None
    name, for_s, bound_s = entry.get("name"), entry.get("for_s"), entry.get("bound_s")
    numbers = (for_s, bound_s)
    if not isinstance(name, str) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in numbers
    ):
        return None
    return name, float(for_s), float(bound_s)  # type: ignore[arg-type]


def within_phase(ping: Any) -> str | None:
    """The name of the loop's own phase a ping answer's rank is in within its bound, else None."""
    phase = loop_phase(ping)
    return phase[0] if phase is not None and phase[1] <= phase[2] else None


def phase_left_s(ping: Any) -> float | None:
    """Seconds left to the bound of the loop's own phase a ping answer's rank is in (an
    evaluation every rank runs between two steps, a save), or None: in none, past its
    bound, or no answer. Such a rank is in its own code, not in a collective: a restart
    waits for it to come to its next step within that bound."""
    phase = loop_phase(ping) if of(ping) in IN_LOOP else None  # not joining, not recovering
    return phase[2] - phase[1] if phase is not None and phase[1] <= phase[2] else None
