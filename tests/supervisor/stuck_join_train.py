"""`examples/pretrain_gpt.py`, with rank 2's process held in the rendezvous of generation 1.

gloo holds a survivor there for good when a peer dies after publishing its
address and before connecting (`remedy.protocol.phases.JOINING`; `python
benchmarks/rendezvous_peer_death.py` measures how often). That race takes a
few milliseconds, so `test_restart_crash_e2e.py` makes it certain: in rank
2's processes, forming generation 1 waits forever, as gloo's wait does. The
rank's control thread still answers pings, which say `joining`; a later
generation forms as usual, so rank 2's replacement is not held.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from remedy.rank import get_context
from remedy.rank.group.membership import Membership

HELD_RANK, HELD_GENERATION = 2, 1


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ctx = get_context()
    if ctx is not None and ctx.rank == HELD_RANK:
        join = Membership.join

        def held_join(self: Membership) -> None:
            while self.generation == HELD_GENERATION:
                time.sleep(1.0)
            join(self)

        Membership.join = held_join
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import pretrain_gpt  # noqa: PLC0415 - from the examples folder, put on the path above

    return pretrain_gpt.main(argv)
