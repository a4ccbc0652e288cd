"""The phases a rank's ping answer gives (`Membership.status`), named once for both sides.

Torch-free: the supervisor, its decision core and the node agents read them.
"""

from __future__ import annotations

STARTING = "starting"  # before its Guard exists
BOUNDARY = "boundary"  # between steps
STEP = "step"  # inside a step
RECOVERING = "recovering"  # a collective failed: waiting for the order to regroup, or adopting
# Forming the ordered generation. gloo's rendezvous waits without any timeout for
# each peer it accepts a connection from (`Pair::waitUntilConnected`, torch
# 2.13): a peer that died after publishing its address, or before connecting,
# holds it there for good, and neither the collective timeout nor closing the
# store ends that wait. Measured here with 3 ranks, the third SIGKILLed within
# 50 ms of starting its rendezvous (`benchmarks/rendezvous_peer_death.py`): a
# survivor was still waiting when looked at, 6-40 s on, in 11 of 52 tries, 3 of
# them with both the group's and the store's timeout at 8 s. The supervisor
# replaces a survivor it finds still joining a generation that can no longer
# form (`supervisor.recovery.Recovery._blocked`).
JOINING = "joining"
IDLE = "idle"  # a rank actor whose training has not started or has ended

IN_LOOP = (STEP, BOUNDARY)
IN_RECOVERY = (RECOVERING, JOINING)
