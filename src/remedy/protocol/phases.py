"""The phases a rank's ping answer gives (`Membership.status`), named once for both sides.

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
